"""What both targets share: loading, calibration text, activation statistics, fake quantisation
and the per-layer error / sensitivity ranking."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from models_registry.paths import read_confined
from models_registry.quantize.kl import KLObserver
from models_registry.quantize.modelslim_check import SHARD_GROUP

# Decoder-only models whose projections are plain nn.Linear (what both writers handle).
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
SAMPLE_ROWS = 256  # activation rows kept per layer for the error measurement


class QuantizeError(ValueError):
    """A failure meant for the operator."""


def read_config(src: Path) -> dict:
    try:
        return json.loads(read_confined(Path(src) / "config.json", tree=src))
    except (OSError, ValueError) as exc:
        raise QuantizeError(f"{src} has no readable config.json: {exc}") from exc


def check_architecture(cfg: dict, library: str) -> None:
    archs = cfg.get("architectures") or []
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise QuantizeError(
            f"Unsupported architecture {', '.join(archs) or cfg.get('model_type') or 'unknown'}: "
            f"{library} quantization here supports decoder-only models with linear projections "
            f"({', '.join(SUPPORTED_ARCHITECTURES)})."
        )


def load_model(src: Path, dtype=None):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(src))
        model = AutoModelForCausalLM.from_pretrained(str(src), dtype=dtype or torch.float32)
    except MemoryError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise QuantizeError(f"transformers cannot load {src}: {str(exc).splitlines()[0][:300]}") from exc
    model.eval()
    return model, tok


@dataclass
class CalibrationText:
    ids: list[list[int]]
    truncated: int  # samples cut to the model's context
    max_len: int
    notes: list[str] = field(default_factory=list)


def encode_calibration(tokenizer, texts: list[str], *, max_len: int, context: int) -> CalibrationText:
    limit = min(max_len, context)
    ids, truncated = [], 0
    for text in texts:
        enc = tokenizer(text)["input_ids"]
        if len(enc) > limit:
            truncated += 1
            enc = enc[:limit]
        if len(enc) >= 2:
            ids.append(enc)
    notes = []
    if truncated:
        notes.append(
            f"{truncated} calibration sample(s) longer than {limit} tokens "
            f"(the model's context is {context}) were truncated to {limit}."
        )
    return CalibrationText(ids=ids, truncated=truncated, max_len=limit, notes=notes)


def quant_linears(model) -> dict:
    """name -> nn.Linear for every projection inside the decoder layers (lm_head stays float)."""
    import torch

    return {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n}


@dataclass
class LayerStats:
    min: float = math.inf
    max: float = -math.inf
    kl: KLObserver = field(default_factory=KLObserver)
    rows: list = field(default_factory=list)
    nonfinite: int = 0


def collect_stats(model, batches: list[list[int]], *, progress=None, kl: bool = True) -> dict[str, LayerStats]:
    """Run the float model on the calibration ids; record each projection's input range, histogram
    (for KL) and a sample of input rows. NaN/inf in an input is an error naming the layer."""
    import torch

    linears = quant_linears(model)
    stats = {name: LayerStats() for name in linears}
    rng = np.random.default_rng(0)

    def hook(name):
        def fn(module, args):
            x = args[0].detach().float().reshape(-1, args[0].shape[-1])
            s = stats[name]
            finite = torch.isfinite(x)
            if not bool(finite.all()):
                s.nonfinite += int((~finite).sum())
                x = torch.where(finite, x, torch.zeros_like(x))
            s.min = min(s.min, float(x.min()))
            s.max = max(s.max, float(x.max()))
            if kl:
                s.kl.observe(x.numpy())
            keep = rng.choice(x.shape[0], size=min(32, x.shape[0]), replace=False)
            if sum(r.shape[0] for r in s.rows) < SAMPLE_ROWS:
                s.rows.append(x[keep].clone())

        return fn

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in linears.items()]
    try:
        with torch.inference_mode():
            for i, ids in enumerate(batches):
                model(input_ids=torch.tensor([ids]), use_cache=False)
                if progress:
                    progress(100 * (i + 1) / len(batches), f"calibrating ({i + 1}/{len(batches)} samples)")
    finally:
        for h in handles:
            h.remove()
    bad = {n: s.nonfinite for n, s in stats.items() if s.nonfinite}
    if bad:
        first = next(iter(bad))
        raise QuantizeError(
            f"NaN/inf in the activations of {len(bad)} layer(s) (first: {first}, "
            f"{bad[first]} values): the float model itself overflows on this calibration text; "
            f"quantization would be meaningless. Check the model in float32 or use other text."
        )
    return stats


def activation_qparams(s: LayerStats, method: str, *, symmetric: bool) -> tuple[float, float]:
    """(scale, offset) for a per-tensor int8 activation: x_q = round(x/scale) + offset."""
    if method == "kl":
        return s.kl.scale(), 0.0
    lo, hi = min(s.min, 0.0), max(s.max, 0.0)
    if method == "histogram":  # clip the 0.01 % tails of the |x| histogram
        h = s.kl.hist
        if h.sum() > 0:
            cdf = np.cumsum(h) / h.sum()
            edge = (int(np.searchsorted(cdf, 0.9999)) + 1) * s.kl.max / len(h)
            lo, hi = max(lo, -edge), min(hi, edge)
    if symmetric:
        a = max(abs(lo), abs(hi)) or 1e-8
        return a / 127.0, 0.0
    scale = max(hi - lo, 1e-8) / 255.0
    offset = float(np.clip(round(-128 - lo / scale), -128, 127))
    return scale, offset


def fake_weight(w):
    import torch

    scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / 127.0
    return torch.clamp(torch.round(w / scale), -128, 127) * scale


def fake_act(x, *, scheme: str, scale: float | None = None, offset: float = 0.0):
    import torch

    if scheme == "W8A16":
        return x
    if scale is None:  # dynamic per-token
        s = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-8) / 127.0
        return torch.clamp(torch.round(x / s), -128, 127) * s
    q = torch.clamp(torch.round(x / scale) + offset, -128, 127)
    return (q - offset) * scale


def layer_errors(model, stats: dict[str, LayerStats], *, scheme: str, act_params: dict | None = None) -> list[dict]:
    """Relative output error ‖ŷ − y‖/‖y‖ of every projection on sampled calibration inputs."""
    import torch

    out = []
    with torch.inference_mode():
        for name, module in quant_linears(model).items():
            rows = stats[name].rows
            if not rows:
                continue
            x = torch.cat(rows)[:SAMPLE_ROWS]
            w = module.weight.float()
            y = x @ w.T
            scale, offset = (act_params or {}).get(name, (None, 0.0))
            yq = fake_act(x, scheme=scheme, scale=scale, offset=offset) @ fake_weight(w).T
            err = float((yq - y).norm() / y.norm().clamp(min=1e-12))
            out.append({"layer": name, "rel_error": err})
    return out


def sensitivity(
    model,
    batches: list[list[int]],
    errors: list[dict],
    *,
    scheme: str,
    act_params: dict | None = None,
    max_tokens: int = 512,
) -> None:
    """Each projection's effect on the loss, from one forward and backward pass (the Fisher
    approximation used by HAWQ-style mixed precision): with g the gradient of the next-token loss at
    the layer's output and Δy the change int8 makes to that output (fake quantisation as the scheme
    does it), the loss moves by about ½·Σ_tokens (g·Δy)². Added to ``errors`` as "sensitivity".
    The per-layer output error alone ranks badly: v_proj layers have the largest relative errors
    and matter less to the loss than down_proj layers with small ones (measured on the demo model)."""
    import torch

    ids, total = [], 0
    for b in batches:
        take = b[: max_tokens - total]
        if len(take) >= 2:
            ids.append(torch.tensor([take]))
            total += len(take)
        if total >= max_tokens:
            break
    linears = quant_linears(model)
    score = dict.fromkeys(linears, 0.0)
    captured: dict = {}

    def hook(name):
        def fn(module, args, out):
            out.retain_grad()
            captured[name] = (args[0].detach(), out)

        return fn

    handles = [m.register_forward_hook(hook(n)) for n, m in linears.items()]
    was_training = model.training
    try:
        with torch.enable_grad():
            for x in ids:
                captured.clear()
                model.zero_grad(set_to_none=True)
                loss = model(input_ids=x, labels=x, use_cache=False).loss * (x.shape[1] - 1)
                loss.backward()
                with torch.no_grad():
                    for name, (inp, out) in captured.items():
                        module = linears[name]
                        scale, offset = (act_params or {}).get(name, (None, 0.0))
                        w = module.weight.float()
                        inp = inp.float()
                        dy = fake_act(inp, scheme=scheme, scale=scale, offset=offset) @ fake_weight(w).T - inp @ w.T
                        score[name] += 0.5 * float(((out.grad.float() * dy).sum(-1) ** 2).sum())
    finally:
        for h in handles:
            h.remove()
        model.zero_grad(set_to_none=True)
        model.train(was_training)
    for e in errors:
        e["sensitivity"] = score.get(e["layer"], 0.0)


def fused_group(layer: str) -> str:
    """The layer vLLM builds a projection into: q/k/v → qkv_proj, gate/up → gate_up_proj (its
    packed_modules_mapping); o_proj and down_proj are their own."""
    parent, _, proj = layer.rpartition(".")
    return f"{parent}.{SHARD_GROUP[proj]}" if proj in SHARD_GROUP else layer


def by_group(errors: list[dict], key: str) -> dict[str, float]:
    """Fused group → the sum of its members' ``key``. A sum, not a max: the Fisher estimate is additive
    over independent perturbations, and a group is kept in float (or given one input range) as a whole,
    so what it gains is all its members' effects together; a max would rank a group with one bad
    member as high as one with three."""
    totals: dict[str, float] = {}
    for e in errors:
        g = fused_group(e["layer"])
        totals[g] = totals.get(g, 0.0) + e.get(key, e["rel_error"])
    return totals


def group_ranking(errors: list[dict]) -> list[list[str]]:
    """Fused groups (their member layers), most sensitive first: by the estimated effect on the loss
    where measured, else by the output error. vllm-ascend and vLLM refuse a fused layer whose shards
    are not all of one scheme, so the float fallback keeps whole groups."""
    score = by_group(errors, "sensitivity")
    members: dict[str, list[str]] = {}
    for e in errors:
        members.setdefault(fused_group(e["layer"]), []).append(e["layer"])
    return [members[g] for g in sorted(members, key=lambda g: -score[g])]
