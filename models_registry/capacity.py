"""Will a model fit, and how many sequences: a back-of-the-envelope KV-cache budget (pure functions).

The model of memory (the one vLLM / vllm-ascend use, simplified)::

    usable        = device_memory x num_devices x memory_utilization      (gpu_memory_utilization)
    overhead      = activation_overhead_bytes, by default
                    1 GiB per device (runtime workspace, graph capture, HCCL/NCCL buffers)
                    + 5 % of the weight bytes (peak activations, which grow with the model)
    kv_budget     = usable - weight_bytes - overhead
    kv_tokens     = floor(kv_budget / (kv_bytes_per_token x block_size)) x block_size
                    (the cache is allocated in blocks; 128 tokens per block on Ascend)
    max_model_len = min(kv_tokens, max_position_embeddings)   -- one full sequence must fit
    max_num_seqs  = floor(kv_tokens / context_len)           -- sequences of context_len at once
                    context_len defaults to min(8192, max_position_embeddings)

With several devices (tensor parallel) memory and weights are summed; the KV cache per token is
the same total, split across devices (replication of KV heads when tp > num_kv_heads is ignored).

``recommended_max_num_seqs`` follows the deployment guide's rule of thumb: a 7B model on one 910B
should keep the batch at 16 or below.  Generalised as a *per-device* cap that shrinks with model size:

    batch_cap = 16 x num_devices x clamp(7e9 / param_count, 1, 16), at most 256 (vLLM's default)

so any model of >= 7B parameters gets 16 per device, a 3.5B model 32 per device, a 1B model
112 per device (all capped at 256 in total).  The recommendation is ``min(batch_cap, max_num_seqs)``
(never more sequences than fit at ``context_len``), or None when nothing fits.

Device memory: :data:`ASCEND_DEVICE_MEMORY_GIB` holds nominal HBM per chip for the npu-smi names we
have seen (npu-smi reports MB, e.g. 910B4 shows 32768 MB = 32 GiB, so table values are GiB).
NVIDIA GPUs and CPU hosts are sized by what they report: pass it to :func:`device_memory_bytes`
as ``reported_bytes`` or straight to :func:`estimate_capacity`.

Mixture-of-Experts and MLA models, quantized weights and TP / DP / expert-parallel layouts are sized per
device from the HF config by :mod:`models_registry.capacity_moe` (``deployment_capacity``).
"""

from __future__ import annotations

import re

__all__ = [
    "GiB",
    "ASCEND_DEVICE_MEMORY_GIB",
    "DTYPE_BYTES",
    "DEFAULT_RESERVE_PER_DEVICE_BYTES",
    "DEFAULT_OVERHEAD_FRACTION",
    "BATCH_CAP_PER_DEVICE",
    "device_memory_bytes",
    "dtype_bytes",
    "default_overhead_bytes",
    "recommended_batch_cap",
    "estimate_capacity",
]

GiB = 1024**3
MiB = 1024**2

# Nominal HBM per chip, in GiB, by npu-smi chip name (upper case, without "Ascend").
ASCEND_DEVICE_MEMORY_GIB = {
    "910PROB": 32,
    "910PROA": 32,
    "910A": 32,
    "910B": 32,  # the older 910 as some npu-smi versions name it (HBM 32768 MB in our fixture)
    "910B1": 64,
    "910B2": 64,
    "910B2C": 64,
    "910B3": 64,
    "910B4": 32,
    "A3": 64,  # Atlas A3 (910C), per chip (die); npu-smi names them 910_93xx
    "950DT": 96,
    "310P3": 21,  # DDR, not HBM: npu-smi shows 21525 MB
}

# Bytes per element for weight / KV-cache dtypes.
DTYPE_BYTES = {
    "float32": 4,
    "fp32": 4,
    "f32": 4,
    "bfloat16": 2,
    "bf16": 2,
    "float16": 2,
    "fp16": 2,
    "f16": 2,
    "half": 2,
    "int8": 1,
    "fp8": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "q8_0": 1.0625,
}

