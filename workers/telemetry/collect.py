"""Telemetry collection, run by the node agent every TELEMETRY_INTERVAL_SECONDS."""
from django.utils import timezone

from workers.models import Device, Node


def collect_node(node: Node) -> None:
    """Device inventory from npu-smi on Ascend nodes."""
    if node.platform != "ascend":
        return
    from workers.npu_smi import collect

    data = collect(timeout=8.0)
    for chip in data.get("chips", []):
        index = chip.get("logic_id")
        if index is None:
            index = chip["npu"]
        memory_mb = chip.get("hbm_total_mb") or chip.get("memory_total_mb")
        Device.objects.update_or_create(node=node, index=index, defaults={
            "kind": "npu", "name": chip.get("name") or "", "health": chip.get("health") or "",
            "bus_id": chip.get("bus_id") or "", "latest": chip, "updated_at": timezone.now(),
            "memory_total_bytes": int(memory_mb * 1024 * 1024) if memory_mb else None,
        })
    errors = "; ".join(f"{e['command']}: {e['error']}" for e in data.get("errors", []))
    Node.objects.filter(pk=node.pk).update(telemetry_error=errors[:2000])
