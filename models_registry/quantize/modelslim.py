"""Ascend ModelSlim checkpoints (what vllm-ascend serves with --quantization ascend), written by us.

msModelSlim 26.1.0 installs and calibrates on CPU, but its save() fails on tied embeddings, its
output lacks config.json, and it offers no KL calibration; so the console calibrates (calibrate.py,
kl.py) and writes the format itself, tensor by tensor as vllm-ascend's w8a8 / w8a8_dynamic loaders
expect (see ../shared/fixtures/SOURCES.md):

* W8A8 (static): weight int8 [n,k]; input_scale, input_offset [1] (model dtype); quant_bias int32 [n];
  deq_scale [n] (float32 for bf16/fp32 models, int64 holding the float32 bits for fp16 models);
  weight_scale, weight_offset [n,1].  x_q = round(x/input_scale) + input_offset;
  y = (x_q·Wᵀ + quant_bias)·deq_scale.
* W8A8_DYNAMIC and W8A16: weight int8, weight_scale, weight_offset [n,1].
* everything else (embeddings, norms, lm_head, fallback layers) FLOAT, in the model's dtype.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from models_registry.quantize import calibrate as cal

DESCRIPTION = "quant_model_description.json"
WEIGHT_FILE = {"W8A8": "quant_model_weight_w8a8.safetensors",
               "W8A8_DYNAMIC": "quant_model_weight_w8a8_dynamic.safetensors",
               "W8A16": "quant_model_weight_w8a16.safetensors"}
SCHEME_TYPE = {"w8a8_static": "W8A8", "w8a8_dynamic": "W8A8_DYNAMIC", "w8a16": "W8A16"}
_SKIP = {".safetensors", ".bin", ".pt", ".pth", ".gguf"}


def pack_deq_scale(deq, model_dtype):
    """float32 for bf16/fp32 models; for fp16 models the float32 bits widened to int64."""
    import torch

    deq = deq.float().contiguous()
    if model_dtype == torch.float16:
        return deq.view(torch.int32).to(torch.int64)
    return deq


def unpack_deq_scale(t):
    import torch

    if t.dtype == torch.int64:
        return t.to(torch.int32).view(torch.float32)
    return t.float()


def quantize_weight(w):
    import torch

    w = w.float()
    scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / 127.0
    q = torch.clamp(torch.round(w / scale), -128, 127).to(torch.int8)
    return q, scale


def copy_model_files(src: Path, dst: Path) -> list[str]:
    copied = []
    for path in sorted(Path(src).iterdir()):
        if path.is_file() and path.suffix not in _SKIP and not path.name.endswith(".index.json") \
                and not path.name.startswith("."):
            shutil.copy2(path, Path(dst) / path.name)
            copied.append(path.name)
    return copied


def write_checkpoint(model, src: Path, dst: Path, *, scheme: str, act_params: dict, float_layers: set[str],
                     model_dtype) -> dict:
    """Write description + weights + the model's own config/tokenizer files into dst."""
    import torch
    from safetensors.torch import save_file

    qtype = SCHEME_TYPE[scheme]
    linears = cal.quant_linears(model)
    tensors: dict = {}
    desc: dict = {"model_quant_type": qtype, "version": "1.0.0"}
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    seen = set()
    for name, param in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        module = name.rsplit(".", 1)[0]
        if module in linears and module not in float_layers and name.endswith(".weight"):
            if module in seen:
                continue
            seen.add(module)
            lin = linears[module]
            q, w_scale = quantize_weight(lin.weight.detach())
            n = q.shape[0]
            out = {
                f"{module}.weight": q.contiguous(),
                f"{module}.weight_scale": w_scale.to(model_dtype).contiguous(),
                f"{module}.weight_offset": torch.zeros(n, 1, dtype=model_dtype),
            }
            if qtype == "W8A8":
                scale, offset = act_params[module]
                in_scale = torch.tensor([scale], dtype=model_dtype)
                in_offset = torch.tensor([offset], dtype=model_dtype)
                deq = in_scale.float() * w_scale[:, 0]  # computed from the stored (rounded) input scale
                bias = lin.bias.detach().float() if lin.bias is not None else torch.zeros(n)
                qbias = torch.round(-float(in_offset) * q.float().sum(dim=1) + bias / deq).to(torch.int32)
                out.update({
                    f"{module}.input_scale": in_scale,
                    f"{module}.input_offset": in_offset,
                    f"{module}.quant_bias": qbias.contiguous(),
                    f"{module}.deq_scale": pack_deq_scale(deq, model_dtype),
                })
            elif lin.bias is not None:
                out[f"{module}.bias"] = lin.bias.detach().to(model_dtype).contiguous()
            for key in out:
                desc[key] = qtype
            tensors.update(out)
            continue
        if module in linears and module not in float_layers and name.endswith(".bias"):
            continue  # handled with the weight
        tensors[name] = param.detach().to(model_dtype if param.is_floating_point() else param.dtype).contiguous()
        desc[name] = "FLOAT"
    dst.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dst / WEIGHT_FILE[qtype]), metadata={"format": "pt"})
    (dst / DESCRIPTION).write_text(json.dumps(desc, indent=2) + "\n")
    copied = copy_model_files(src, dst)
    return {"weight_file": WEIGHT_FILE[qtype], "tensors": len(tensors), "copied": copied,
            "float_layers": sorted(float_layers)}