DEFAULT_RESERVE_PER_DEVICE_BYTES = 1 * GiB
DEFAULT_OVERHEAD_FRACTION = 0.05
BATCH_CAP_PER_DEVICE = 16
BATCH_CAP_REFERENCE_PARAMS = 7e9
BATCH_CAP_MAX = 256
DEFAULT_CONTEXT_LEN = 8192
DEFAULT_BLOCK_SIZE = 128


def _normalise_chip(name: str) -> str:
    n = re.sub(r"\s+", "", str(name)).upper()
    n = n.removeprefix("HUAWEI").removeprefix("ASCEND")
    return n.removeprefix("-").removeprefix("_")


def device_memory_bytes(name: str | None, reported_bytes: int | None = None) -> int | None:
    """Memory of one device, in bytes.

    ``name`` is the chip name as npu-smi prints it, case-insensitive, with or without "Ascend"
    ("910B4", "Ascend910B4", "Ascend 910B4", "910_9391" for A3).  Known Ascend chips come from
    :data:`ASCEND_DEVICE_MEMORY_GIB`; anything else (an NVIDIA GPU, a CPU host, an unknown chip)
    gets ``reported_bytes`` -- what the device itself reports -- or None.
    """
    if name:
        key = _normalise_chip(name)
        if key in ASCEND_DEVICE_MEMORY_GIB:
            return ASCEND_DEVICE_MEMORY_GIB[key] * GiB
        if key.startswith(("910_93", "910C")):  # A3 chips
            return ASCEND_DEVICE_MEMORY_GIB["A3"] * GiB
    return int(reported_bytes) if reported_bytes else None


def dtype_bytes(dtype: str | None) -> float | None:
    """Bytes per element of a dtype name ("bfloat16", "fp16", "int8", "fp8"...), or None if unknown."""
    if not dtype:
        return None
    return DTYPE_BYTES.get(str(dtype).lower().removeprefix("torch."))


def default_overhead_bytes(weight_bytes: int, num_devices: int = 1) -> int:
    """The default activation/runtime reserve: 1 GiB per device + 5 % of the weights."""
    return int(DEFAULT_RESERVE_PER_DEVICE_BYTES * num_devices + DEFAULT_OVERHEAD_FRACTION * weight_bytes)


def recommended_batch_cap(param_count: int | float | None, num_devices: int = 1) -> int:
    """The rule-of-thumb batch cap: 16 per device at >= 7B params, more for smaller models, <= 256."""
    scale = 1.0
    if param_count and param_count > 0:
        scale = min(max(BATCH_CAP_REFERENCE_PARAMS / float(param_count), 1.0), 16.0)
    return int(min(BATCH_CAP_PER_DEVICE * num_devices * scale, BATCH_CAP_MAX))


def _fmt_gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


