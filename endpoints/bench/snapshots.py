"""What a benchmark records beside its numbers: the endpoint's configuration and devices, and the
node's telemetry before, during and after the run."""

import logging

from django.conf import settings
from django.utils import timezone

from endpoints.bench.models import BenchmarkRun
from endpoints.bench.workload import VIA_GATEWAY, VIA_REPLICA
from endpoints.models import Endpoint, Replica
from workers.models import Device, Node
from workers.telemetry.models import Point, Series

log = logging.getLogger("console.job")
TELEMETRY_SAMPLES_MAX = 360


def device_info(endpoint: Endpoint, replica: Replica, *, all_replicas: bool = False) -> dict:
    """The devices a run loaded: the replica's, or every replica's (through the gateway)."""
    node = replica.node
    if all_replicas:
        replicas = list(endpoint.replica_set.all())
        indices = sorted({d for r in replicas for d in r.devices})
        replica_count = len(replicas)
    else:
        indices, replica_count = list(replica.devices), 1
    if node.platform == "cpu" or not indices:
        # A CPU replica is one host process: priced as one "cpu" device per replica.
        return {"device_type": "cpu", "device_kind": "cpu", "device_count": replica_count, "devices": []}
    devices = list(node.devices.filter(index__in=indices).order_by("index"))
    names = sorted({d.name for d in devices if d.name})
    kinds = sorted({d.kind for d in devices if d.kind}) or ["npu" if node.platform == "ascend" else "gpu"]
    return {
        "device_type": names[0] if len(names) == 1 else (kinds[0] if len(kinds) == 1 else node.platform),
        "device_kind": kinds[0] if len(kinds) == 1 else node.platform,
        "device_count": len(indices),
        "devices": [
            {"index": d.index, "kind": d.kind, "name": d.name, "memory_total_bytes": d.memory_total_bytes}
            for d in devices
        ]
        or [{"index": i} for i in indices],
    }


def quantization_of(endpoint: Endpoint) -> str:
    if endpoint.quantization:
        return endpoint.quantization
    artifact = endpoint.artifact
    method = (artifact.params or {}).get("method") or (artifact.params or {}).get("scheme")
    if artifact.format in ("compressed-tensors", "ascend-modelslim") or method:
        return str(method or artifact.dtype or artifact.format)
    return "none"


def config_snapshot(
    endpoint: Endpoint, replica: Replica, run: BenchmarkRun | None = None, *, via_gateway: bool = False
) -> dict:
    """What was measured, as it was when the run started."""
    node = replica.node
    artifact = endpoint.artifact
    engine = dict(node.engine or {})
    dev = device_info(endpoint, replica, all_replicas=via_gateway)
    quant = quantization_of(endpoint)
    tp, pp = endpoint.tensor_parallel_size, endpoint.pipeline_parallel_size
    model_name = artifact.model.name if artifact.model_id else ""
    setup = (
        f"{model_name or endpoint.name} · {quant if quant != 'none' else (endpoint.dtype or artifact.dtype or 'auto')}"
        f" · TP{tp}{f' PP{pp}' if pp > 1 else ''} · {dev['device_count']}× {dev['device_type']}"
        f"{' · gateway' if via_gateway else ''}"
    )
    return {
        "setup": setup,
        "endpoint": {"id": endpoint.pk, "name": endpoint.name, "served_model_name": endpoint.served_model_name},
        "artifact": {
            "id": artifact.pk,
            "model": model_name,
            "format": artifact.format,
            "dtype": artifact.dtype,
            "path": artifact.path,
            "sha256": artifact.sha256,
            "parent": artifact.parent_id,
        },
        "quantization": quant,
        "dtype": endpoint.dtype or "auto",
        **dev,
        "platform": node.platform,
        "tensor_parallel_size": tp,
        "pipeline_parallel_size": pp,
        "replicas": endpoint.replicas,
        "target": VIA_GATEWAY if via_gateway else VIA_REPLICA,
        "replica": None if via_gateway else replica.index,
        "max_num_seqs": endpoint.max_num_seqs,
        "max_model_len": endpoint.max_model_len,
        "enforce_eager": endpoint.enforce_eager,
        "extra_args": endpoint.extra_args,
        "node": node.name,
        "url": settings.GATEWAY_URL if via_gateway else replica.url,
        "engine": engine,
        "vllm_version": engine.get("vllm"),
        "engine_versions": {
            k: v
            for k, v in engine.items()
            if k in ("vllm", "vllm_ascend", "torch", "torch_npu", "cann", "transformers", "python")
        },
        "replica_argv": replica.argv,
    }


