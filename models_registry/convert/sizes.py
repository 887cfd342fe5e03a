"""Disk space to reserve before a conversion."""

from __future__ import annotations

from models_registry.convert.common import TOKENIZER_MARGIN_BYTES, ConversionError

# ----------------------------------------------------------------------------------------------
# 6. size estimate
# ----------------------------------------------------------------------------------------------

_BYTES_PER_PARAM = {
    "hf": 2,
    "fp16": 2,
    "float16": 2,
    "bf16": 2,
    "bfloat16": 2,
    "fp32": 4,
    "float32": 4,
    "onnx": 4,  # export_onnx writes float32
    # The float32 ONNX intermediate (kept as an artifact) and the OM beside it, which must_keep_origin_dtype keeps
    # in float32 too (force_fp16 needs about half): both stay, so both are reserved.
    "om": 4 + 4,
}


def estimate_output_bytes(*, param_count: int, to: str) -> int:
    """Bytes to reserve for a conversion's output: ``param_count`` times the target's bytes per
    parameter, plus a margin for tokenizer and config files."""
    if isinstance(param_count, bool) or not isinstance(param_count, int) or param_count < 0:
        raise ConversionError(f"Invalid parameter count {param_count!r}: must be a non-negative integer.")
    key = str(to).strip().lower()
    if key not in _BYTES_PER_PARAM:
        raise ConversionError(f"Unknown conversion target {to!r}: choose one of {', '.join(_BYTES_PER_PARAM)}.")
    return param_count * _BYTES_PER_PARAM[key] + TOKENIZER_MARGIN_BYTES
