"""fp32/bf16 -> fp16, fp32/fp16 -> bf16, streamed tensor by tensor, large tensors in slices."""

from __future__ import annotations

import json
import math
from pathlib import Path

from models_registry.convert.common import (
    DEFAULT_MAX_SHARD_BYTES,
    ST_ITEMSIZE,
    ST_TO_TORCH,
    TORCH_TO_ST,
    ConversionError,
    check_architecture,
    copy_non_weight_files,
    find_weight_files,
    normalize_dtype,
    prepare_out_dir,
    read_hf_config,
    require_tokenizer,
    set_config_dtype,
    torch_dtype_of,
)
from models_registry.convert.progress import ProgressFn, clamped_progress
from models_registry.convert.shards import ShardWriter
from models_registry.convert.sources import BinSource, SafetensorsSource, cast_chunks
from models_registry.paths import tree_size

_CONVERTIBLE_SOURCES = {"float32", "float16", "bfloat16"}


def convert_precision(
    src_dir: Path, out_dir: Path, *, dtype: str, progress: ProgressFn | None = None, max_shard_bytes: int | None = None
) -> dict:
    """Convert a Hugging Face checkpoint's floating-point weights to float16 or bfloat16.

    Tensors are streamed one at a time, large ones in ~16 MB slices (so peak memory is a few slices,
    not a shard or the model); non-floating tensors
    are copied unchanged; every non-weight file (tokenizer, generation config, chat template...)
    is copied; ``config.json`` records the new dtype.  Output is always safetensors (``.bin``
    sources are converted too).  Returns ``{"dtype", "source_dtype", "num_tensors", "size_bytes",
    "architecture", "shards", ...}``.
    """
    report = clamped_progress(progress)
    target = normalize_dtype(dtype, ("float16", "bfloat16"), "target dtype")
    src_dir = Path(src_dir)
    cfg = read_hf_config(src_dir)
    if cfg.get("quantization_config") or (src_dir / "quant_model_description.json").is_file():
        method = (cfg.get("quantization_config") or {}).get("quant_method", "ascend modelslim")
        raise ConversionError(
            f"{src_dir.name} is a quantized checkpoint ({method}); precision conversion only "
            f"applies to unquantized float32/float16/bfloat16 checkpoints."
        )
    if not cfg.get("auto_map"):  # custom-code models cannot be checked against transformers
        check_architecture(cfg, src_dir)
    require_tokenizer(src_dir)
    kind, files, weight_files = find_weight_files(src_dir)
    out_dir = prepare_out_dir(out_dir)
    max_shard = int(max_shard_bytes or DEFAULT_MAX_SHARD_BYTES)

    report(0, "reading tensor headers")
    source = SafetensorsSource(files) if kind == "safetensors" else BinSource(files)
    if not source.entries:
        raise ConversionError(f"{src_dir.name} holds no tensors.")
    float_bytes: dict[str, int] = {}
    for _, name, st, shape in source.entries:
        tname = ST_TO_TORCH[st]
        if tname.startswith("float8"):
            raise ConversionError(
                f"{src_dir.name} holds float8 tensors (e.g. {name}): an FP8-quantized "
                f"checkpoint cannot be converted to {target}."
            )
        if tname.startswith(("float", "bfloat")):
            float_bytes[tname] = float_bytes.get(tname, 0) + math.prod(shape) * ST_ITEMSIZE[st]
    if not float_bytes:
        raise ConversionError(f"{src_dir.name} has no floating-point tensors to convert.")
    source_dtype = max(float_bytes, key=float_bytes.get)
    if source_dtype == target and len(float_bytes) == 1:
        raise ConversionError(f"{src_dir.name} is already {target}: nothing to convert.")
    if source_dtype == target:
        raise ConversionError(
            f"{src_dir.name} is already mostly {target} (with some "
            f"{', '.join(sorted(set(float_bytes) - {target}))} tensors): nothing to convert."
        )
    if source_dtype not in _CONVERTIBLE_SOURCES:
        raise ConversionError(
            f"Unsupported conversion {source_dtype} -> {target}: only float32/float16/bfloat16 "
            f"checkpoints can be converted."
        )

    target_st = TORCH_TO_ST[target]
    target_torch = torch_dtype_of(target)
    plan = []
    for _, name, st, shape in source.entries:
        is_float = ST_TO_TORCH[st].startswith(("float", "bfloat"))
        plan.append((name, target_st if is_float else st, shape))
    writer = ShardWriter(out_dir, plan, max_shard_bytes=max_shard)
    total = sum(math.prod(s) * ST_ITEMSIZE[d] for _, _, d, s in source.entries) or 1
    done = 0
    n = len(source.entries)
    try:
        for i, (file, name, st, shape) in enumerate(source.entries):
            report(95 * done / total, f"converting {name} ({i + 1}/{n})")
            chunks = source.rows(file, name, shape, ST_ITEMSIZE[st])
            if ST_TO_TORCH[st].startswith(("float", "bfloat")):
                chunks = cast_chunks(chunks, name, target_torch)
            writer.write_rows(name, chunks)
            done += math.prod(shape) * ST_ITEMSIZE[st]
        info = writer.close()
    except BaseException:
        writer.abort()
        raise
    finally:
        source.close()

    report(96, "copying tokenizer and config files")
    copied, skipped = copy_non_weight_files(
        src_dir, out_dir, exclude={f.relative_to(src_dir).as_posix() for f in weight_files} | {"config.json"}
    )
    set_config_dtype(cfg, target)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    report(100, "done")
    archs = cfg.get("architectures") or []
    return {
        "dtype": target,
        "source_dtype": source_dtype,
        "source_format": kind,
        "num_tensors": info["num_tensors"],
        "size_bytes": tree_size(out_dir),
        "architecture": archs[0] if archs else cfg.get("model_type"),
        "shards": info["shards"],
        "copied_files": copied,
        "skipped_files": skipped,
    }
