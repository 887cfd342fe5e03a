"""Ascend ModelSlim checkpoints (what vllm-ascend serves with --quantization ascend): msModelSlim
writes them (msmodelslim_run.py); this module finishes them for serving and runs them as written.

Per layer, as vllm-ascend's w8a8 / w8a8_dynamic loaders expect (see ../shared/fixtures/SOURCES.md):
* W8A8 (static): weight int8 [n,k]; input_scale, input_offset [1]; quant_bias int32 [n];
  deq_scale [n] (float32 for bf16/fp32 models, int64 holding the float32 bits for fp16 models);
  weight_scale, weight_offset [n,1].  x_q = round(x/input_scale) + input_offset;
  y = (x_q·Wᵀ + quant_bias)·deq_scale.
* W8A8_DYNAMIC and W8A16: weight int8, weight_scale, weight_offset [n,1].
* everything else (embeddings, norms, lm_head, fallback layers) FLOAT.
msModelSlim calibrates in float32 and saves float tensors so; finish() casts them to the model's
dtype (the size of the source, and what vllm-ascend loads them as) except input_offset (int8, as
upstream creates it), drops the tensor of an lm_head that only repeats tied embeddings (its
description stays FLOAT), and copies the model's own config and tokenizer files in (msModelSlim
writes no config.json).
"""

from __future__ import annotations

import json
from pathlib import Path

from models_registry.paths import copy_confined, tree_files
from models_registry.quantize import calibrate as cal

DESCRIPTION = "quant_model_description.json"
WEIGHT_FILE = {
    "W8A8": "quant_model_weight_w8a8.safetensors",
    "W8A8_DYNAMIC": "quant_model_weight_w8a8_dynamic.safetensors",
    "W8A16": "quant_model_weight_w8a16.safetensors",
}
SCHEME_TYPE = {"w8a8_static": "W8A8", "w8a8_dynamic": "W8A8_DYNAMIC", "w8a16": "W8A16"}
_SKIP = {".safetensors", ".bin", ".pt", ".pth", ".gguf"}


def unpack_deq_scale(t):
    import torch

    if t.dtype == torch.int64:
        return t.to(torch.int32).view(torch.float32)
    return t.float()


def copy_model_files(src: Path, dst: Path) -> list[str]:
    """The model's own top-level config and tokenizer files, copied without following a link out of the roots."""
    src = Path(src)
    copied = []
    for path in tree_files(src, hidden=False):
        if path.parent == src and path.suffix not in _SKIP and not path.name.endswith(".index.json"):
            copy_confined(path, Path(dst) / path.name, tree=src)
            copied.append(path.name)
    return copied


