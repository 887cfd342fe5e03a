"""What the registry asks of serving (registered in EndpointsConfig.ready(), see models_registry.hooks):
whether an artifact can be launched here, which endpoints use an artifact, how much memory the live
accelerators have free, and which engine versions serve a quantized format here."""

from django.db.models import Q

from endpoints.models import Endpoint
from endpoints.services import launch_refusal as artifact_refusal
from endpoints.services import platform_refusal
from workers.models import Device, Node


def artifact_users(artifact) -> list[str]:
    """Names of the endpoints that use the artifact and are not stopped."""
    return list(
        Endpoint.objects.filter(Q(artifact=artifact) | Q(adapters=artifact))
        .exclude(state=Endpoint.State.STOPPED)
        .distinct()
        .values_list("name", flat=True)
    )


def live_device_memory() -> list[tuple[str, int]]:
    """The most free memory on each registered node's accelerators, as telemetry last saw it."""
    best: dict[str, int] = {}
    for device in Device.objects.select_related("node").exclude(memory_total_bytes__isnull=True):
        used_mb = (device.latest or {}).get("hbm_used_mb") or (device.latest or {}).get("memory_used_mb")
        free = (
            device.memory_total_bytes - int(used_mb * 1024 * 1024) if used_mb is not None else device.memory_total_bytes
        )
        label = f"{device.node.name}: {device.name or device.kind} (free now)"
        best[label] = max(best.get(label, 0), free)
    return [(label, free) for label, free in sorted(best.items()) if free > 0]


def target_engine_versions(target: str) -> list[str]:
    """The vllm-ascend versions the Ascend nodes' agents reported (Node.engine), for ModelSlim checkpoints."""
    if target != "ascend-modelslim":
        return []
    return [v for v in Node.objects.filter(platform="ascend").values_list("engine__vllm_ascend", flat=True) if v]


def launch_refusal(artifact) -> str:
    """Why no endpoint can be launched from the artifact on this site's nodes (one line), or ""."""
    if refusal := artifact_refusal(artifact):
        return refusal
    platforms = set(Node.objects.values_list("platform", flat=True))
    if not platforms:
        return "No node is registered: start a node agent first."
    refusals = [platform_refusal(artifact, p) for p in sorted(platforms)]
    if all(refusals):
        have = ", ".join(dict(Node.Platform.choices)[p] for p in sorted(platforms))
        return f"{refusals[0]} This site has {have} nodes only."
    return ""
