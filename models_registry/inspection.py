"""Read what a model checkpoint is, from its metadata only (pure functions; Django only for the model roots
every read is confined to, see models_registry.paths).

``inspect_path(path)`` looks at a Hugging Face-format directory (``config.json`` + weights) or a
``.gguf`` file and returns a plain dict (JSON-serialisable; it is what ``Artifact.inspection``
stores).  Only headers are read: ``config.json`` and friends, the JSON header of each
``.safetensors`` file, the GGUF metadata/tensor table.  Weights are never loaded (the one exception
is a ``.bin``-only checkpoint, opened with ``torch.load(mmap=True, weights_only=True)``, which maps
rather than reads the tensors; if that fails ``param_count`` is None).

Keys of the returned dict (None where unknown):

``format``
    "hf" | "gguf" | "ascend-modelslim" | "compressed-tensors".
``architecture``
    HF class name, e.g. "LlamaForCausalLM" (for GGUF, ``general.architecture`` mapped to the HF
    name where known, else None).
``model_type``
    HF ``model_type`` ("llama", "qwen2_moe", ...); for GGUF the mapped HF type, or the raw GGUF
    architecture string when there is no mapping.
``param_count``
    Number of *stored* elements: the sum over the safetensors headers' shapes (tied embeddings are
    stored once, so counted once).  For packed quantized checkpoints (GPTQ/AWQ ``qweight``
    int32, ModelSlim scales/offsets) this is the stored element count, not the logical parameter
    count.  For GGUF it is the logical element count of every tensor (quantized blocks included).
``num_layers``, ``hidden_size``, ``intermediate_size``, ``num_attention_heads``, ``num_kv_heads``,
``head_dim``, ``vocab_size``, ``max_position_embeddings``
    From ``config.json`` (or its ``text_config`` for multimodal configs) or the GGUF
    ``<arch>.*`` metadata.  ``num_kv_heads`` defaults to ``num_attention_heads`` (MHA);
    ``head_dim`` to ``hidden_size // num_attention_heads``.
``dtype``
    HF: ``torch_dtype``/``dtype`` from config.json ("bfloat16", ...), or the most common
    floating dtype in the safetensors headers; for ModelSlim the ``model_quant_type`` ("W8A8").
    GGUF: the file type without its prefix ("F16", "Q8_0", "Q4_K_M"...).
``size_bytes``
    Total size on disk of ``files``.
``weight_bytes``
    Bytes of tensor data (safetensors data sections / .bin files / GGUF tensor data).
``files``
    Sorted relative names (posix) of the model's files; hidden files and folders are skipped.
``has_tokenizer``, ``has_chat_template``
    HF: tokenizer.json / tokenizer.model / vocab.json ... ; chat template in
    ``tokenizer_config.json``, ``chat_template.jinja``, ``chat_template.json`` or ``chat_templates/``.
    GGUF: ``tokenizer.ggml.tokens`` / ``tokenizer.chat_template`` present.
``quantization``
    None, or ``{"method": ..., "scheme": ...}`` (+ a few details): a
    ``quant_model_description*.json`` means Ascend ModelSlim (``scheme`` = ``model_quant_type``);
    a ``quantization_config`` (or ``compression_config``) in config.json gives ``method`` =
    ``quant_method`` ("compressed-tensors", "gptq", "awq", "fp8", "bitsandbytes"...), with
    ``scheme`` like "W8A8", "W4A16", "FP8" where it can be worked out.  GGUF: method "gguf" with
    the file type as scheme, for anything but F32/F16/BF16 files.

``kv_bytes_per_token(inspection, kv_dtype_bytes=2)`` = layers x KV heads x head_dim x 2 (K and V)
x bytes per element.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from models_registry.gguf_reader import GGUF_MAGIC, GgufHeaderError, read_gguf_header
from models_registry.hf_reader import (
    HfDirError,
    list_files,
    names_have_tokenizer,
    read_config,
    read_safetensors_header,
    weight_files,
)
from models_registry.paths import gguf_files_in, open_confined, read_confined

__all__ = [
    "InspectionError",
    "inspect_path",
    "inspect_hf_dir",
    "inspect_gguf",
    "kv_bytes_per_token",
    "FIELDS",
]

FIELDS = (
    "format",
    "architecture",
    "model_type",
    "param_count",
    "num_layers",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_kv_heads",
    "head_dim",
    "vocab_size",
    "max_position_embeddings",
    "dtype",
    "size_bytes",
    "weight_bytes",
    "files",
    "has_tokenizer",
    "has_chat_template",
    "quantization",
)


class InspectionError(ValueError):
    """The path is not a model we can read (wrong format, corrupt metadata, no weights...)."""


def _empty() -> dict:
    return dict.fromkeys(FIELDS)


# --------------------------------------------------------------------------------------------
# dispatch
# --------------------------------------------------------------------------------------------


def inspect_path(path) -> dict:
    """Inspect a HF model directory or a GGUF file (see the module docstring for the keys).

    A directory without ``config.json`` holding exactly one ``.gguf`` file is inspected as that
    GGUF.  Raises :class:`InspectionError` for anything else.
    """
    path = Path(path)
    if not path.exists():
        raise InspectionError(f"{path}: no such file or directory")
    if path.is_dir():
        if (path / "config.json").is_file():
            return inspect_hf_dir(path)
        ggufs = gguf_files_in(path)
        if len(ggufs) == 1:
            return inspect_gguf(ggufs[0])
        if len(ggufs) > 1:
            raise InspectionError(
                f"{path}: no config.json and {len(ggufs)} .gguf files ({', '.join(p.name for p in ggufs[:5])}); "
                "name the GGUF file to inspect"
            )
        raise InspectionError(
            f"{path}: not a model: a Hugging Face model directory needs a config.json, "
            "and there is no .gguf file in it either"
        )
    if path.suffix.lower() == ".gguf" or _has_gguf_magic(path):
        return inspect_gguf(path)
    raise InspectionError(
        f"{path}: not a model: expected a Hugging Face model directory (with config.json) or a .gguf file"
    )


def _has_gguf_magic(path: Path) -> bool:
    try:
        with open_confined(path, tree=path.parent) as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


# --------------------------------------------------------------------------------------------
# Hugging Face directories
# --------------------------------------------------------------------------------------------

_SAFETENSORS_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}
_FLOAT_DTYPES = set(_SAFETENSORS_DTYPES.values())


def inspect_hf_dir(path) -> dict:
    """Inspect a Hugging Face-format model directory (``config.json`` + safetensors/bin weights)."""
    root = Path(path)
    try:
        config = read_config(root)
        files = list_files(root)
        found = weight_files(root, [rel for rel, _ in files])
    except HfDirError as e:
        raise InspectionError(str(e)) from e
    info = _empty()
    info["files"] = [rel for rel, _ in files]
    info["size_bytes"] = sum(size for _, size in files)

    weights = found.names if found else []
    if not weights:
        raise InspectionError(
            f"{root}: no weights: config.json is there but no .safetensors or pytorch_model*.bin files"
        )

    # architecture / shape
    text = config
    if isinstance(config.get("text_config"), dict):  # multimodal: the language model's shape
        text = {**config, **{k: v for k, v in config["text_config"].items() if v is not None}}
    archs = config.get("architectures")
    info["architecture"] = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None
    info["model_type"] = config.get("model_type") if isinstance(config.get("model_type"), str) else None
    info["num_layers"] = _first_int(text, "num_hidden_layers", "n_layer", "num_layers", "n_layers")
    info["hidden_size"] = _first_int(text, "hidden_size", "n_embd", "d_model", "dim")
    info["intermediate_size"] = _first_int(text, "intermediate_size", "ffn_hidden_size", "n_inner", "d_ff")
    info["num_attention_heads"] = _first_int(text, "num_attention_heads", "n_head", "num_heads", "n_heads")
    kv = _first_int(text, "num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num", "n_kv_heads")
    if kv is None and text.get("multi_query") is True:
        kv = 1
    info["num_kv_heads"] = kv if kv is not None else info["num_attention_heads"]
    head_dim = _first_int(text, "head_dim", "kv_channels")
    if head_dim is None and info["hidden_size"] and info["num_attention_heads"]:
        head_dim = info["hidden_size"] // info["num_attention_heads"]
    info["head_dim"] = head_dim
    # Multi-head latent attention (DeepSeek-V2/V3/R1): one compressed latent per token and layer in the KV cache.
    if _first_int(text, "kv_lora_rank") and _first_int(text, "qk_rope_head_dim"):
        info["kv_lora_rank"] = _first_int(text, "kv_lora_rank")
        info["qk_rope_head_dim"] = _first_int(text, "qk_rope_head_dim")
    info["vocab_size"] = _first_int(text, "vocab_size", "padded_vocab_size")
    info["max_position_embeddings"] = _first_int(
        text, "max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx"
    )

    # weights: counts and dtypes from headers
    param_count, weight_bytes, dtype_counts = _count_weights(root, weights)
    info["param_count"] = param_count
    info["weight_bytes"] = weight_bytes

    dtype = _normalise_dtype(
        config.get("torch_dtype") or config.get("dtype") or text.get("torch_dtype") or text.get("dtype")
    )
    if dtype is None and dtype_counts:
        floats = Counter({k: v for k, v in dtype_counts.items() if k in _FLOAT_DTYPES})
        if floats:
            dtype = floats.most_common(1)[0][0]
    info["dtype"] = dtype

    # tokenizer
    names = set(info["files"])
    info["has_tokenizer"] = names_have_tokenizer(names)
    info["has_chat_template"] = _hf_has_chat_template(root, names)

    # quantization / format
    info["format"] = "hf"
    quant = _modelslim_quantization(root, [rel for rel, _ in files])
    if quant is not None:
        info["format"] = "ascend-modelslim"
        if quant.get("scheme"):
            info["dtype"] = quant["scheme"]
    else:
        qc = config.get("quantization_config") or config.get("compression_config")
        if isinstance(qc, dict):
            quant = _config_quantization(qc)
            if quant["method"] == "compressed-tensors":
                info["format"] = "compressed-tensors"
    info["quantization"] = quant
    return info


def _read_json(path: Path, *, what: str):
    try:
        return json.loads(read_confined(path, tree=path.parent).decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InspectionError(f"{path}: corrupt {what}: {e}") from e
    except OSError as e:
        raise InspectionError(f"{path}: cannot read {what}: {e}") from e


def _count_weights(root: Path, weights: list[str]) -> tuple[int | None, int | None, Counter]:
    """(stored element count, tensor data bytes, Counter of dtype -> elements)."""
    dtypes: Counter = Counter()
    total = 0
    data_bytes = 0
    if weights[0].endswith(".safetensors"):
        for name in weights:
            try:
                header = read_safetensors_header(root / name)
            except HfDirError as e:
                raise InspectionError(str(e)) from e
            for key, entry in header.items():
                if key == "__metadata__":
                    continue
                try:
                    numel = 1
                    for d in entry["shape"]:
                        numel *= int(d)
                    start, end = entry["data_offsets"]
                except (KeyError, TypeError, ValueError) as e:
                    raise InspectionError(f"{root / name}: corrupt safetensors header entry {key!r}") from e
                total += numel
                data_bytes += int(end) - int(start)
                dtypes[_SAFETENSORS_DTYPES.get(entry.get("dtype"), str(entry.get("dtype")).lower())] += numel
        return total, data_bytes, dtypes

    # .bin only: map, do not read.
    data_bytes = sum((root / n).stat().st_size for n in weights)
    try:
        import torch

        for name in weights:
            state = torch.load(root / name, map_location="cpu", mmap=True, weights_only=True)
            seen = set()
            for tensor in state.values():
                if not hasattr(tensor, "numel"):
                    continue
                key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
                if key in seen:  # tied weights saved twice by reference
                    continue
                seen.add(key)
                total += tensor.numel()
                dtypes[str(tensor.dtype).removeprefix("torch.")] += tensor.numel()
            del state
    except Exception:  # noqa: BLE001 - a legacy/odd .bin: the count is just unknown
        return None, data_bytes, Counter()
    return total, data_bytes, dtypes


def _hf_has_chat_template(root: Path, names: set[str]) -> bool:
    if "chat_template.jinja" in names or "chat_template.json" in names:
        return True
    if any(n.startswith("chat_templates/") and n.endswith(".jinja") for n in names):
        return True
    if "tokenizer_config.json" in names:
        try:
            cfg = json.loads(read_confined(root / "tokenizer_config.json", tree=root).decode("utf-8"))
        except (json.JSONDecodeError, OSError, UnicodeDecodeError):
            return False
        template = cfg.get("chat_template") if isinstance(cfg, dict) else None
        return bool(template)
    return False


def _modelslim_quantization(root: Path, names: list[str]) -> dict | None:
    """Ascend ModelSlim: a quant_model_description.json (or quant_model_description_*.json)."""
    candidates = [n for n in names if "/" not in n and n.startswith("quant_model_description") and n.endswith(".json")]
    if not candidates:
        return None
    name = "quant_model_description.json" if "quant_model_description.json" in candidates else sorted(candidates)[0]
    desc = _read_json(root / name, what=name)
    if not isinstance(desc, dict):
        raise InspectionError(f"{root / name}: corrupt {name}: expected a JSON object")
    scheme = desc.get("model_quant_type")
    if not isinstance(scheme, str) or not scheme:
        # older descriptions: only per-tensor entries ("W8A8", "FLOAT", ...); take the commonest quantized one
        kinds = Counter(v for k, v in desc.items() if isinstance(v, str) and "." in k and v.upper() != "FLOAT")
        scheme = kinds.most_common(1)[0][0].upper() if kinds else None
        if scheme is None:  # quant_model_description_w8a8.json
            suffix = name.removeprefix("quant_model_description").removesuffix(".json").strip("_")
            scheme = suffix.upper() or None
    else:
        scheme = scheme.upper()
    out = {"method": "ascend-modelslim", "scheme": scheme, "description_file": name}
    if isinstance(desc.get("version"), str):
        out["version"] = desc["version"]
    return out


def _config_quantization(qc: dict) -> dict:
    method = str(qc.get("quant_method") or qc.get("format") or "unknown").lower()
    if method in ("compressed_tensors", "compressed-tensors", "sparseml"):
        method = "compressed-tensors"
    scheme = None
    extra: dict = {}
    if method == "compressed-tensors":
        extra["format"] = qc.get("format")
        schemes = []
        for group in (qc.get("config_groups") or {}).values():
            if not isinstance(group, dict):
                continue
            s = _ct_scheme(group.get("weights"), group.get("input_activations"))
            if s:
                schemes.append(s)
        scheme = "+".join(dict.fromkeys(schemes)) or None
    elif method in ("gptq", "awq", "autoround", "auto-round", "hqq", "eetq", "marlin", "gptq_marlin", "awq_marlin"):
        bits = qc.get("bits") or qc.get("w_bit") or qc.get("nbits")
        if bits:
            scheme = f"W{int(bits)}A16"
        group = qc.get("group_size") or qc.get("q_group_size")
        if group is not None:
            extra["group_size"] = group
    elif method == "fp8":
        scheme = "FP8"
    elif method == "bitsandbytes":
        if qc.get("load_in_4bit"):
            scheme = str(qc.get("bnb_4bit_quant_type") or "4bit")
        elif qc.get("load_in_8bit"):
            scheme = "int8"
    out = {"method": method, "scheme": scheme}
    out.update({k: v for k, v in extra.items() if v is not None})
    return out


def _ct_scheme(weights, activations) -> str | None:
    """compressed-tensors config group -> "W8A8", "W4A16", "FP8", "W8A8-FP8"..."""
    if not isinstance(weights, dict) or not weights.get("num_bits"):
        return None
    wbits = int(weights["num_bits"])
    wfloat = weights.get("type") == "float"
    if isinstance(activations, dict) and activations.get("num_bits"):
        abits = int(activations["num_bits"])
        afloat = activations.get("type") == "float"
    else:
        abits, afloat = 16, False
    if wfloat and afloat and wbits == abits == 8:
        return "FP8"
    scheme = f"W{wbits}A{abits}"
    if wfloat or afloat:
        scheme += "-FP" + str(wbits if wfloat else abits)
    return scheme


def _first_int(d: dict, *keys) -> int | None:
    for k in keys:
        v = d.get(k)
        if isinstance(v, bool):
            continue
        if isinstance(v, int):
            return v
        if isinstance(v, float) and v.is_integer():
            return int(v)
    return None


def _normalise_dtype(value) -> str | None:
    if not isinstance(value, str) or not value:
        return None
    value = value.removeprefix("torch.")
    return {"fp16": "float16", "half": "float16", "bf16": "bfloat16", "fp32": "float32", "float": "float32"}.get(
        value, value
    )


# --------------------------------------------------------------------------------------------
# GGUF
# --------------------------------------------------------------------------------------------

# GGUF general.architecture -> (HF architecture, HF model_type)
GGUF_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "mistral3": ("MistralForCausalLM", "mistral"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "gemma": ("GemmaForCausalLM", "gemma"),
    "gemma2": ("Gemma2ForCausalLM", "gemma2"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
    "phi2": ("PhiForCausalLM", "phi"),
    "phi3": ("Phi3ForCausalLM", "phi3"),
    "falcon": ("FalconForCausalLM", "falcon"),
    "bloom": ("BloomForCausalLM", "bloom"),
    "gpt2": ("GPT2LMHeadModel", "gpt2"),
    "gptneox": ("GPTNeoXForCausalLM", "gpt_neox"),
    "starcoder2": ("Starcoder2ForCausalLM", "starcoder2"),
    "stablelm": ("StableLmForCausalLM", "stablelm"),
    "command-r": ("CohereForCausalLM", "cohere"),
    "nemotron": ("NemotronForCausalLM", "nemotron"),
    "deepseek": ("DeepseekForCausalLM", "deepseek"),
    "deepseek2": ("DeepseekV2ForCausalLM", "deepseek_v2"),
    "internlm2": ("InternLM2ForCausalLM", "internlm2"),
    "mamba": ("MambaForCausalLM", "mamba"),
    "olmo": ("OlmoForCausalLM", "olmo"),
    "olmo2": ("Olmo2ForCausalLM", "olmo2"),
    "glm4": ("Glm4ForCausalLM", "glm4"),
    "granite": ("GraniteForCausalLM", "granite"),
    "exaone": ("ExaoneForCausalLM", "exaone"),
    "gpt-oss": ("GptOssForCausalLM", "gpt_oss"),
    "t5": ("T5ForConditionalGeneration", "t5"),
}

_GGUF_FLOAT_TYPES = {"F32", "F16", "BF16", "F64"}


def inspect_gguf(path) -> dict:
    """Inspect a .gguf file from its metadata and tensor table only (see :func:`read_gguf_header`).

    The dtype is ``general.file_type`` as llama.cpp names it without its ``MOSTLY_``/``ALL_``
    prefix ("F16", "Q8_0", "Q4_K_M"...), or, without that key, the commonest type (by elements) of
    the 2-D tensors.  A llama GGUF whose ``general.name`` mentions "mistral" maps to Mistral, as
    transformers does.
    """
    path = Path(path)
    try:
        header = read_gguf_header(path)
    except GgufHeaderError as e:
        raise InspectionError(str(e)) from e
    import gguf  # present: read_gguf_header needs it too

    meta = header["metadata"]
    tensors = header["tensors"]
    size = header["file_size"]

    arch = meta.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise InspectionError(f"{path}: corrupt GGUF header: no general.architecture")
    if not tensors:
        raise InspectionError(f"{path}: no weights: the GGUF file holds no tensors")
    end = max(header["data_offset"] + t["offset"] + t["n_bytes"] for t in tensors)
    if end > size:
        raise InspectionError(f"{path}: corrupt GGUF file: truncated (tensor data ends at {end}, file is {size} bytes)")

    info = _empty()
    info["format"] = "gguf"
    name = meta.get("general.name")
    hf_arch = arch
    if arch == "llama" and isinstance(name, str) and "mistral" in name.lower():
        hf_arch = "mistral"
    mapped = GGUF_ARCHITECTURES.get(hf_arch)
    info["architecture"] = mapped[0] if mapped else None
    info["model_type"] = mapped[1] if mapped else arch

    def arch_int(key):
        v = meta.get(f"{arch}.{key}")
        if isinstance(v, list):  # per-layer values (e.g. head_count_kv of hybrid models)
            v = max((x for x in v if isinstance(x, (int, float))), default=None)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return None
        return int(v)

    info["num_layers"] = arch_int("block_count")
    info["hidden_size"] = arch_int("embedding_length")
    info["intermediate_size"] = arch_int("feed_forward_length")
    info["num_attention_heads"] = arch_int("attention.head_count")
    kv = arch_int("attention.head_count_kv")
    info["num_kv_heads"] = kv if kv is not None else info["num_attention_heads"]
    head_dim = arch_int("attention.key_length")
    if head_dim is None and info["hidden_size"] and info["num_attention_heads"]:
        head_dim = info["hidden_size"] // info["num_attention_heads"]
    info["head_dim"] = head_dim
    info["max_position_embeddings"] = arch_int("context_length")

    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = arch_int("vocab_size")
    if vocab is None and tokens is not None:
        vocab = len(tokens)
    if vocab is None:
        embd = next((t for t in tensors if t["name"] == "token_embd.weight"), None)
        if embd is not None:
            vocab = embd["shape"][0]  # torch order: (n_vocab, n_embd)
    info["vocab_size"] = vocab

    info["param_count"] = sum(t["n_elements"] for t in tensors)
    info["weight_bytes"] = sum(t["n_bytes"] for t in tensors)
    info["size_bytes"] = size
    info["files"] = [path.name]

    dtype = None
    file_type = meta.get("general.file_type")
    if isinstance(file_type, int) and not isinstance(file_type, bool):
        try:
            dtype = gguf.LlamaFileType(file_type).name.removeprefix("MOSTLY_").removeprefix("ALL_")
        except ValueError:
            dtype = None
        if dtype == "GUESSED":
            dtype = None
    if dtype is None:
        counts = Counter()
        for t in tensors:
            if len(t["shape"]) >= 2:
                counts[t["type"]] += t["n_elements"]
        dtype = counts.most_common(1)[0][0] if counts else None
    info["dtype"] = dtype

    info["has_tokenizer"] = tokens is not None
    info["has_chat_template"] = bool(meta.get("tokenizer.chat_template")) or any(
        k.startswith("tokenizer.chat_template.") for k in meta
    )
    info["quantization"] = None if dtype is None or dtype in _GGUF_FLOAT_TYPES else {"method": "gguf", "scheme": dtype}
    return info


# --------------------------------------------------------------------------------------------
# KV cache
# --------------------------------------------------------------------------------------------


def kv_bytes_per_token(inspection: dict, kv_dtype_bytes: int | float = 2) -> int:
    """Bytes of KV cache one token takes: layers x KV heads x head_dim x 2 (K and V) x dtype size.

    ``kv_dtype_bytes`` is 2 for a bf16/fp16 cache, 1 for an int8/fp8 cache.  This is the standard
    GQA/MHA layout, or MLA's compressed latent (DeepSeek-V2/V3/R1) where the inspection recorded one; it
    overestimates sliding-window layers.
    Raises ValueError if the inspection lacks one of the numbers.
    """
    layers = inspection.get("num_layers")
    if layers and inspection.get("kv_lora_rank") and inspection.get("qk_rope_head_dim"):
        # MLA: vLLM caches (kv_lora_rank + qk_rope_head_dim) values per token and layer, whole on every TP rank
        # (models_registry/capacity_moe.py); DeepSeek-V3: 61 x 576 x 2 = 70,272 bytes in bf16.
        return int(layers * (inspection["kv_lora_rank"] + inspection["qk_rope_head_dim"]) * kv_dtype_bytes)
    kv_heads = inspection.get("num_kv_heads") or inspection.get("num_attention_heads")
    head_dim = inspection.get("head_dim")
    if not head_dim and inspection.get("hidden_size") and inspection.get("num_attention_heads"):
        head_dim = inspection["hidden_size"] // inspection["num_attention_heads"]
    missing = [n for n, v in (("num_layers", layers), ("num_kv_heads", kv_heads), ("head_dim", head_dim)) if not v]
    if missing:
        raise ValueError(f"cannot size the KV cache: {', '.join(missing)} unknown")
    if kv_dtype_bytes <= 0:
        raise ValueError("kv_dtype_bytes must be positive")
    return int(layers * kv_heads * head_dim * 2 * kv_dtype_bytes)
