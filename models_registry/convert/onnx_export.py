"""Fixed-shape ONNX export of a causal LM (``logits`` output, no KV cache)."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

from models_registry.convert.common import (
    ConversionError,
    check_architecture,
    copy_non_weight_files,
    find_weight_files,
    first_line,
    prepare_out_dir,
    read_hf_config,
)
from models_registry.convert.progress import (
    ProgressFn,
    clamped_progress,
    silent_progress,
    transformers_progress,
)
from models_registry.paths import tree_size

# ----------------------------------------------------------------------------------------------
# 4. ONNX export
# ----------------------------------------------------------------------------------------------

ONNX_OPSET = 18
ONNX_EXTERNAL_DATA_BYTES = 1536 * 1024**2  # protobuf's 2 GiB limit, with room to spare


def export_onnx(
    src_dir: Path, out_dir: Path, *, batch_size: int = 1, seq_len: int = 128, progress: ProgressFn | None = None
) -> dict:
    """Export a causal LM to ONNX for a fixed batch and sequence length (float32, no KV cache).

    Inputs ``input_ids`` and ``attention_mask`` (int64, ``[batch_size, seq_len]``), output ``logits``
    (float32, ``[batch_size, seq_len, vocab]``).  Writes ``out_dir/model.onnx`` (plus
    ``model.onnx.data`` for models over ~1.5 GB) and copies the tokenizer and config files.
    The returned ``input_shape`` is ready for :func:`run_atc`.
    """
    import torch

    report = clamped_progress(progress)
    if not isinstance(batch_size, int) or not 1 <= batch_size <= 1024:
        raise ConversionError(f"Invalid batch size {batch_size!r}: must be an integer from 1 to 1024.")
    src_dir = Path(src_dir)
    cfg = read_hf_config(src_dir)
    check_architecture(cfg, src_dir, causal_lm=True)
    max_pos = cfg.get("max_position_embeddings") or (cfg.get("text_config") or {}).get("max_position_embeddings")
    limit = int(max_pos) if isinstance(max_pos, int) and max_pos > 0 else 1 << 20
    if not isinstance(seq_len, int) or not 1 <= seq_len <= limit:
        raise ConversionError(f"Invalid sequence length {seq_len!r}: must be an integer from 1 to {limit}.")
    find_weight_files(src_dir)
    try:
        import onnx  # noqa: F401
        import onnxscript  # noqa: F401
    except ImportError as exc:
        raise ConversionError("ONNX export needs the 'onnx' and 'onnxscript' packages (see requirements.txt).") from exc
    out_dir = prepare_out_dir(out_dir)

    report(0, "loading model (float32)")
    from transformers import AutoModelForCausalLM

    try:
        with transformers_progress(silent_progress):
            model = AutoModelForCausalLM.from_pretrained(str(src_dir), dtype=torch.float32, attn_implementation="eager")
    except Exception as exc:  # noqa: BLE001
        raise ConversionError(f"transformers cannot load {src_dir}: {first_line(exc)}") from exc
    model.eval()
    model.config.use_cache = False
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    vocab = model.get_output_embeddings().weight.shape[0] if model.get_output_embeddings() is not None else None

    class LogitsOnly(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask):
            return self.inner(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits

    wrapper = LogitsOnly(model).eval()
    ids = torch.arange(batch_size * seq_len, dtype=torch.long).reshape(batch_size, seq_len) % max(vocab or 2, 2)
    mask = torch.ones_like(ids)
    onnx_path = out_dir / "model.onnx"
    external = param_bytes > ONNX_EXTERNAL_DATA_BYTES
    report(15, "exporting to ONNX")
    log = io.StringIO()
    try:
        with torch.inference_mode(False), torch.no_grad(), contextlib.redirect_stdout(log):
            torch.onnx.export(
                wrapper,
                (ids, mask),
                str(onnx_path),
                input_names=["input_ids", "attention_mask"],
                output_names=["logits"],
                opset_version=ONNX_OPSET,
                dynamo=True,
                external_data=external,
                verbose=False,
            )
    except Exception as exc:  # noqa: BLE001
        tail = "\n".join(log.getvalue().strip().splitlines()[-5:])
        raise ConversionError(
            f"ONNX export of {cfg.get('model_type')} failed: {first_line(exc)}" + (f"\n{tail}" if tail else "")
        ) from exc
    finally:
        del wrapper, model
    report(85, "checking the ONNX model")
    import onnx

    try:
        onnx.checker.check_model(str(onnx_path))
        graph = onnx.load(str(onnx_path), load_external_data=False).graph
    except Exception as exc:  # noqa: BLE001
        raise ConversionError(f"The exported ONNX model is invalid: {first_line(exc)}") from exc
    inputs = [i.name for i in graph.input]
    outputs = [o.name for o in graph.output]
    report(95, "copying tokenizer and config files")
    copy_non_weight_files(src_dir, out_dir)
    report(100, "done")
    return {
        "onnx_path": str(onnx_path),
        "external_data": external,
        "batch_size": batch_size,
        "seq_len": seq_len,
        "opset": ONNX_OPSET,
        "inputs": inputs,
        "outputs": outputs,
        "input_shape": ";".join(f"{name}:{batch_size},{seq_len}" for name in inputs),
        "dtype": "float32",
        "architecture": (cfg.get("architectures") or [cfg.get("model_type")])[0],
        "size_bytes": tree_size(out_dir),
    }