def estimate_capacity(
    *,
    weight_bytes: int,
    kv_bytes_per_token: int,
    device_memory_bytes: int,
    num_devices: int = 1,
    memory_utilization: float = 0.9,
    max_position_embeddings: int | None,
    activation_overhead_bytes: int | None = None,
    context_len: int | None = None,
    param_count: int | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> dict:
    """Estimate whether a model fits and how large a KV cache is left (formula: module docstring).

    ``device_memory_bytes`` is per device; ``num_devices`` is the tensor-parallel size.
    ``activation_overhead_bytes`` (total over all devices) defaults to
    :func:`default_overhead_bytes` (1 GiB per device + 5 % of weights).  ``context_len`` defaults to
    ``min(8192, max_position_embeddings)``.  ``param_count`` feeds the batch cap; when None it is
    guessed as ``weight_bytes / 2`` (16-bit weights).  ``max_position_embeddings`` may be None
    (no cap).

    Returns a dict with: ``fits`` (weights + overhead fit *and* at least one sequence of
    ``context_len`` tokens fits), ``weight_bytes``, ``kv_bytes_per_token``, ``device_memory_bytes``,
    ``num_devices``, ``memory_utilization``, ``total_bytes``, ``usable_bytes``, ``overhead_bytes``,
    ``kv_budget_bytes`` (may be negative: the shortfall), ``kv_tokens``, ``block_size``,
    ``max_model_len`` (0 if not even one block fits), ``context_len``, ``max_num_seqs``,
    ``batch_cap``, ``recommended_max_num_seqs`` (None unless it fits) and a human ``summary``.
    """
    if weight_bytes is None or weight_bytes < 0:
        raise ValueError("weight_bytes must be a non-negative number of bytes")
    if not kv_bytes_per_token or kv_bytes_per_token <= 0:
        raise ValueError("kv_bytes_per_token must be positive")
    if not device_memory_bytes or device_memory_bytes <= 0:
        raise ValueError("device_memory_bytes must be positive")
    if num_devices < 1:
        raise ValueError("num_devices must be at least 1")
    if not 0 < memory_utilization <= 1:
        raise ValueError("memory_utilization must be in (0, 1]")
    if block_size < 1:
        raise ValueError("block_size must be at least 1")

    weight_bytes = int(weight_bytes)
    kv_bytes_per_token = int(kv_bytes_per_token)
    total = int(device_memory_bytes) * num_devices
    usable = int(total * memory_utilization)
    overhead = (
        int(activation_overhead_bytes)
        if activation_overhead_bytes is not None
        else default_overhead_bytes(weight_bytes, num_devices)
    )
    kv_budget = usable - weight_bytes - overhead

    if context_len is None:
        context_len = (
            min(DEFAULT_CONTEXT_LEN, max_position_embeddings) if max_position_embeddings else DEFAULT_CONTEXT_LEN
        )
    if context_len < 1:
        raise ValueError("context_len must be at least 1")

    if kv_budget > 0:
        kv_tokens = kv_budget // (kv_bytes_per_token * block_size) * block_size
    else:
        kv_tokens = 0
    max_model_len = min(kv_tokens, max_position_embeddings) if max_position_embeddings else kv_tokens
    max_num_seqs = kv_tokens // context_len
    fits = kv_budget > 0 and max_num_seqs >= 1

    if param_count is None:
        param_count = weight_bytes / 2
    batch_cap = recommended_batch_cap(param_count, num_devices)
    recommended = min(batch_cap, max_num_seqs) if fits else None

    where = f"{num_devices} x {_fmt_gib(device_memory_bytes)} at {memory_utilization:.0%}"
    if kv_budget <= 0:
        summary = (
            f"Does not fit: {_fmt_gib(weight_bytes)} of weights + {_fmt_gib(overhead)} overhead need "
            f"{_fmt_gib(weight_bytes + overhead)}, more than the {_fmt_gib(usable)} usable on {where}."
        )
    elif not fits:
        summary = (
            f"Does not fit at {context_len} tokens: {_fmt_gib(weight_bytes)} of weights + {_fmt_gib(overhead)} "
            f"overhead leave {_fmt_gib(kv_budget)} on {where}, room for {kv_tokens} tokens of KV cache "
            f"({kv_bytes_per_token / MiB:.2f} MiB/token); max_model_len would be {max_model_len}."
        )
    else:
        summary = (
            f"Fits: {_fmt_gib(weight_bytes)} of weights + {_fmt_gib(overhead)} overhead leave "
            f"{_fmt_gib(kv_budget)} of KV cache on {where} = {kv_tokens} tokens "
            f"({kv_bytes_per_token / MiB:.2f} MiB/token): max_model_len {max_model_len}, "
            f"{max_num_seqs} sequence(s) of {context_len} tokens; recommended max_num_seqs {recommended}."
        )

    return {
        "fits": fits,
        "weight_bytes": weight_bytes,
        "kv_bytes_per_token": kv_bytes_per_token,
        "device_memory_bytes": int(device_memory_bytes),
        "num_devices": num_devices,
        "memory_utilization": memory_utilization,
        "total_bytes": total,
        "usable_bytes": usable,
        "overhead_bytes": overhead,
        "kv_budget_bytes": kv_budget,
        "kv_tokens": kv_tokens,
        "block_size": block_size,
        "max_model_len": max_model_len,
        "context_len": context_len,
        "max_num_seqs": max_num_seqs,
        "batch_cap": batch_cap,
        "recommended_max_num_seqs": recommended,
        "summary": summary,
    }
