"""Telemetry collection, run by the node agent every TELEMETRY_INTERVAL_SECONDS (in a thread of
its own, so a slow sample never holds up reconciliation).

One pass: accelerators (npu-smi on Ascend, NVML for NVIDIA GPUs), host (psutil), the process
tree of each replica on this node, and each ready replica's vLLM ``/metrics`` -- the slow
parts concurrently, each with a timeout (a hung npu-smi costs at most
TELEMETRY_NPU_SMI_TIMEOUT_SECONDS and is reported on the node). The worker threads do I/O
only; every database write happens in the calling thread. The previous /metrics snapshot of
each replica is kept in this process to turn counters and histograms into per-window rates
and percentiles."""
from __future__ import annotations

import logging
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from django.conf import settings
from django.utils import timezone

from endpoints.models import Endpoint, Replica
from endpoints.vllm_metrics import Snapshot, parse_metrics, window_stats
from workers.host_stats import sample_host, sample_process_tree
from workers.models import Device, Node
from workers.telemetry.services import Reading, store

log = logging.getLogger("console.telemetry")

HEALTH_CODES = {"OK": 0, "WARNING": 1, "ALARM": 2, "CRITICAL": 3}
HEALTH_NAMES = {0: "OK", 1: "Warning", 2: "Alarm", 3: "Critical"}
SCRAPED_STATES = (Endpoint.State.READY, Endpoint.State.DEGRADED)

_lock = threading.Lock()
_snapshots: dict[int, tuple[int | None, float, Snapshot]] = {}  # replica id -> (pid, monotonic, snapshot)
_health_seen: dict[int, int] = {}  # replica id -> health_failures at the previous pass
_net_seen: dict[int, tuple[float, int, int]] = {}  # node id -> (monotonic, bytes sent, bytes received)


def health_code(health: str | None) -> int | None:
    """OK 0, Warning 1, Alarm 2, Critical 3; anything else npu-smi prints counts as Alarm."""
    if not health:
        return None
    return HEALTH_CODES.get(health.strip().upper(), 2)


def _pct(used, total):
    return round(100.0 * used / total, 2) if used is not None and total else None


# --- accelerators --------------------------------------------------------------------------

def sample_devices(platform: str) -> dict:
    """{"kind": "npu"|"gpu"|None, "devices": [normalised dicts], "processes": [...], "errors": [str]}.
    Never raises for a missing, hung or broken tool."""
    if platform == Node.Platform.ASCEND:
        from workers.npu_smi import collect

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
            util = chip.get("aicore_pct")
            if util is None:
                util = usage.get("aicore_usage_rate_pct")
            devices.append({"index": index, "kind": "npu", "name": chip.get("name") or "", "health": chip.get("health") or "",
                            "util_pct": util, "mem_used_mb": used, "mem_total_mb": total, "temp_c": chip.get("temp_c"),
                            "power_w": chip.get("power_w"), "bus_id": chip.get("bus_id") or "", "raw": chip})
        processes = []
        for proc in data.get("processes", []):
            index = index_of.get((proc.get("npu"), proc.get("chip")), proc.get("npu"))
            processes.append({"device": index, "pid": proc.get("pid"), "name": proc.get("name") or "",
                              "memory_mb": proc.get("memory_mb")})
        errors = [f"{e['command']}: {e['error']}" for e in data.get("errors", [])]
        return {"kind": "npu", "devices": devices, "processes": processes, "errors": errors}

    from workers.telemetry import nvml

    try:
        gpus = nvml.sample_gpus()
    except Exception as exc:  # a broken driver must not stop the rest of the sample
        return {"kind": "gpu", "devices": [], "processes": [], "errors": [f"NVML: {type(exc).__name__}: {exc}"]}
    if gpus is None:
        errors = ["NVML unavailable (no NVIDIA driver library or nvidia-ml-py)"] if platform == Node.Platform.CUDA else []
        return {"kind": None, "devices": [], "processes": [], "errors": errors}
    devices, processes = [], []
    for gpu in gpus:
        devices.append({"index": gpu["index"], "kind": "gpu", "name": gpu["name"] or "", "health": gpu["health"],
                        "util_pct": gpu["aicore_pct"], "mem_used_mb": gpu["memory_used_mb"],
                        "mem_total_mb": gpu["memory_total_mb"], "temp_c": gpu["temp_c"], "power_w": gpu["power_w"],
                        "bus_id": gpu["bus_id"] or "", "raw": {k: v for k, v in gpu.items() if k != "processes"}})
        processes.extend({"device": gpu["index"], "pid": p["pid"], "name": "", "memory_mb": p["memory_mb"]}
                         for p in gpu["processes"])
    return {"kind": "gpu", "devices": devices, "processes": processes, "errors": []}


