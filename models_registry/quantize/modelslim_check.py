"""Would vllm-ascend load this ModelSlim checkpoint? The loader's rules, applied to a directory
(quant_model_description.json + quant_model_weight_*.safetensors + config.json) without an NPU.

The release the rules are for is the console's pinned one, settings.VLLM_ASCEND_VERSION (the Makefile's
VLLM_ASCEND_TAG; tests/workers/test_engine_requirements.py keeps the two equal): it decides which rules apply
(an undescribed lm_head) and every text names it. Upstream was read at tag v0.23.0 (the pin when this was
written), paths relative to vllm-project/vllm-ascend unless they start with ``vllm/``:
* quantization/modelslim_config.py: AscendModelSlimConfig.get_quant_method, get_linear_quant_type,
  is_layer_skipped_ascend, create_scheme_for_layer (how a description entry becomes a layer method);
* quantization/methods/registry.py + methods/__init__.py: the (quant_type, "linear") scheme table;
* quantization/methods/w8a8_static.py, w8a8_dynamic.py, w8a16.py: the parameters each method creates;
* quantization/method_adapters.py: AscendLinearMethod.create_weights (per-tensor parameters are one
  PerTensorScaleParameter per fused layer, mismatch warning silenced);
* ops/layernorm.py: AscendRMSNorm (a norm bias parameter only when the description names one);
* vllm/model_executor/models/llama.py, qwen2.py: the Linear prefixes, packed_modules_mapping, biases,
  ParallelLMHead(prefix="lm_head") built with the quant config even when tied;
* vllm/model_executor/model_loader/default_loader.py: the strict "weights not initialized" check runs
  only for unquantized models, so a missing quantized tensor loads as uninitialized memory;
* ops/linear.py lines 338-343 and 431-436: AscendLinearMethod is not in vLLM's WEIGHT_LOADER_V2_SUPPORTED, so
  every parameter the method creates (method_adapters.py lines 70-98) is filled by the layer's v1
  ``weight_loader`` (vllm/model_executor/layers/linear.py: a shape assert, then ``param_data.copy_(loaded_weight)``;
  embeddings and norms: weight_utils.py default_weight_loader, the same ``copy_``). ``copy_`` casts: a tensor
  stored in another dtype loads as its value in the parameter's dtype. Only deq_scale's dtype carries meaning
  (w8a8_static.py lines 66-69: float32 values for a bfloat16 model, the float32 bits packed in int64 for a
  float16 one), so only there is a dtype difference an error; raw msModelSlim output (float32 scales,
  an integral float input_offset) loads as its values.

``check(directory)`` returns findings (rule, subject, message, severity): "error" means vllm-ascend would not
load it, or would load something other than what was calibrated; "warning" means it loads as meant, with a
remark. ``errors(findings)`` is what fails a job or the command.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings
from packaging.version import InvalidVersion, Version

DESCRIPTION = "quant_model_description.json"

ERROR, WARNING = "error", "warning"
# The first release whose modelslim_config.py get_quant_method gives a VocabParallelEmbedding with no
# "<prefix>.weight" entry UnquantizedEmbeddingMethod (v0.23.0rc1 and v0.23.0: lines 665-671; at v0.22.1rc1 the
# same layer went to create_scheme_for_layer, whose get_linear_quant_type raised KeyError 'lm_head.weight').
LM_HEAD_FLOAT_SINCE = "0.23.0rc1"
# A parameter whose dtype says how its bits are read (w8a8_static.py get_perchannel_param), not just its precision.
DTYPE_CARRIES_MEANING = ("deq_scale",)
# deq_scale's dtype in a W8A8 static checkpoint, per model dtype (w8a8_static.py lines 66-69).
DEQ_SCALE_DTYPE = {"bfloat16": "float32", "float16": "int64"}
CHECKPOINT_DTYPE = {v: k for k, v in DEQ_SCALE_DTYPE.items()}

# Linear schemes registered with @register_scheme(<type>, "linear") at tag v0.23.0 (methods/*.py).
REGISTERED_LINEAR = {
    "W8A8",
    "W8A8_DYNAMIC",
    "W8A16",
    "W8A8_MIX",
    "W8A8_MXFP8",
    "W8A8FP8_DYNAMIC",
    "W4A4_DYNAMIC",
    "W4A4_FLATQUANT_DYNAMIC",
    "W4A4_MXFP4",
    "W4A4_MXFP4_FLATQUANT",
    "W4A8_DYNAMIC",
    "W4A8_MXFP",
}
# The ones whose parameters this checker knows (the ones the console writes).
KNOWN_LAYOUTS = {"W8A8", "W8A8_DYNAMIC", "W8A16"}

# vLLM's LlamaForCausalLM / Qwen2ForCausalLM.packed_modules_mapping; vllm-ascend's own
# packed_modules_model_mapping (modelslim_config.py) has no "llama"/"qwen2" entry, so vLLM's is used.
PACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
SHARD_GROUP = {shard: fused for fused, shards in PACKED.items() for shard in shards}
ARCHITECTURES = {"llama", "qwen2", "mistral"}

RULES = {
    "description": "quant_model_description.json is present and a JSON object "
    "(modelslim_config.py maybe_update_config)",
    "weight-files": "the weights are in *.safetensors beside the description",
    "architecture": "an architecture whose Linear layers this checker knows (vLLM llama.py / qwen2.py)",
    "scheme-supported": "every quant type has a (type, 'linear') scheme in the pinned release (methods/registry.py); "
    "W8A8 static needs a float16 or bfloat16 model (w8a8_static.py creates no deq_scale "
    "otherwise)",
    "linear-described": "every Linear prefix vLLM builds has '<prefix>.weight' in the description "
    "(modelslim_config.py get_linear_quant_type looks it up); an undescribed lm_head is a warning from "
    f"v{LM_HEAD_FLOAT_SINCE} on (it loads as float), an error before",
    "packed-one-type": "the shards of a packed module share one quant type (modelslim_config.py "
    "is_layer_skipped_ascend / get_linear_quant_type raise ValueError otherwise)",
    "tensor-present": "every parameter the layer's method creates is in the files (default_loader.py: no "
    "strict check for quantized models, a missing one stays uninitialized)",
    "tensor-dtype": "deq_scale has the dtype upstream creates it with (its packing depends on it: an error); "
    "any other tensor in another dtype is cast by the loader's copy_ (a warning)",
    "tensor-shape": "each tensor has the shape upstream creates its parameter with",
    "tensor-described": "every tensor in the files has a description entry, as msModelSlim's ascendV1 format "
    "writes it: a warning, not a loader rule (the loader looks up only '<layer>.weight' entries and any key "
    "containing 'norm.bias')",
    "tensor-unexpected": "every tensor in the files is a parameter vLLM creates for this checkpoint",
    "shared-input-scale": "W8A8 static: input_scale/input_offset equal across the shards of a packed module "
    "(method_adapters.py: one parameter per fused layer, the last shard loaded wins)",
    "norm-bias-declared": "norm biases in the files are declared in the description (ops/layernorm.py "
    "AscendRMSNorm creates the bias only then)",
}


@dataclass(frozen=True)
class Finding:
    rule: str
    subject: str
    message: str
    severity: str = ERROR

    def __str__(self) -> str:
        if self.severity == WARNING:
            return f"[{self.rule}] warning: {self.subject}: {self.message}"
        return f"[{self.rule}] {self.subject}: {self.message}"


def errors(findings: list[Finding]) -> list[Finding]:
    """The findings that mean vllm-ascend would not load the checkpoint as calibrated."""
    return [f for f in findings if f.severity == ERROR]


def warnings(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.severity == WARNING]


def pinned_version() -> str:
    """The vllm-ascend release the rules are for: the console's pin (one place, settings.VLLM_ASCEND_VERSION)."""
    return str(settings.VLLM_ASCEND_VERSION).removeprefix("v")