class SimLinear:
    """Runs a layer exactly as the checkpoint describes it (the documented integer arithmetic)."""

    def __init__(self, tensors: dict, prefix: str, qtype: str):
        import torch

        self.qtype = qtype
        self.w = tensors[f"{prefix}.weight"].float()
        self.w_scale = tensors[f"{prefix}.weight_scale"].float()
        self.bias = tensors[f"{prefix}.bias"].float() if f"{prefix}.bias" in tensors else None
        if qtype == "W8A8":
            self.in_scale = float(tensors[f"{prefix}.input_scale"].float())
            self.in_offset = float(tensors[f"{prefix}.input_offset"].float())
            self.qbias = tensors[f"{prefix}.quant_bias"].double()
            self.deq = unpack_deq_scale(tensors[f"{prefix}.deq_scale"]).double()
        self.torch = torch

    def __call__(self, x):
        torch = self.torch
        shape, dtype = x.shape, x.dtype
        x = x.float().reshape(-1, shape[-1])
        if self.qtype == "W8A8":
            xq = torch.clamp(torch.round(x / self.in_scale) + self.in_offset, -128, 127)
            y = ((xq.double() @ self.w.double().T + self.qbias) * self.deq).float()
        elif self.qtype == "W8A8_DYNAMIC":
            s = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-8) / 127.0
            xq = torch.clamp(torch.round(x / s), -128, 127)
            y = (xq @ self.w.T) * s * self.w_scale.T
        else:
            y = x @ (self.w * self.w_scale).T
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], -1).to(dtype)


def simulated(model, dst: Path):
    """Context manager: the model's projections replaced by the checkpoint's arithmetic."""
    import contextlib

    from safetensors.torch import load_file

    @contextlib.contextmanager
    def cm():
        desc = json.loads((dst / DESCRIPTION).read_text())
        qtype = desc["model_quant_type"]
        tensors = load_file(str(dst / WEIGHT_FILE[qtype]))
        saved = {}
        for name, module in cal.quant_linears(model).items():
            if desc.get(f"{name}.weight") == qtype:
                saved[name] = module.forward
                module.forward = SimLinear(tensors, name, qtype)
        try:
            yield model
        finally:
            for name, module in cal.quant_linears(model).items():
                if name in saved:
                    module.forward = saved[name]

    return cm()


def act_params_for(stats: dict, method: str) -> dict:
    # KL is symmetric (offset 0); min-max and histogram use the asymmetric int8 grid (as msModelSlim).
    symmetric = method == "kl"
    m = "minmax" if method == "auto" else method
    return {name: cal.activation_qparams(s, m, symmetric=symmetric) for name, s in stats.items()}


def check_against_fixture(dst: Path) -> list[str]:
    """Problems with a written checkpoint, against the documented tensor names/dtypes/shapes."""
    from safetensors import safe_open

    problems = []
    desc = json.loads((dst / DESCRIPTION).read_text())
    qtype = desc.get("model_quant_type")
    with safe_open(str(dst / WEIGHT_FILE[qtype]), "pt") as f:
        keys = set(f.keys())
        for key in keys:
            if key not in desc:
                problems.append(f"{key} missing from the description")
        for key in desc:
            if key not in ("model_quant_type", "version") and key not in keys:
                problems.append(f"{key} described but not written")
    return problems


