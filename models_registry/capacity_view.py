"""The capacity table shown on an artifact page and by the API: one estimate per device type."""

import psutil
from django.conf import settings

from models_registry import hooks
from models_registry.capacity import device_memory_bytes, dtype_bytes, estimate_capacity
from models_registry.inspection import kv_bytes_per_token

# The Ascend parts seen in the npu-smi fixtures, in the order ops staff think of them.
ASCEND_PARTS = ("910B4", "910B3", "910ProB", "A3", "950DT", "310P3")


def reference_devices() -> list[tuple[str, int]]:
    """The reference parts and this host, with their whole memory."""
    rows = [(f"Ascend {part}", device_memory_bytes(part)) for part in ASCEND_PARTS]
    rows.append(("This host's memory (CPU)", psutil.virtual_memory().total))
    return rows


def artifact_capacity(
    artifact, *, memory_utilization: float | None = None, devices: list[tuple[str, int]] | None = None
) -> dict:
    """The estimate per device: ``devices`` (label, memory bytes), by default the reference parts and
    the live devices serving registered (the most free memory on each node's accelerators)."""
    if devices is None:
        devices = reference_devices() + hooks.live_device_memory()
    inspection = artifact.inspection or {}
    util = memory_utilization if memory_utilization and 0 < memory_utilization <= 1 else settings.GPU_MEMORY_UTILIZATION
    weight_bytes = inspection.get("weight_bytes") or artifact.size_bytes
    kv_dtype = inspection.get("dtype") if dtype_bytes(inspection.get("dtype")) in (2, 4) else "bfloat16"
    try:
        kv_per_token = kv_bytes_per_token(inspection, dtype_bytes(kv_dtype))
    except (TypeError, ValueError, KeyError):
        kv_per_token = None
    if not weight_bytes or not kv_per_token:
        return {"error": "No estimate: the inspection lacks layer, KV-head or size figures for this artifact."}
    rows, estimate = [], None
    for name, memory in devices:
        estimate = estimate_capacity(
            weight_bytes=weight_bytes,
            kv_bytes_per_token=kv_per_token,
            device_memory_bytes=memory,
            memory_utilization=util,
            max_position_embeddings=inspection.get("max_position_embeddings"),
            param_count=inspection.get("param_count"),
        )
        rows.append(
            {
                "device": name,
                **{
                    k: estimate[k]
                    for k in (
                        "device_memory_bytes",
                        "fits",
                        "max_model_len",
                        "max_num_seqs",
                        "recommended_max_num_seqs",
                        "summary",
                    )
                },
            }
        )
    return {
        "weight_bytes": weight_bytes,
        "kv_bytes_per_token": kv_per_token,
        "kv_dtype": kv_dtype,
        "memory_utilization": util,
        "context_len": estimate["context_len"] if estimate else None,
        "rows": rows,
    }