def _at_least(version: str, since: str) -> bool:
    try:
        return Version(version) >= Version(since)
    except InvalidVersion:
        return True  # an unparsable pin (a dev build's name): the rules as read


@dataclass(frozen=True)
class Expected:
    dtype: str
    shape: tuple


@dataclass(frozen=True)
class Linear:
    prefix: str
    out_features: int
    in_features: int
    bias: bool


def _dtype_name(config: dict) -> str:
    name = str(config.get("torch_dtype") or config.get("dtype") or "float32").removeprefix("torch.")
    return {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "float": "float32"}.get(name, name)


def linear_layers(config: dict) -> list[Linear]:
    """The Linear layers (checkpoint prefixes, before packing) vLLM builds for a llama/qwen2 config."""
    hidden = config["hidden_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    inter = config["intermediate_size"]
    qwen2 = config.get("model_type") == "qwen2"
    # qwen2.py: QKVParallelLinear(bias=True), o_proj bias=False, MLP bias=False;
    # llama.py: attention_bias on q/k/v and o_proj, mlp_bias on the MLP.
    qkv_bias = qwen2 or bool(config.get("attention_bias"))
    o_bias = (not qwen2) and bool(config.get("attention_bias"))
    mlp_bias = (not qwen2) and bool(config.get("mlp_bias"))
    layers = []
    for i in range(config["num_hidden_layers"]):
        attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        layers += [
            Linear(f"{attn}.q_proj", heads * head_dim, hidden, qkv_bias),
            Linear(f"{attn}.k_proj", kv_heads * head_dim, hidden, qkv_bias),
            Linear(f"{attn}.v_proj", kv_heads * head_dim, hidden, qkv_bias),
            Linear(f"{attn}.o_proj", hidden, heads * head_dim, o_bias),
            Linear(f"{mlp}.gate_proj", inter, hidden, mlp_bias),
            Linear(f"{mlp}.up_proj", inter, hidden, mlp_bias),
            Linear(f"{mlp}.down_proj", hidden, inter, mlp_bias),
        ]
    # llama.py / qwen2.py: ParallelLMHead(..., quant_config=quant_config, prefix="lm_head") is built and
    # asks the quant config for a method even when tie_word_embeddings then ties it to embed_tokens.
    layers.append(Linear("lm_head", config["vocab_size"], hidden, False))
    return layers


def method_params(qtype: str, layer: Linear, params_dtype: str) -> dict[str, Expected]:
    """Parameter name → dtype/shape, as the scheme's get_weight / get_pertensor_param /
    get_perchannel_param create them (read at tag v0.23.0; the per-shard slice for packed layers)."""
    n, k = layer.out_features, layer.in_features
    params = {"weight": Expected("int8", (n, k))}  # all three: torch.empty(out, in, dtype=torch.int8)
    if qtype == "FLOAT":
        params = {"weight": Expected(params_dtype, (n, k))}
    elif qtype == "W8A8":  # methods/w8a8_static.py
        params["input_scale"] = Expected(params_dtype, (1,))
        params["input_offset"] = Expected("int8", (1,))
        params["quant_bias"] = Expected("int32", (n,))
        if params_dtype == "bfloat16":
            params["deq_scale"] = Expected("float32", (n,))
        elif params_dtype == "float16":  # the float32 bits packed in int64
            params["deq_scale"] = Expected("int64", (n,))
        params["weight_scale"] = Expected(params_dtype, (n, 1))
        params["weight_offset"] = Expected(params_dtype, (n, 1))
    elif qtype in ("W8A8_DYNAMIC", "W8A16"):  # methods/w8a8_dynamic.py, methods/w8a16.py
        params["weight_scale"] = Expected(params_dtype, (n, 1))
        params["weight_offset"] = Expected(params_dtype, (n, 1))
    if layer.bias:  # vLLM's LinearBase creates the bias itself, in params_dtype, whatever the method
        params["bias"] = Expected(params_dtype, (n,))
    return params


def read_directory(directory: Path) -> tuple[dict | None, dict, dict, list[Finding]]:
    """(description, config, {tensor name: (dtype, shape, file)}, findings) without loading tensor data."""
    from safetensors import safe_open

    directory = Path(directory)
    findings, desc, config, tensors = [], None, {}, {}
    try:
        desc = json.loads((directory / DESCRIPTION).read_text())
        if not isinstance(desc, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as exc:
        desc = None
        findings.append(Finding("description", DESCRIPTION, f"cannot be read: {exc}"))
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError) as exc:
        findings.append(Finding("architecture", "config.json", f"cannot be read: {exc}"))
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        findings.append(Finding("weight-files", str(directory), "no *.safetensors files"))
    for path in files:
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                tensors[name] = (safetensors_dtype(sl.get_dtype()), tuple(sl.get_shape()), path.name)
    return desc, config, tensors, findings


def safetensors_dtype(code: str) -> str:
    return {
        "BF16": "bfloat16",
        "F16": "float16",
        "F32": "float32",
        "F64": "float64",
        "I8": "int8",
        "U8": "uint8",
        "I16": "int16",
        "I32": "int32",
        "I64": "int64",
        "BOOL": "bool",
    }.get(code, code)


def check(directory: Path, *, version: str | None = None) -> list[Finding]:
    """Every rule in RULES over one checkpoint directory, for vllm-ascend ``version`` (default: the pinned
    release); no errors() when it would load it."""
    version = (version or pinned_version()).removeprefix("v")
    desc, config, tensors, findings = read_directory(directory)
    if desc is None or not config:
        return findings
    if config.get("model_type") not in ARCHITECTURES:
        return findings + [
            Finding(
                "architecture",
                str(config.get("model_type")),
                f"not one of {sorted(ARCHITECTURES)}: its Linear layers are not known here",
            )
        ]
    params_dtype = _dtype_name(config)
    tied = bool(config.get("tie_word_embeddings"))
    layers = linear_layers(config)
    findings += _check_schemes(desc, params_dtype, version)
    expected: dict[str, Expected] = {}
    unchecked = []
    for layer in layers:
        qtype = desc.get(f"{layer.prefix}.weight")
        if qtype is None:
            findings.append(_undescribed(layer.prefix, version))
            if layer.prefix != "lm_head":
                unchecked.append(f"{layer.prefix}.")  # loading stops at the KeyError: one finding is enough
                continue
            qtype = "FLOAT"  # what v0.23.0rc1 and later make of an undescribed lm_head (before: named above)
        if qtype != "FLOAT" and qtype not in KNOWN_LAYOUTS:
            unchecked.append(f"{layer.prefix}.")  # named by scheme-supported; its tensors are not known here
            continue
        for name, exp in method_params(qtype, layer, params_dtype).items():
            expected[f"{layer.prefix}.{name}"] = exp
    findings += _check_packed(desc, layers)
    findings += _check_others(config, desc, tensors, expected, params_dtype)
    findings += _check_tensors(desc, tensors, expected, tied, tuple(unchecked))
    findings += _check_shared_input_scale(directory, desc, tensors, layers)
    return findings


def _undescribed(prefix: str, version: str) -> Finding:
    if prefix == "lm_head":
        # From v0.23.0rc1 an undescribed lm_head gets UnquantizedEmbeddingMethod (modelslim_config.py lines
        # 665-671, added by ebad45e366 for Qwen3-Omni): it loads as float, as msModelSlim's own "FLOAT" entry would
        # have it. Up to v0.22.1rc1 the same lookup raised KeyError. msModelSlim writes "lm_head.weight": "FLOAT".
        if _at_least(version, LM_HEAD_FLOAT_SINCE):
            return Finding(
                "linear-described",
                "lm_head.weight",
                f"not in the description: vllm-ascend v{version} loads lm_head as float "
                f"(UnquantizedEmbeddingMethod), as a 'FLOAT' entry would; releases before v{LM_HEAD_FLOAT_SINCE} "
                "raise KeyError 'lm_head.weight'. Describe it as FLOAT to load everywhere.",
                WARNING,
            )
        return Finding(
            "linear-described",
            "lm_head.weight",
            f"not in the description: vllm-ascend v{version} raises KeyError 'lm_head.weight' (vLLM builds "
            f"lm_head with the quant config even when tied; v{LM_HEAD_FLOAT_SINCE} and later load it as float); "
            "describe it as FLOAT",
        )
    return Finding(
        "linear-described",
        f"{prefix}.weight",
        f"not in the description: vllm-ascend v{version} raises KeyError in get_linear_quant_type",
    )


def _check_schemes(desc: dict, params_dtype: str, version: str) -> list[Finding]:
    findings = []
    types = {v for k, v in desc.items() if k.endswith(".weight") and v != "FLOAT"}
    model_type = desc.get("model_quant_type")
    if model_type is not None and model_type != "FLOAT":
        types.add(model_type)
    for qtype in sorted(types):
        if qtype not in REGISTERED_LINEAR:
            findings.append(
                Finding(
                    "scheme-supported",
                    qtype,
                    f"vllm-ascend v{version} has no linear scheme for it "
                    "(NotImplementedError in create_scheme_for_layer)",
                )
            )
        elif qtype not in KNOWN_LAYOUTS:
            findings.append(
                Finding(
                    "scheme-supported",
                    qtype,
                    "registered upstream, but this checker does not "
                    f"know its tensors (it knows {sorted(KNOWN_LAYOUTS)})",
                )
            )
    if "W8A8" in types and params_dtype not in ("float16", "bfloat16"):
        findings.append(
            Finding(
                "scheme-supported",
                "W8A8",
                f"a {params_dtype} model: w8a8_static.py creates "
                "deq_scale only for bfloat16 (float32) and float16 (int64) models",
            )
        )
    return findings


def _check_packed(desc: dict, layers: list[Linear]) -> list[Finding]:
    findings, groups = [], {}
    for layer in layers:
        parent, _, proj = layer.prefix.rpartition(".")
        if proj in SHARD_GROUP:
            groups.setdefault(f"{parent}.{SHARD_GROUP[proj]}", []).append(layer.prefix)
    for fused, shards in groups.items():
        types = {s.rsplit(".", 1)[1]: desc.get(f"{s}.weight") for s in shards}
        if None in types.values() or len(set(types.values())) == 1:
            continue  # an undescribed shard is named by linear-described
        kinds = ", ".join(f"{proj} {t}" for proj, t in types.items())
        floats = {t == "FLOAT" for t in types.values()}
        why = (
            "Detected some but not all shards ... are quantized"
            if len(floats) == 2
            else "Not all shards ... are quantized with same quant type"
        )
        findings.append(Finding("packed-one-type", fused, f"{kinds}: vllm-ascend raises ValueError ({why})"))
    return findings


def _check_others(config: dict, desc: dict, tensors: dict, expected: dict, params_dtype: str) -> list[Finding]:
    """Embeddings, norms and norm biases: the parameters that are not Linear layers."""
    hidden = config["hidden_size"]
    expected["model.embed_tokens.weight"] = Expected(params_dtype, (config["vocab_size"], hidden))
    expected["model.norm.weight"] = Expected(params_dtype, (hidden,))
    for i in range(config["num_hidden_layers"]):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            expected[f"model.layers.{i}.{norm}.weight"] = Expected(params_dtype, (hidden,))
    findings = []
    norm_biases = [name for name in tensors if name.endswith("norm.bias")]
    declared = any("norm.bias" in key for key in desc)
    if declared:
        # ops/layernorm.py: torch.zeros(hidden_size) on every RMSNorm; loaded by copy (dtype cast).
        for name in norm_biases:
            expected[name] = Expected(tensors[name][0], (hidden,))
    else:
        for name in norm_biases:
            findings.append(
                Finding(
                    "norm-bias-declared",
                    name,
                    "in the files but no description key contains "
                    "'norm.bias': AscendRMSNorm creates no bias, the loader finds no parameter",
                )
            )
            expected[name] = Expected(tensors[name][0], tensors[name][1])  # named once, above
    return findings


def _check_tensors(desc: dict, tensors: dict, expected: dict, tied: bool, unchecked: tuple) -> list[Finding]:
    findings = []
    for name, exp in expected.items():
        if name not in tensors:
            if name == "lm_head.weight" and tied:
                continue  # llama.py / qwen2.py skip "lm_head." when tied: the embeddings serve
            findings.append(
                Finding(
                    "tensor-present",
                    name,
                    f"missing: upstream creates it as {exp.dtype} {list(exp.shape)} and nothing fills it",
                )
            )
            continue
        dtype, shape, _ = tensors[name]
        if dtype != exp.dtype:
            findings.append(_dtype_finding(name, dtype, exp.dtype))
        if shape != exp.shape:
            findings.append(Finding("tensor-shape", name, f"{list(shape)} where upstream creates {list(exp.shape)}"))
    for name, (dtype, shape, file) in sorted(tensors.items()):
        if name not in desc:
            findings.append(
                Finding(
                    "tensor-described",
                    name,
                    f"in {file} but not in {DESCRIPTION}: msModelSlim describes every tensor, but this is not a "
                    "loader rule (vllm-ascend looks up '<layer>.weight' entries and any key containing "
                    "'norm.bias' only), so it loads",
                    WARNING,
                )
            )
        if name not in expected and not name.startswith(unchecked):
            if name == "lm_head.weight" and tied:
                continue  # skipped by the loader; finish() unties the config when it differs
            why = (
                "vLLM's llama/qwen2 load_weights skips an extra bias: the model runs without it"
                if name.endswith(".bias")
                else "no parameter of that name: the loader raises KeyError"
            )
            findings.append(Finding("tensor-unexpected", name, f"{dtype} {list(shape)} in {file}: {why}"))
    return findings


def _dtype_finding(name: str, dtype: str, expected: str) -> Finding:
    if name.rsplit(".", 1)[-1] in DTYPE_CARRIES_MEANING:
        model = CHECKPOINT_DTYPE.get(expected, expected)
        written = CHECKPOINT_DTYPE.get(dtype)
        why = f" (written for a {written} model)" if written else ""
        return Finding(
            "tensor-dtype",
            name,
            f"{dtype}{why} where upstream creates {expected} for this {model} model (w8a8_static.py "
            "get_perchannel_param): the loader's copy_ casts it silently, so it loads and computes garbage",
        )
    return Finding(
        "tensor-dtype",
        name,
        f"{dtype} where upstream creates {expected}: the loader's copy_ casts it to {expected} (loads as its values)",
        WARNING,
    )


def _check_shared_input_scale(directory: Path, desc: dict, tensors: dict, layers: list[Linear]) -> list[Finding]:
    """method_adapters.py registers input_scale/input_offset as one PerTensorScaleParameter per fused layer
    with ignore_warning: every shard's value is copied into it, the last one loaded is what runs."""
    import torch
    from safetensors import safe_open

    findings, groups = [], {}
    for layer in layers:
        parent, _, proj = layer.prefix.rpartition(".")
        if proj in SHARD_GROUP and desc.get(f"{layer.prefix}.weight") == "W8A8":
            groups.setdefault(f"{parent}.{SHARD_GROUP[proj]}", []).append(layer.prefix)
    for fused, shards in groups.items():
        if len(shards) < len(PACKED[fused.rsplit(".", 1)[1]]):
            continue  # a split group is named by packed-one-type / linear-described
        for param in ("input_scale", "input_offset"):
            names = [f"{s}.{param}" for s in shards]
            if not all(n in tensors for n in names):
                continue  # named by tensor-present
            values = []
            for n in names:
                with safe_open(str(Path(directory) / tensors[n][2]), "pt") as f:
                    values.append(f.get_tensor(n).to(torch.float64).flatten().tolist())
            if any(v != values[0] for v in values[1:]):
                shown = ", ".join(f"{s.rsplit('.', 1)[1]} {v}" for s, v in zip(shards, values, strict=False))
                findings.append(
                    Finding(
                        "shared-input-scale",
                        f"{fused}.{param}",
                        f"{shown}: vllm-ascend keeps "
                        "one value per fused layer (the last shard loaded), so the others run "
                        "with a scale they were not calibrated for",
                    )
                )
    return findings
