"""Model conversions as pure functions (no Django): the job classes call these.

Every function takes plain paths and returns a plain ``dict`` describing what it produced.
Expected failures (bad input, unsupported model, corrupt file, missing tool) raise
:class:`ConversionError` with a message an operator can act on; library exceptions are wrapped.

``progress(pct: float, stage: str)`` callbacks are called often (per tensor where the work is
per tensor); a callback may raise to cancel, and that exception propagates unchanged.  Output
directories are staging directories owned by the caller: on failure they may hold partial files
and the caller is expected to remove them.

One module per step: :mod:`.from_gguf` (GGUF → HF), :mod:`.precision`, :mod:`.verify` (logits check),
:mod:`.onnx_export`, :mod:`.atc`, :mod:`.sizes`; over :mod:`.common`, :mod:`.progress`,
:mod:`.shards` (the streaming safetensors writer) and :mod:`.sources` (streaming weight readers).
"""

from models_registry.convert.atc import ATC_PRECISION_MODES, ATC_SOC_VERSIONS, AtcNotFound, find_atc, run_atc
from models_registry.convert.common import DEFAULT_MAX_SHARD_BYTES, ConversionError
from models_registry.convert.from_gguf import gguf_to_hf
from models_registry.convert.onnx_export import export_onnx
from models_registry.convert.precision import convert_precision
from models_registry.convert.sizes import estimate_output_bytes
from models_registry.convert.verify import VERIFY_PROMPTS, compare_logits, resolve_model_source

__all__ = [
    "ATC_PRECISION_MODES",
    "ATC_SOC_VERSIONS",
    "AtcNotFound",
    "ConversionError",
    "DEFAULT_MAX_SHARD_BYTES",
    "VERIFY_PROMPTS",
    "compare_logits",
    "convert_precision",
    "estimate_output_bytes",
    "export_onnx",
    "find_atc",
    "gguf_to_hf",
    "resolve_model_source",
    "run_atc",
]