def finish(dst: Path, src: Path, *, model_dtype, tied: bool) -> dict:
    """Make msModelSlim's output servable as the source model was: float tensors in the model's
    dtype (deq_scale keeps its packing, input_offset int8), a tied lm_head's tensor dropped when it
    only repeats the embeddings,
    and the model's own config/tokenizer files copied in unchanged."""
    import torch
    from safetensors.torch import load_file, save_file

    desc = json.loads((dst / DESCRIPTION).read_text())
    weight_file = WEIGHT_FILE[desc["model_quant_type"]]
    tensors = load_file(str(dst / weight_file))
    for name, t in tensors.items():
        if name.endswith(".input_offset"):  # w8a8_static.py creates it int8; msModelSlim saves an integral float
            tensors[name] = t.round().clamp(-128, 127).to(torch.int8).contiguous()
        elif t.is_floating_point() and not name.endswith(".deq_scale"):
            tensors[name] = t.to(model_dtype).contiguous()
    notes = []
    lm, emb = tensors.get("lm_head.weight"), tensors.get("model.embed_tokens.weight")
    if tied and lm is not None and emb is not None:
        if torch.equal(lm, emb):
            # The tensor goes (the loader skips "lm_head." when tied), its description stays: vLLM builds
            # lm_head with the quant config even when tied and vllm-ascend looks "lm_head.weight" up
            # (modelslim_config.py get_quant_method); msModelSlim itself writes it FLOAT.
            del tensors["lm_head.weight"]
            desc["lm_head.weight"] = "FLOAT"
        else:
            notes.append("lm_head differs from the tied embeddings after outlier suppression: kept separately.")
    nonzero_bias = [n for n, t in tensors.items() if n.endswith("norm.bias") and bool(t.any())]
    save_file(tensors, str(dst / weight_file), metadata={"format": "pt"})
    (dst / DESCRIPTION).write_text(json.dumps(desc, indent=2) + "\n")
    copied = copy_model_files(src, dst)
    if notes:
        cfg = json.loads((dst / "config.json").read_text())
        cfg["tie_word_embeddings"] = False
        (dst / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return {
        "weight_file": weight_file,
        "tensors": len(tensors),
        "copied": copied,
        "notes": notes,
        "norm_biases": nonzero_bias,
    }


class SimLinear:
    """Runs a layer as vllm-ascend v0.23.0 computes it from the checkpoint (quantization/methods/
    w8a8_static.py, w8a8_dynamic.py, w8a16.py: process_weights_after_loading + apply; the torch_npu ops
    written out in plain torch). tests/models_registry/test_modelslim_simulation.py checks it against those
    files themselves, vendored unchanged and run with torch_npu stand-ins (tests/fixtures/vllm_ascend_quant).

    * W8A8 static: x_q = clamp(round(x·r + input_offset)), r = 1/input_scale computed in the model's
      dtype (as process_weights_after_loading does), the offset added before rounding (npu_quantize with
      div_mode=False: input·scales + zero_points; ties go to even, as the kernel's rint cast; bf16
      activations and scales make ties common, so the order matters); y = (x_q·Wᵀ + quant_bias)·deq_scale. The layer's
      float bias is not added: apply() passes quant_bias to npu_quant_matmul in its place (msModelSlim
      folds the float bias into quant_bias).
    * W8A8 dynamic: per-token s = max|x|/127, x_q = round(x/s); y = (x_q·Wᵀ)·s·weight_scale + bias.
    * W8A16: y = x·((W + weight_offset)·weight_scale)ᵀ + bias (npu_weight_quant_batchmatmul).
    The output is cast to the model's dtype, as output_dtype=params_dtype does."""

    def __init__(self, tensors: dict, prefix: str, qtype: str):
        import torch

        self.qtype = qtype
        self.w = tensors[f"{prefix}.weight"].float()
        self.w_scale = tensors[f"{prefix}.weight_scale"].float()
        self.w_offset = tensors[f"{prefix}.weight_offset"].float()
        self.bias = tensors[f"{prefix}.bias"].float() if f"{prefix}.bias" in tensors else None
        if qtype == "W8A8":
            scale = tensors[f"{prefix}.input_scale"]  # in the model's dtype
            self.in_reciprocal = float((1 / scale).to(scale.dtype).float())
            self.in_offset = float(tensors[f"{prefix}.input_offset"].float())
            self.qbias = tensors[f"{prefix}.quant_bias"].double()
            self.deq = unpack_deq_scale(tensors[f"{prefix}.deq_scale"]).double()
        self.torch = torch

    def __call__(self, x):
        torch = self.torch
        shape, dtype = x.shape, x.dtype
        x = x.float().reshape(-1, shape[-1])
        if self.qtype == "W8A8":
            xq = torch.clamp(torch.round(x * self.in_reciprocal + self.in_offset), -128, 127)
            y = ((xq.double() @ self.w.double().T + self.qbias) * self.deq).float()
        elif self.qtype == "W8A8_DYNAMIC":
            s = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-8) / 127.0
            xq = torch.clamp(torch.round(x / s), -128, 127)
            y = (xq @ self.w.T) * s * self.w_scale.T
        else:
            y = x @ ((self.w + self.w_offset) * self.w_scale).T
        if self.bias is not None and self.qtype != "W8A8":
            y = y + self.bias
        return y.reshape(*shape[:-1], -1).to(dtype)


def simulated(model, dst: Path):
    """Context manager: the model run as the checkpoint describes it: its FLOAT tensors loaded (outlier
    suppression rescales norms), norm biases added, and the projections replaced by the integer
    arithmetic of the quantized layers."""
    import contextlib

    import torch
    from safetensors.torch import load_file

    @contextlib.contextmanager
    def cm():
        desc = json.loads((dst / DESCRIPTION).read_text())
        qtype = desc["model_quant_type"]
        tensors = load_file(str(dst / WEIGHT_FILE[qtype]))
        params = dict(model.named_parameters())
        saved_params, saved_forward, hooks = {}, {}, []
        for name, t in tensors.items():
            if (
                desc.get(name) == "FLOAT"
                and name in params
                and not torch.equal(params[name].data, t.to(params[name].dtype))
            ):
                saved_params[name] = params[name].data.clone()
                params[name].data.copy_(t.to(params[name].dtype))
            elif name.endswith("norm.bias") and bool(t.any()):
                norm = model.get_submodule(name.rsplit(".", 1)[0])
                hooks.append(norm.register_forward_hook(lambda m, a, out, b=t: out + b.to(out.dtype)))
        for name, module in cal.quant_linears(model).items():
            if desc.get(f"{name}.weight") == qtype:
                saved_forward[name] = module.forward
                module.forward = SimLinear(tensors, name, qtype)
        try:
            yield model
        finally:
            for h in hooks:
                h.remove()
            for name, module in cal.quant_linears(model).items():
                if name in saved_forward:
                    module.forward = saved_forward[name]
            for name, data in saved_params.items():
                params[name].data.copy_(data)

    return cm()


def act_params_for(stats: dict, method: str) -> dict:
    # KL is symmetric (offset 0); min-max and histogram use the asymmetric int8 grid (as msModelSlim).
    symmetric = method == "kl"
    m = "minmax" if method == "auto" else method
    return {name: cal.activation_qparams(s, m, symmetric=symmetric) for name, s in stats.items()}
