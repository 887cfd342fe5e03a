"""What every conversion step shares: the error type, dtype names, output directories, and the
checks on a Hugging Face source directory (read through :mod:`models_registry.hf_reader`)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from models_registry import hf_reader
from models_registry.paths import copy_confined, tree_files


class ConversionError(ValueError):
    """An expected conversion failure; ``str(exc)`` is meant for the operator."""


# Output shards: the writer streams tensors into the file, so this does not drive memory use;
# 5 GB is the Hugging Face Hub's usual shard size.
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9

# Margin added to size estimates for tokenizer / config files.
TOKENIZER_MARGIN_BYTES = 64 * 1024**2

_DTYPE_ALIASES = {
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
}
# safetensors dtype tags <-> torch dtype names
ST_TO_TORCH = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U64": "uint64",
    "U32": "uint32",
    "U16": "uint16",
    "U8": "uint8",
    "BOOL": "bool",
}
TORCH_TO_ST = {v: k for k, v in ST_TO_TORCH.items()}
ST_ITEMSIZE = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U64": 8,
    "U32": 4,
    "U16": 2,
    "U8": 1,
    "BOOL": 1,
}
CHUNK_BYTES = 16 * 1024**2  # large tensors are converted in slices of about this size

# Files that hold weights (never copied by convert_precision / export_onnx).
_WEIGHT_SUFFIXES = {".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx", ".om", ".data"}


# ----------------------------------------------------------------------------------------------
# small helpers
# ----------------------------------------------------------------------------------------------


def normalize_dtype(dtype: str, allowed: Iterable[str], what: str) -> str:
    allowed = tuple(allowed)
    name = _DTYPE_ALIASES.get(str(dtype).strip().lower())
    if name not in allowed:
        raise ConversionError(f"Invalid {what} {dtype!r}: choose one of {', '.join(allowed)}.")
    return name


def torch_dtype_of(name: str):
    import torch

    return getattr(torch, name)


def prepare_out_dir(out_dir: Path) -> Path:
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ConversionError(f"Output path {out_dir} exists and is not a directory.")
    out_dir.mkdir(parents=True, exist_ok=True)
    if any(out_dir.iterdir()):
        raise ConversionError(f"Output directory {out_dir} is not empty.")
    return out_dir


def first_line(exc: BaseException, limit: int = 300) -> str:
    text = str(exc).strip().splitlines()
    msg = text[0] if text else type(exc).__name__
    return msg if len(msg) <= limit else msg[: limit - 3] + "..."


def transformers_version() -> str:
    import transformers

    return transformers.__version__


# ----------------------------------------------------------------------------------------------
# Hugging Face directory inspection
# ----------------------------------------------------------------------------------------------


def read_hf_config(src_dir: Path) -> dict:
    try:
        return hf_reader.read_config(src_dir)
    except hf_reader.HfDirError as exc:
        raise ConversionError(str(exc)) from exc


def check_architecture(cfg: dict, where: Path, *, causal_lm: bool = False) -> None:
    """Raise ConversionError unless transformers knows this model_type (and architecture)."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = cfg.get("model_type")
    archs = cfg.get("architectures") or []
    arch_text = ", ".join(map(str, archs)) or "none listed"
    if not model_type:
        raise ConversionError(
            f"Unsupported architecture: {where}/config.json has no model_type (architectures: {arch_text})."
        )
    if model_type not in CONFIG_MAPPING:
        raise ConversionError(
            f"Unsupported architecture: model_type '{model_type}' (architectures: {arch_text}) is not "
            f"supported by transformers {transformers.__version__}."
        )
    unknown = [a for a in archs if str(a) not in _transformers_class_names()]
    if archs and len(unknown) == len(archs):
        raise ConversionError(
            f"Unsupported architecture: {arch_text} (model_type '{model_type}') is not a class in "
            f"transformers {transformers.__version__}."
        )
    if causal_lm:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            raise ConversionError(
                f"Unsupported architecture: model_type '{model_type}' ({arch_text}) is not a causal "
                f"language model in transformers {transformers.__version__}."
            )


_CLASS_NAMES: set[str] = set()


def _transformers_class_names() -> set[str]:
    """Every class name transformers exports, without importing the modeling code."""
    if not _CLASS_NAMES:
        import transformers

        _CLASS_NAMES.update(dir(transformers))
    return _CLASS_NAMES


def require_tokenizer(src_dir: Path) -> None:
    if not hf_reader.has_tokenizer(src_dir):
        raise ConversionError(
            f"Missing tokenizer: {src_dir} has none of {', '.join(hf_reader.TOKENIZER_FILES)}; "
            f"copy the tokenizer files of the original model into it."
        )


def find_weight_files(src_dir: Path) -> tuple[str, list[Path], set[Path]]:
    """(kind 'safetensors'|'bin', weight files in order, files that are part of the weights)."""
    src_dir = Path(src_dir)
    try:
        found = hf_reader.weight_files(src_dir)
    except hf_reader.HfDirError as exc:
        raise ConversionError(str(exc)) from exc
    if found is None:
        raise ConversionError(
            f"No weights found in {src_dir} (expected model.safetensors, sharded safetensors "
            f"with model.safetensors.index.json, or pytorch_model.bin)."
        )
    files = [src_dir / name for name in found.names]
    return found.kind, files, {*files, *([src_dir / found.index] if found.index else [])}


def copy_non_weight_files(src_dir: Path, out_dir: Path, *, exclude: Iterable[str] = ()) -> tuple[list[str], list[str]]:
    """Copy every non-weight file (recursively, never through a link out of the model roots: PathRefused);
    return (copied, skipped) relative names."""
    exclude = set(exclude)
    copied, skipped = [], []
    for path in tree_files(src_dir):
        rel = path.relative_to(src_dir)
        rel_s = rel.as_posix()
        if rel_s in exclude or any(part.startswith(".") for part in rel.parts):
            continue
        if path.suffix.lower() in _WEIGHT_SUFFIXES or rel.name in hf_reader.WEIGHT_INDEX_NAMES:
            skipped.append(rel_s)
            continue
        target = Path(out_dir) / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        copy_confined(path, target, tree=src_dir)
        copied.append(rel_s)
    return copied, skipped


def set_config_dtype(cfg: dict, dtype: str) -> None:
    """Record ``dtype`` in a config dict: ``dtype`` always, ``torch_dtype`` where present, sub-configs too."""

    def visit(node: dict, top: bool) -> None:
        if top or "dtype" in node:
            node["dtype"] = dtype
        if "torch_dtype" in node:
            node["torch_dtype"] = dtype
        for key, value in node.items():
            if isinstance(value, dict) and key.endswith("_config") and key != "quantization_config":
                visit(value, False)

    visit(cfg, True)
