"""The endpoints' part of each telemetry pass, registered with workers.telemetry: the CPU and
RSS of each replica's process tree, and each ready replica's vLLM ``/metrics`` (scraped
concurrently, each with a timeout). The previous /metrics snapshot of each replica is kept in
this process to turn counters and histograms into per-window rates and percentiles. Also the
facts (endpoint ready or not) that alerts, the fleet summary and /metrics report."""

from __future__ import annotations

import http.client
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from django.conf import settings

from endpoints.models import Endpoint, Replica
from endpoints.vllm_metrics import Snapshot, parse_metrics, window_stats
from workers.host_stats import sample_process_tree
from workers.models import Node
from workers.telemetry.models import Alert, Series
from workers.telemetry.services import Reading
from workers.telemetry.sources import Contribution, ServedFact

SCRAPED_STATES = (Endpoint.State.READY, Endpoint.State.DEGRADED)

_lock = threading.Lock()
_snapshots: dict[int, tuple[int | None, float, Snapshot]] = {}  # replica id -> (pid, monotonic, snapshot)
_health_seen: dict[int, int] = {}  # replica id -> health_failures at the previous pass


def scrape(port: int, timeout: float, *, host: str | None = None) -> tuple[str | None, str | None]:
    """(text, None) or (None, error) for GET /metrics of the replica on `port` (where replicas bind, as
    check_ready asks, or at `host`: the replica's node address, from another host)."""
    try:
        url = f"http://{host or settings.ENDPOINT_BIND_HOST}:{port}/metrics"
        with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 (our own replica URL)
            if response.status != 200:
                return None, f"/metrics answered {response.status}"
            return response.read().decode("utf-8", errors="replace"), None
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as exc:  # a cut answer too
        return None, f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}"


def _parse(text: str, served_name: str) -> Snapshot:
    snap = parse_metrics(text, model_name=served_name)
    if snap.models and served_name not in snap.models:
        snap = parse_metrics(text)  # served under another name: take the whole server
    return snap


def endpoint_readings(
    replica: Replica, text: str | None, now_mono: float
) -> tuple[list[tuple[str, str, float | None]], str | None]:
    """(metric, unit, value) for one replica's scrape, and why its /metrics did not parse (else None);
    keeps its snapshot for the next window. A failed scrape, a /metrics that does not parse and each
    failed health check since the previous pass count as errors."""
    out: list[tuple[str, str, float | None]] = []
    with _lock:
        seen = _health_seen.get(replica.pk)
        failures = replica.health_failures
        _health_seen[replica.pk] = failures
        health_errors = 0 if seen is None else (failures - seen if failures >= seen else failures)
        previous = _snapshots.get(replica.pk)
    snap, unparsable = None, None
    if text is not None:
        try:
            snap = _parse(text, replica.endpoint.served_model_name)
        except ValueError as exc:
            unparsable = f"unparsable /metrics: {exc}"
    out.append(("ep.scrape_ok", "", 0.0 if snap is None else 1.0))
    failed = (1 if snap is None else 0) + health_errors
    if snap is None:
        with _lock:
            _snapshots.pop(replica.pk, None)
        out += [("ep.errors", "", float(failed)), ("ep.error_rate", "ratio", 1.0)]
        return out, unparsable
    with _lock:
        _snapshots[replica.pk] = (replica.pid, now_mono, snap)
    out += [
        ("ep.running", "", snap.running),
        ("ep.waiting", "", snap.waiting),
        ("ep.kv_cache_pct", "%", None if snap.kv_cache_usage is None else round(snap.kv_cache_usage * 100, 3)),
    ]
    if previous is None or previous[0] != replica.pid or now_mono - previous[1] <= 0:
        return out, None  # the first scrape of this process: no window yet
    stats = window_stats(previous[2], snap, now_mono - previous[1])
    e2e, ttft, itl = stats.get("e2e_latency") or {}, stats.get("ttft") or {}, stats.get("itl") or {}
    requests = stats.get("requests") or 0
    errors = (stats.get("errors") or 0) + failed
    total = requests + failed
    out += [
        ("ep.qps", "req/s", stats.get("qps") if stats.get("qps") is not None else 0.0),
        ("ep.p50_s", "s", e2e.get("p50")),
        ("ep.p90_s", "s", e2e.get("p90")),
        ("ep.p99_s", "s", e2e.get("p99")),
        ("ep.ttft_p50_s", "s", ttft.get("p50")),
        ("ep.ttft_p99_s", "s", ttft.get("p99")),
        ("ep.itl_p50_s", "s", itl.get("p50")),
        ("ep.gen_tps", "tok/s", stats.get("generation_tokens_per_s")),
        ("ep.prompt_tps", "tok/s", stats.get("prompt_tokens_per_s")),
        # Prompt tokens found in the prefix cache over the window (what prefix-aware routing aims at).
        (
            "ep.prefix_hit_pct",
            "%",
            None if stats.get("prefix_cache_hit_rate") is None else round(stats["prefix_cache_hit_rate"] * 100, 3),
        ),
        ("ep.errors", "", float(errors)),
        ("ep.error_rate", "ratio", errors / total if total else 0.0),
    ]
    if replica.role:  # a disaggregated endpoint's: each role's own figures, charted per role
        share = stats.get("kv_external_share")
        out += (
            [("ep.prefill_ttft_p50_s", "s", ttft.get("p50")), ("ep.prefill_ttft_p99_s", "s", ttft.get("p99"))]
            if replica.role == Replica.Role.PREFILL
            else [
                ("ep.decode_itl_p50_s", "s", itl.get("p50")),
                ("ep.decode_itl_p99_s", "s", itl.get("p99")),
                ("ep.kv_in_tps", "tok/s", stats.get("kv_external_hits_per_s")),
                ("ep.kv_in_pct", "%", None if share is None else round(share * 100, 3)),
            ]
        )
    if snap.spec_drafts is not None:  # a server started with --speculative-config: vLLM's own two figures
        rate = stats.get("spec_acceptance_rate")
        out += [
            ("ep.spec_accept_pct", "%", None if rate is None else round(rate * 100, 3)),
            ("ep.spec_mean_len", "tok", stats.get("spec_mean_accepted_length")),
        ]
    return out, None