def telemetry_snapshot(
    node, replica: Replica | None = None, *, endpoint: Endpoint | None = None, brief: bool = False
) -> dict:
    """The node's device readings as the agent last stored them (Device.latest), and its host
    readings (Node.host). Read from the database: the worker may run on another host."""
    fresh = Node.objects.filter(pk=node.pk).values("host", "last_heartbeat", "telemetry_error").first() or {}
    devices = Device.objects.filter(node_id=node.pk)
    if replica is not None:
        devices = devices.filter(index__in=replica.devices)
    elif endpoint is not None:
        devices = devices.filter(index__in=endpoint.devices)
    snap = {
        "at": timezone.now().isoformat(),
        "devices": [
            {
                "index": d.index,
                "kind": d.kind,
                "name": d.name,
                "health": d.health,
                "updated_at": d.updated_at.isoformat() if d.updated_at else None,
                "latest": _brief(d.latest) if brief else d.latest,
            }
            for d in devices.order_by("index")
        ],
        "host": _brief(fresh.get("host") or {}) if brief else (fresh.get("host") or {}),
    }
    if not brief and fresh.get("telemetry_error"):
        snap["telemetry_error"] = fresh["telemetry_error"]
    return snap


def telemetry_window(endpoint: Endpoint, replica: Replica | None, start, end, *, limit: int = 20_000) -> dict:
    """The telemetry series of the replica's devices (every replica's: None), its node's host and
    the endpoint, between start and end (workers.telemetry: Series and Point, Unix seconds)."""
    try:
        from django.db.models import Q

    except ImportError:
        return {}
    try:
        devices = replica.devices if replica is not None else endpoint.devices
        node_id = replica.node_id if replica is not None else endpoint.node_id
        node_q = Q(node_id=node_id, endpoint_id__isnull=True) & (Q(device__isnull=True) | Q(device__in=devices))
        endpoint_q = Q(endpoint_id=endpoint.pk)
        if replica is not None:
            endpoint_q &= Q(replica__isnull=True) | Q(replica=replica.index)
        series = {s.pk: s for s in Series.objects.filter(node_q | endpoint_q)[:300]}
        if not series:
            return {}
        points: dict[int, list] = {pk: [] for pk in series}
        rows = (
            Point.objects.filter(
                series_id__in=list(series), ts__gte=int(start.timestamp()) - 1, ts__lte=int(end.timestamp()) + 1
            )
            .order_by("ts")
            .values_list("series_id", "ts", "value")[:limit]
        )
        for series_id, ts, value in rows:
            points[series_id].append([ts, value])
        return {
            "series": [
                {
                    "key": s.key,
                    "metric": s.metric,
                    "unit": s.unit,
                    "device": s.device,
                    "replica": s.replica,
                    "label": s.label,
                    "points": points[pk],
                }
                for pk, s in series.items()
                if points[pk]
            ]
        }
    except Exception as exc:  # telemetry must not fail a finished benchmark
        log.warning("telemetry series for the run not read: %s", exc)
        return {"series_error": str(exc)[:300]}


def telemetry_summary(telemetry: dict) -> list[dict]:
    """min / mean / max of each telemetry series during a run (for the run page)."""
    rows = []
    for s in (telemetry or {}).get("series") or []:
        values = [p[1] for p in s.get("points") or [] if isinstance(p[1], (int, float))]
        if values:
            rows.append(
                {
                    "metric": s.get("metric"),
                    "label": s.get("label") or s.get("key"),
                    "unit": s.get("unit"),
                    "device": s.get("device"),
                    "min": min(values),
                    "mean": sum(values) / len(values),
                    "max": max(values),
                    "n": len(values),
                }
            )
    return sorted(rows, key=lambda r: (r["device"] is not None, r["device"] or 0, r["metric"] or ""))


def _brief(reading: dict) -> dict:
    """The numbers of a reading (utilisation, memory, power, temperature…), not its lists."""
    if not isinstance(reading, dict):
        return {}
    return {k: v for k, v in reading.items() if isinstance(v, (int, float, str)) and not isinstance(v, bool)}