# --- vLLM /metrics -------------------------------------------------------------------------

def scrape(port: int, timeout: float) -> tuple[str | None, str | None]:
    """(text, None) or (None, error) for GET http://127.0.0.1:port/metrics."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as response:  # noqa: S310
            if response.status != 200:
                return None, f"/metrics answered {response.status}"
            return response.read().decode("utf-8", errors="replace"), None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return None, f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}"


def _parse(text: str, served_name: str) -> Snapshot:
    snap = parse_metrics(text, model_name=served_name)
    if snap.models and served_name not in snap.models:
        snap = parse_metrics(text)  # served under another name: take the whole server
    return snap


def endpoint_readings(replica: Replica, text: str | None, error: str | None, now_mono: float) -> list[tuple[str, str, float | None]]:
    """(metric, unit, value) for one replica's scrape; keeps its snapshot for the next window.
    A failed scrape and each failed health check since the previous pass count as errors."""
    out: list[tuple[str, str, float | None]] = []
    with _lock:
        seen = _health_seen.get(replica.pk)
        failures = replica.health_failures
        _health_seen[replica.pk] = failures
        health_errors = 0 if seen is None else (failures - seen if failures >= seen else failures)
        previous = _snapshots.get(replica.pk)
    snap = None
    if text is not None:
        try:
            snap = _parse(text, replica.endpoint.served_model_name)
        except ValueError as exc:
            error = f"unparsable /metrics: {exc}"
    out.append(("ep.scrape_ok", "", 0.0 if snap is None else 1.0))
    failed = (1 if snap is None else 0) + health_errors
    if snap is None:
        with _lock:
            _snapshots.pop(replica.pk, None)
        out += [("ep.errors", "", float(failed)), ("ep.error_rate", "ratio", 1.0)]
        return out
    with _lock:
        _snapshots[replica.pk] = (replica.pid, now_mono, snap)
    out += [("ep.running", "", snap.running), ("ep.waiting", "", snap.waiting),
            ("ep.kv_cache_pct", "%", None if snap.kv_cache_usage is None else round(snap.kv_cache_usage * 100, 3))]
    if previous is None or previous[0] != replica.pid or now_mono - previous[1] <= 0:
        return out  # the first scrape of this process: no window yet
    stats = window_stats(previous[2], snap, now_mono - previous[1])
    e2e, ttft, itl = stats.get("e2e_latency") or {}, stats.get("ttft") or {}, stats.get("itl") or {}
    requests = stats.get("requests") or 0
    errors = (stats.get("errors") or 0) + failed
    total = requests + failed
    out += [
        ("ep.qps", "req/s", stats.get("qps") if stats.get("qps") is not None else 0.0),
        ("ep.p50_s", "s", e2e.get("p50")), ("ep.p90_s", "s", e2e.get("p90")), ("ep.p99_s", "s", e2e.get("p99")),
        ("ep.ttft_p50_s", "s", ttft.get("p50")), ("ep.ttft_p99_s", "s", ttft.get("p99")),
        ("ep.itl_p50_s", "s", itl.get("p50")),
        ("ep.gen_tps", "tok/s", stats.get("generation_tokens_per_s")),
        ("ep.prompt_tps", "tok/s", stats.get("prompt_tokens_per_s")),
        ("ep.errors", "", float(errors)),
        ("ep.error_rate", "ratio", errors / total if total else 0.0),
    ]
    return out


# --- one pass ------------------------------------------------------------------------------

def collect_node(node: Node) -> dict:
    """Sample everything of this node once and store it. Returns a summary (points written,
    devices seen, errors, seconds taken)."""
    started = time.monotonic()
    ts = time.time()
    replicas = list(Replica.objects.filter(node=node).select_related("endpoint"))
    to_scrape = [r for r in replicas if r.state in SCRAPED_STATES and r.port]
    timeout = settings.TELEMETRY_SCRAPE_TIMEOUT_SECONDS
    with ThreadPoolExecutor(max_workers=2 + min(len(to_scrape), 8), thread_name_prefix="telemetry") as pool:
        devices_f = pool.submit(sample_devices, node.platform)
        host_f = pool.submit(sample_host, ("/", str(settings.DATA_DIR)))
        scrapes = {r.pk: pool.submit(scrape, r.port, timeout) for r in to_scrape}
        trees = {r.pk: sample_process_tree(r.pid) for r in replicas if r.pid}  # fast: /proc reads
        scraped = {pk: f.result() for pk, f in scrapes.items()}
        scraped_at = time.monotonic()
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
    host_values = [("host.cpu_pct", "%", host["cpu_pct"]), ("host.mem_pct", "%", host["memory"]["pct"]),
                   ("host.mem_used_bytes", "B", host["memory"]["used"]), ("host.load1", "", host["load_avg"][0]),
                   ("host.disk_pct", "%", data_disk.get("pct")), ("host.net_rx_Bps", "B/s", rx),
                   ("host.net_tx_Bps", "B/s", tx)]
    utils = [d["util_pct"] for d in dev["devices"] if d["util_pct"] is not None]
    if utils:
        host_values.append(("host.dev_util_avg", "%", round(sum(utils) / len(utils), 2)))
    for metric, unit, value in host_values:
        readings.append(Reading(f"n{nid}.{metric}", metric, value, unit, node_id=nid, label=node.name))

    # Replica processes: CPU and RSS of each vLLM process tree; pid -> replica for the device map.
    owner: dict[int, Replica] = {}
    for replica in replicas:
        tree = trees.get(replica.pk)
        if not tree:
            continue
        for proc in tree["processes"]:
            owner[proc["pid"]] = replica
        name = f"{replica.endpoint.name}#{replica.index}"
        base = dict(node_id=nid, endpoint_id=replica.endpoint_id, replica=replica.index, label=name)
        if tree["warm"]:
            readings.append(Reading(f"e{replica.endpoint_id}.r{replica.index}.proc.cpu_pct", "proc.cpu_pct",
                                    tree["cpu_pct"], "%", **base))
        readings.append(Reading(f"e{replica.endpoint_id}.r{replica.index}.proc.rss_bytes", "proc.rss_bytes",
                                tree["rss_bytes"], "B", **base))

    # Accelerators.
    by_device: dict[int, list[dict]] = {}
    for proc in dev["processes"]:
        replica = owner.get(proc["pid"])
        by_device.setdefault(proc["device"], []).append({
            **proc, "endpoint_id": replica.endpoint_id if replica else None,
            "endpoint": replica.endpoint.name if replica else None, "replica": replica.index if replica else None})
    now = timezone.now()
    for d in dev["devices"]:
        i = d["index"]
        mem_pct = _pct(d["mem_used_mb"], d["mem_total_mb"])
        code = health_code(d["health"])
        latest = {**d["raw"], "processes": by_device.get(i, []), "mem_pct": mem_pct, "ts": int(ts)}
        Device.objects.update_or_create(node=node, index=i, defaults={
            "kind": d["kind"], "name": d["name"], "health": d["health"], "bus_id": d["bus_id"], "latest": latest,
            "updated_at": now,
            "memory_total_bytes": int(d["mem_total_mb"] * 1024 * 1024) if d["mem_total_mb"] else None,
        })
        label = f"{d['kind'].upper()} {i}"
        for metric, unit, value in (("dev.util_pct", "%", d["util_pct"]), ("dev.mem_used_mb", "MB", d["mem_used_mb"]),
                                    ("dev.mem_pct", "%", mem_pct), ("dev.temp_c", "°C", d["temp_c"]),
                                    ("dev.power_w", "W", d["power_w"]), ("dev.health", "", code)):
            readings.append(Reading(f"n{nid}.d{i}.{metric}", metric, value, unit, node_id=nid, device=i, label=label))

    # Endpoints.
    scraped_ids = set(scraped)
    for replica in to_scrape:
        text, error = scraped[replica.pk]
        if error:
            errors.append(f"scrape {replica.endpoint.name}#{replica.index}: {error}")
        base = dict(node_id=nid, endpoint_id=replica.endpoint_id, replica=replica.index,
                    label=f"{replica.endpoint.name}#{replica.index}")
        for metric, unit, value in endpoint_readings(replica, text, error, scraped_at):
            readings.append(Reading(f"e{replica.endpoint_id}.r{replica.index}.{metric}", metric, value, unit, **base))
    with _lock:  # forget replicas that stopped being scraped (their next window starts afresh)
        for replica in replicas:
            if replica.pk not in scraped_ids:
                _snapshots.pop(replica.pk, None)
                _health_seen.pop(replica.pk, None)

    written = store(readings, ts)
    latest_host = {"ts": int(ts), "cpu_pct": host["cpu_pct"], "mem_pct": host["memory"]["pct"],
                   "mem_used_bytes": host["memory"]["used"], "mem_total_bytes": host["memory"]["total"],
                   "load_avg": host["load_avg"], "disk_pct": data_disk.get("pct"), "net_rx_Bps": rx, "net_tx_Bps": tx}
    Node.objects.filter(pk=nid).update(host={**(node.host or {}), "latest": latest_host},
                                       telemetry_error="; ".join(errors)[:2000])
    return {"points": written, "devices": len(dev["devices"]), "errors": errors,
            "seconds": round(time.monotonic() - started, 3)}