def collect_replicas(node: Node) -> Contribution:
    """Process trees and /metrics of this node's replicas (the registered telemetry collector)."""
    replicas = list(Replica.objects.filter(node=node).select_related("endpoint"))
    to_scrape = [r for r in replicas if r.state in SCRAPED_STATES and r.port]
    timeout = settings.TELEMETRY_SCRAPE_TIMEOUT_SECONDS
    part = Contribution()
    nid = node.pk
    with ThreadPoolExecutor(max_workers=max(1, min(len(to_scrape), 8)), thread_name_prefix="telemetry-ep") as pool:
        scrapes = {r.pk: pool.submit(scrape, r.port, timeout) for r in to_scrape}
        trees = {r.pk: sample_process_tree(r.pid) for r in replicas if r.pid}  # fast: /proc reads
        scraped = {pk: f.result() for pk, f in scrapes.items()}
        scraped_at = time.monotonic()

    # Replica processes: CPU and RSS of each vLLM process tree; pid -> replica for the device map.
    for replica in replicas:
        tree = trees.get(replica.pk)
        if not tree:
            continue
        for proc in tree["processes"]:
            part.owners[proc["pid"]] = {
                "endpoint_id": replica.endpoint_id,
                "endpoint": replica.endpoint.name,
                "replica": replica.index,
            }
        name = f"{replica.endpoint.name}#{replica.index}"
        base = {"node_id": nid, "endpoint_id": replica.endpoint_id, "replica": replica.index, "label": name}
        if tree["warm"]:
            part.readings.append(
                Reading(
                    f"e{replica.endpoint_id}.r{replica.index}.proc.cpu_pct",
                    "proc.cpu_pct",
                    tree["cpu_pct"],
                    "%",
                    **base,
                )
            )
        part.readings.append(
            Reading(
                f"e{replica.endpoint_id}.r{replica.index}.proc.rss_bytes",
                "proc.rss_bytes",
                tree["rss_bytes"],
                "B",
                **base,
            )
        )

    for replica in to_scrape:
        text, error = scraped[replica.pk]
        readings, unparsable = endpoint_readings(replica, text, scraped_at)
        label = f"{replica.endpoint.name}#{replica.index}" + (f" ({replica.role})" if replica.role else "")
        if error or unparsable:
            part.errors.append(f"scrape {label}: {error or unparsable}")
        base = {"node_id": nid, "endpoint_id": replica.endpoint_id, "replica": replica.index, "label": label}
        for metric, unit, value in readings:
            part.readings.append(
                Reading(f"e{replica.endpoint_id}.r{replica.index}.{metric}", metric, value, unit, **base)
            )
    with _lock:  # forget replicas that stopped being scraped (their next window starts afresh)
        for replica in replicas:
            if replica.pk not in scraped:
                _snapshots.pop(replica.pk, None)
                _health_seen.pop(replica.pk, None)
    return part


def served_facts() -> list[ServedFact]:
    """Every endpoint meant to be running, and whether it is ready (the registered facts). One scaled
    to zero is left out: no replica is meant to serve until a request wakes it (not an alert)."""
    return [
        ServedFact(
            id=ep.pk,
            name=ep.name,
            state=ep.state,
            node_id=ep.node_id,
            ready=ep.state == Endpoint.State.READY,
            team_id=ep.team_id,
        )
        for ep in Endpoint.objects.filter(desired_state=Endpoint.Desired.RUNNING, replicas__gt=0)
    ]


def endpoint_teams() -> dict[int, int]:
    """Each endpoint's team, for telemetry (workers.telemetry.sources.register_endpoint_teams)."""
    return dict(Endpoint.objects.values_list("pk", "team_id"))


def endpoint_names(ids: set[int]) -> dict[int, str]:
    """The names of the endpoints among ids (registered with telemetry: its series keep an endpoint's id)."""
    return dict(Endpoint.objects.filter(pk__in=ids).values_list("pk", "name"))


def forget_endpoint_telemetry(sender, instance, **kwargs) -> None:
    """An endpoint's series (with their points) and alerts go with it, as the foreign keys' cascade did."""
    Series.objects.filter(endpoint_id=instance.pk).delete()
    Alert.objects.filter(endpoint_id=instance.pk).delete()
