"""Which node can serve which ModelSlim artifact, and in which dtype: rules read from vllm-ascend at tag v0.23.0
(the console's pin, settings.VLLM_ASCEND_VERSION), paths relative to vllm-project/vllm-ascend.

Atlas 300I (310P) chips load ModelSlim checkpoints through their own config: vllm_ascend/platform.py lines
199-202 import ``AscendModelSlimConfig310`` instead of ``AscendModelSlimConfig`` when is_310p(), and its
get_quant_method (vllm_ascend/_310p/quantization/modelslim_config.py lines 101-151) takes each layer's scheme from
a 310P-only registry (_310p/quantization/methods/registry.py), whose schemes are:
* linear: W8A8 (methods/w8a8_static.py line 29), W8A8_DYNAMIC (w8a8_dynamic.py line 166), W8A8S (w8a8s.py
  line 28), W8A8SC (w8a8sc.py line 31); moe: W8A8_DYNAMIC (w8a8_dynamic.py line 37). No W8A16: a layer of any
  other type raises NotImplementedError (modelslim_config.py lines 81-88);
* W8A8's deq_scale is int64 whatever the model dtype (w8a8_static.py line 40, w8a8_base.py line 43), the
  float16 packing, and the console runs 310P in float16 (endpoints/commands/spec.py forces --dtype float16);
* every VocabParallelEmbedding (embed_tokens, lm_head) gets AscendUnquantizedEmbeddingMethod310 whatever the
  description says (modelslim_config.py lines 142-148).
On the other chips (vllm_ascend/quantization/methods/w8a8_static.py lines 59-72) W8A8's deq_scale is float32 for a
bfloat16 model and int64 for a float16 one. Each parameter is filled by vLLM's layer weight_loader
(ops/linear.py lines 338-343 and 431-436: AscendLinearMethod is not in WEIGHT_LOADER_V2_SUPPORTED), a shape assert
and ``param_data.copy_(loaded_weight)``, which casts: float32 scales land in an int64 parameter as truncated
integers (mostly 0), int64-packed bits in a float32 one as huge numbers. Such a checkpoint loads and answers
garbage; nothing upstream stops it, so the console must.

The checkpoint's dtype and description come from its directory (models_registry/quantize/modelslim_facts.py:
the console records neither). Pure functions, but ``launch_refusal``, which reads those two first.
"""

from __future__ import annotations

import re

from models_registry.quantize.modelslim_check import DEQ_SCALE_DTYPE
from models_registry.quantize.modelslim_facts import MIXED, modelslim_facts

MODELSLIM = "ascend-modelslim"  # models_registry.models.Artifact.Format.MODELSLIM
# (quant type, layer type) the 310P registry has (see above).
SCHEMES_310P = {"linear": ("W8A8", "W8A8_DYNAMIC", "W8A8S", "W8A8SC"), "moe": ("W8A8_DYNAMIC",)}
DTYPE_310P = "float16"
_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "float": "float32", "fp32": "float32"}
_EMBEDDINGS = ("lm_head.weight", "embed_tokens.weight")


def chip_family(chip_name: str | None) -> str:
    """npu-smi's chip name, upper-case, without an "Ascend" prefix ("Ascend310P3" -> "310P3"), as
    endpoints/commands/spec.py reads it."""
    return re.sub(r"^ASCEND[\s_-]*", "", (chip_name or "").strip().upper())


def is_310p(chip_name: str | None) -> bool:
    return chip_family(chip_name).startswith("310P")


def normal_dtype(dtype: str | None) -> str | None:
    """A dtype name as vLLM's --dtype takes it, None for "auto" or blank (the model config's torch_dtype)."""
    name = (dtype or "").strip().lower().removeprefix("torch.")
    if name in ("", "auto"):
        return None
    return _DTYPES.get(name, name)


def layer_types(quant_description: dict | None) -> dict[tuple[str, str], list[str]]:
    """(quant type, layer type) -> the layer prefixes of that kind, from the description's "<layer>.weight"
    entries (the ones get_linear_quant_type looks up); FLOAT layers left out. Layer type: "moe" for experts,
    "embedding" for embed_tokens / lm_head, else "linear"."""
    found: dict[tuple[str, str], list[str]] = {}
    for key, qtype in (quant_description or {}).items():
        if not (isinstance(key, str) and key.endswith(".weight") and isinstance(qtype, str)):
            continue
        qtype = qtype.upper()
        if qtype == "FLOAT":
            continue
        if key.endswith(_EMBEDDINGS):
            kind = "embedding"
        elif ".experts." in key:
            kind = "moe"
        else:
            kind = "linear"
        found.setdefault((qtype, kind), []).append(key.removesuffix(".weight"))
    return found


def _w8a8(types: dict, quant_description: dict | None, checkpoint_dtype: str | None) -> bool:
    """Has the checkpoint W8A8 static layers? From the description, or (none readable) from a deq_scale found."""
    if quant_description is None:
        return checkpoint_dtype is not None
    return any(qtype == "W8A8" for qtype, _ in types)


