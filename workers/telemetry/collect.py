"""Telemetry collection, run by the node agent every TELEMETRY_INTERVAL_SECONDS (in a thread of
its own, so a slow sample never holds up reconciliation).

One pass: accelerators (npu-smi on Ascend, NVML for NVIDIA GPUs) and host (psutil) in worker
threads, while the registered collectors (the endpoints app: its replicas' process trees and
vLLM ``/metrics``) run in the calling thread -- each slow part with a timeout (a hung npu-smi
costs at most TELEMETRY_NPU_SMI_TIMEOUT_SECONDS and is reported on the node). The worker
threads do I/O only; every database write happens in the calling thread."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from django.conf import settings
from django.utils import timezone

from workers.host_stats import sample_host
from workers.models import Device, Node
from workers.npu_smi import collect
from workers.telemetry import nvml
from workers.telemetry.services import Reading, store
from workers.telemetry.sources import registered_collectors

log = logging.getLogger("console.telemetry")

HEALTH_CODES = {"OK": 0, "WARNING": 1, "ALARM": 2, "CRITICAL": 3, "MISSING": 4}
HEALTH_NAMES = {0: "OK", 1: "Warning", 2: "Alarm", 3: "Critical", 4: "Missing"}

_lock = threading.Lock()
_net_seen: dict[int, tuple[float, int, int]] = {}  # node id -> (monotonic, bytes sent, bytes received)


def health_code(health: str | None) -> int | None:
    """OK 0, Warning 1, Alarm 2, Critical 3, Missing 4 (gone from npu-smi); anything else npu-smi
    prints (an error code) counts as Alarm."""
    if not health:
        return None
    return HEALTH_CODES.get(health.strip().upper(), 2)


def npu_utilization(chip: dict):
    """AI-core utilisation of one npu-smi chip: the table's AICore(%), else `-t usages`' Aicore Usage Rate(%)."""
    util = chip.get("aicore_pct")
    return (chip.get("usage") or {}).get("aicore_usage_rate_pct") if util is None else util


def _pct(used, total):
    return round(100.0 * used / total, 2) if used is not None and total else None


# --- accelerators --------------------------------------------------------------------------


def sample_devices(platform: str) -> dict:
    """{"kind": "npu"|"gpu"|None, "devices": [normalised dicts], "processes": [...], "errors": [str],
    "complete": bool}. `complete` says the device list is the tool's whole answer, so a device known
    before and absent now has disappeared. Never raises for a missing, hung or broken tool."""
    if platform == Node.Platform.ASCEND:
        data = collect(timeout=settings.TELEMETRY_NPU_SMI_TIMEOUT_SECONDS)
        index_of = {}
        devices = []
        for chip in data.get("chips", []):
            index = chip.get("logic_id")
            if index is None:
                index = chip["npu"]
            index_of[(chip.get("npu"), chip.get("chip"))] = index
            usage = chip.get("usage") or {}
            total = chip.get("hbm_total_mb") or chip.get("memory_total_mb") or usage.get("hbm_capacity_mb")
            used = chip.get("hbm_used_mb") if chip.get("hbm_total_mb") else chip.get("memory_used_mb")
            util = npu_utilization(chip)
            devices.append(
                {
                    "index": index,
                    "kind": "npu",
                    "name": chip.get("name") or "",
                    "health": chip.get("health") or "",
                    "util_pct": util,
                    "mem_used_mb": used,
                    "mem_total_mb": total,
                    "temp_c": chip.get("temp_c"),
                    "power_w": chip.get("power_w"),
                    "bus_id": chip.get("bus_id") or "",
                    "raw": chip,
                }
            )
        processes = []
        for proc in data.get("processes", []):
            index = index_of.get((proc.get("npu"), proc.get("chip")), proc.get("npu"))
            processes.append(
                {
                    "device": index,
                    "pid": proc.get("pid"),
                    "name": proc.get("name") or "",
                    "memory_mb": proc.get("memory_mb"),
                }
            )
        errors = [f"{e['command']}: {e['error']}" for e in data.get("errors", [])]
        # Without `-m` the indexes fall back to NPU ids, which differ from logic ids on duo cards.
        complete = not any(e["command"] in ("npu-smi info", "npu-smi info -m") for e in data.get("errors", []))
        return {"kind": "npu", "devices": devices, "processes": processes, "errors": errors, "complete": complete}

    try:
        gpus = nvml.sample_gpus()
    except Exception as exc:  # a broken driver must not stop the rest of the sample
        return {
            "kind": "gpu",
            "devices": [],
            "processes": [],
            "errors": [f"NVML: {type(exc).__name__}: {exc}"],
            "complete": False,
        }
    if gpus is None:
        errors = (
            ["NVML unavailable (no NVIDIA driver library or nvidia-ml-py)"] if platform == Node.Platform.CUDA else []
        )
        return {"kind": None, "devices": [], "processes": [], "errors": errors, "complete": False}
    devices, processes = [], []
    for gpu in gpus:
        devices.append(
            {
                "index": gpu["index"],
                "kind": "gpu",
                "name": gpu["name"] or "",
                "health": gpu["health"],
                "util_pct": gpu["aicore_pct"],
                "mem_used_mb": gpu["memory_used_mb"],
                "mem_total_mb": gpu["memory_total_mb"],
                "temp_c": gpu["temp_c"],
                "power_w": gpu["power_w"],
                "bus_id": gpu["bus_id"] or "",
                "raw": {k: v for k, v in gpu.items() if k != "processes"},
            }
        )
        processes.extend(
            {"device": gpu["index"], "pid": p["pid"], "name": "", "memory_mb": p["memory_mb"]} for p in gpu["processes"]
        )
    return {"kind": "gpu", "devices": devices, "processes": processes, "errors": [], "complete": True}


def _mark_missing(node: Node, *, kind: str, seen: set[int], now) -> list[Reading]:
    """A device the tool listed before and not now has disappeared (a dead chip drops out of
    npu-smi): record it as Missing, so serving stops using it and the health alert fires."""
    gone = list(Device.objects.filter(node=node, kind=kind).exclude(index__in=seen).values_list("index", flat=True))
    if not gone:
        return []
    Device.objects.filter(node=node, kind=kind, index__in=gone).update(health=Device.HEALTH_MISSING, updated_at=now)
    return [
        Reading(
            f"n{node.pk}.d{i}.dev.health",
            "dev.health",
            HEALTH_CODES["MISSING"],
            "",
            node_id=node.pk,
            device=i,
            label=f"{kind.upper()} {i}",
        )
        for i in gone
    ]


# --- one pass ------------------------------------------------------------------------------


def collect_node(node: Node) -> dict:
    """Sample everything of this node once and store it. Returns a summary (points written,
    devices seen, errors, seconds taken)."""
    started = time.monotonic()
    ts = time.time()
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="telemetry") as pool:
        devices_f = pool.submit(sample_devices, node.platform)
        host_f = pool.submit(sample_host, ("/", str(settings.DATA_DIR)))
        contributions = [collector(node) for collector in registered_collectors()]
        host = host_f.result()
        dev = devices_f.result()

    readings: list[Reading] = []
    errors: list[str] = list(dev["errors"])
    nid = node.pk

    # Host.
    now_mono = time.monotonic()
    net = host["net"]
    with _lock:
        prev_net = _net_seen.get(nid)
        _net_seen[nid] = (now_mono, net["bytes_sent"], net["bytes_recv"])
    rx = tx = None
    if prev_net and now_mono > prev_net[0]:
        dt = now_mono - prev_net[0]
        tx = max(net["bytes_sent"] - prev_net[1], 0) / dt
        rx = max(net["bytes_recv"] - prev_net[2], 0) / dt
    data_disk = host["disks"].get(str(settings.DATA_DIR)) or host["disks"].get("/") or {}
    host_values = [
        ("host.cpu_pct", "%", host["cpu_pct"]),
        ("host.mem_pct", "%", host["memory"]["pct"]),
        ("host.mem_used_bytes", "B", host["memory"]["used"]),
        ("host.load1", "", host["load_avg"][0]),
        ("host.disk_pct", "%", data_disk.get("pct")),
        ("host.net_rx_Bps", "B/s", rx),
        ("host.net_tx_Bps", "B/s", tx),
    ]
    utils = [d["util_pct"] for d in dev["devices"] if d["util_pct"] is not None]
    if utils:
        host_values.append(("host.dev_util_avg", "%", round(sum(utils) / len(utils), 2)))
    for metric, unit, value in host_values:
        readings.append(Reading(f"n{nid}.{metric}", metric, value, unit, node_id=nid, label=node.name))

    # Processes of registered workloads: pid -> what it serves, for the device map.
    owner: dict[int, dict] = {}
    for part in contributions:
        owner.update(part.owners)

    # Accelerators.
    by_device: dict[int, list[dict]] = {}
    for proc in dev["processes"]:
        serves = owner.get(proc["pid"]) or {}
        by_device.setdefault(proc["device"], []).append(
            {
                **proc,
                "endpoint_id": serves.get("endpoint_id"),
                "endpoint": serves.get("endpoint"),
                "replica": serves.get("replica"),
            }
        )
    now = timezone.now()
    for d in dev["devices"]:
        i = d["index"]
        mem_pct = _pct(d["mem_used_mb"], d["mem_total_mb"])
        code = health_code(d["health"])
        latest = {**d["raw"], "processes": by_device.get(i, []), "mem_pct": mem_pct, "ts": int(ts)}
        Device.objects.update_or_create(
            node=node,
            index=i,
            defaults={
                "kind": d["kind"],
                "name": d["name"],
                "health": d["health"],
                "bus_id": d["bus_id"],
                "latest": latest,
                "updated_at": now,
                "memory_total_bytes": int(d["mem_total_mb"] * 1024 * 1024) if d["mem_total_mb"] else None,
            },
        )
        label = f"{d['kind'].upper()} {i}"
        for metric, unit, value in (
            ("dev.util_pct", "%", d["util_pct"]),
            ("dev.mem_used_mb", "MB", d["mem_used_mb"]),
            ("dev.mem_pct", "%", mem_pct),
            ("dev.temp_c", "°C", d["temp_c"]),
            ("dev.power_w", "W", d["power_w"]),
            ("dev.health", "", code),
        ):
            readings.append(Reading(f"n{nid}.d{i}.{metric}", metric, value, unit, node_id=nid, device=i, label=label))

    if dev.get("complete") and dev["kind"]:
        readings += _mark_missing(node, kind=dev["kind"], seen={d["index"] for d in dev["devices"]}, now=now)

    for part in contributions:
        readings += part.readings
        errors += part.errors

    written = store(readings, ts)
    latest_host = {
        "ts": int(ts),
        "cpu_pct": host["cpu_pct"],
        "mem_pct": host["memory"]["pct"],
        "mem_used_bytes": host["memory"]["used"],
        "mem_total_bytes": host["memory"]["total"],
        "load_avg": host["load_avg"],
        "disk_pct": data_disk.get("pct"),
        "net_rx_Bps": rx,
        "net_tx_Bps": tx,
    }
    Node.objects.filter(pk=nid).update(
        host={**(node.host or {}), "latest": latest_host}, telemetry_error="; ".join(errors)[:2000]
    )
    return {
        "points": written,
        "devices": len(dev["devices"]),
        "errors": errors,
        "seconds": round(time.monotonic() - started, 3),
    }