def _for_310p(chip: str) -> str:
    return (
        f"Produce it for 310P: the quantize job has no float16 or 310P option (it writes the checkpoint in its "
        f"source's dtype), so convert the float parent to float16 first (convert target fp16) and quantize that "
        f"artifact with target ascend-modelslim, scheme w8a8_static or w8a8_dynamic; {chip} then loads it"
    )


def artifact_node_refusal(
    *,
    artifact_format: str,
    quant_description: dict | None,
    checkpoint_dtype: str | None,
    chip_name: str | None,
    endpoint_dtype: str | None,
) -> str:
    """Why this ModelSlim artifact cannot be served on this chip in this dtype, or "". The message starts with the
    field it is about ("artifact: ..." or "dtype: ...") and names both values. ``checkpoint_dtype``: the model
    dtype the W8A8 layers were written for ("bfloat16"/"float16", modelslim_facts.checkpoint_dtype); None when
    not known or no W8A8 static layer. ``endpoint_dtype``: the launch's --dtype; "auto" or blank is the model
    config's torch_dtype, taken to match; on a 310P chip the console runs float16 whatever is asked."""
    if artifact_format != MODELSLIM:
        return ""
    types = layer_types(quant_description)
    w8a8 = _w8a8(types, quant_description, checkpoint_dtype)
    if is_310p(chip_name):
        chip = chip_family(chip_name)
        for (qtype, kind), prefixes in sorted(types.items()):
            if kind == "embedding" or qtype in SCHEMES_310P.get(kind, ()):
                continue
            have = ", ".join(SCHEMES_310P[kind])
            remedy = (
                " Produce it for 310P: quantize the float parent with scheme w8a8_dynamic, or w8a8_static from "
                "a float16 parent (convert target fp16 first: the quantize job has no float16 or 310P option)."
                if kind == "linear"
                else ""
            )
            return (
                f"artifact: {qtype} {kind} layers ({prefixes[0]}{', …' if len(prefixes) > 1 else ''}) on a {chip} "
                f"chip: vllm-ascend's Atlas 300I loader (AscendModelSlimConfig310) has no {qtype} {kind} scheme "
                f"(it has {have}) and raises NotImplementedError.{remedy}"
            )
        embedded = sorted({p for (qtype, kind), ps in types.items() if kind == "embedding" for p in ps})
        if embedded:
            return (
                f"artifact: quantized {', '.join(embedded)} on a {chip} chip: vllm-ascend's Atlas 300I loader "
                "serves every embedding and lm_head unquantized (AscendUnquantizedEmbeddingMethod310), so their "
                "int8 weights would be cast to float16 and answer garbage. Quantize with them kept in float."
            )
        if w8a8 and checkpoint_dtype not in (None, DTYPE_310P):
            stored = DEQ_SCALE_DTYPE.get(checkpoint_dtype, checkpoint_dtype)
            what = "deq_scale in both packings" if checkpoint_dtype == MIXED else f"deq_scale {stored}"
            return (
                f"artifact: a {checkpoint_dtype} W8A8 checkpoint ({what}) on a {chip} chip, which runs "
                f"{DTYPE_310P} and whose W8A8 loader creates deq_scale int64 (the {DTYPE_310P} packing) for every "
                f"model: the loader's copy_ would cast the scales to integers, so it would load and answer "
                f"garbage. {_for_310p(chip)}."
            )
        return ""
    if not w8a8 or checkpoint_dtype is None:
        return ""
    asked = normal_dtype(endpoint_dtype)
    if checkpoint_dtype == MIXED:
        return (
            "artifact: a W8A8 checkpoint with deq_scale in both packings (float32 for bfloat16 layers, int64 for "
            "float16 ones): no dtype loads every layer as calibrated. Quantize it again."
        )
    if asked is None or asked == checkpoint_dtype:
        return ""
    made = DEQ_SCALE_DTYPE.get(asked)
    creates = f"deq_scale {made}" if made else "no deq_scale at all"
    return (
        f"dtype: {asked} for a {checkpoint_dtype} W8A8 checkpoint: vllm-ascend's w8a8_static.py creates "
        f"{creates} for a {asked} model where this checkpoint's is {DEQ_SCALE_DTYPE[checkpoint_dtype]} "
        f"(the {checkpoint_dtype} packing), and the loader's copy_ casts silently, so it would load and answer "
        f"garbage. Launch it with dtype {checkpoint_dtype} (or auto), or quantize a {asked} parent."
    )


def launch_refusal(*, artifact, chip_name: str | None, endpoint_dtype: str | None) -> str:
    """artifact_node_refusal for an Artifact (its format, path and inspection), its description and checkpoint
    dtype read from its directory (headers only); "" for other formats without reading anything."""
    if artifact.format != MODELSLIM:
        return ""
    return artifact_node_refusal(
        artifact_format=artifact.format,
        **modelslim_facts(artifact.path, artifact.inspection),
        chip_name=chip_name,
        endpoint_dtype=endpoint_dtype,
    )


def refusal_errors(refusal: str) -> dict[str, str]:
    """A refusal as a ValidationError's field dict: "dtype: ..." -> {"dtype": "..."}."""
    field, _, message = refusal.partition(": ")
    return {field: message}
