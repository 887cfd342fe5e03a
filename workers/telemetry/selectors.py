"""Reading telemetry: chart data for a range (raw points for short ranges, minute rollups for
long ones, bucketed in SQL to at most MAX_POINTS per series), fleet summary cards, and the
latest values for the Prometheus exposition."""

from __future__ import annotations

import math
import time
from collections.abc import Set

from django.db.models import Count, F, Max, Min, Sum
from django.db.models.expressions import ExpressionWrapper
from django.db.models.fields import BigIntegerField, FloatField

from workers.models import Device, Node
from workers.telemetry.models import METRIC_UNITS, Point, Rollup, Series  # noqa: F401 (METRIC_UNITS: re-exported)
from workers.telemetry.services import stale_seconds
from workers.telemetry.sources import served_facts

RANGES = {"15m": 900, "1h": 3600, "6h": 6 * 3600, "24h": 86400, "7d": 7 * 86400}
DEFAULT_RANGE = "1h"
ROLLUP_FROM_SECONDS = 6 * 3600  # ranges this long or longer read the minute rollups
MAX_POINTS = 720


class BadRange(ValueError):
    pass


def plan(range_key: str) -> tuple[int, int, str]:
    """(seconds, bucket step, "raw" | "rollup") for a range name."""
    if range_key not in RANGES:
        raise BadRange(f"range must be one of {', '.join(RANGES)}")
    seconds = RANGES[range_key]
    step = max(1, math.ceil(seconds / MAX_POINTS))
    if seconds >= ROLLUP_FROM_SECONDS:
        return seconds, max(60, math.ceil(step / 60) * 60), "rollup"
    return seconds, step, "raw"


def _bucket(field: str, step: int):
    return ExpressionWrapper(F(field) / step * step, output_field=BigIntegerField())


def _raw_buckets(ids, start: int, end: int, step: int):
    """(series_id, bucket, sum, count, min, max) of raw points."""
    rows = (
        Point.objects.filter(series_id__in=ids, ts__gte=start, ts__lt=end)
        .annotate(b=_bucket("ts", step))
        .values("series_id", "b")
        .annotate(s=Sum("value"), n=Count("id"), mn=Min("value"), mx=Max("value"))
        .order_by()
        .values_list("series_id", "b", "s", "n", "mn", "mx")
    )
    return list(rows)


def _rollup_buckets(ids, start: int, end: int, step: int):
    weighted = ExpressionWrapper(F("avg") * F("count"), output_field=FloatField())
    rows = (
        Rollup.objects.filter(series_id__in=ids, minute__gte=start, minute__lt=end)
        .annotate(b=_bucket("minute", step))
        .values("series_id", "b")
        .annotate(s=Sum(weighted), n=Sum("count"), mn=Min("min"), mx=Max("max"))
        .order_by()
        .values_list("series_id", "b", "s", "n", "mn", "mx")
    )
    return list(rows)


def series_data(
    series: list[Series], range_key: str = DEFAULT_RANGE, *, since: int | None = None, now: float | None = None
) -> dict:
    """Chart data of ``series`` over the range ending now. With ``since`` (a bucket time the
    client already has), only buckets from that one on (the last may have grown).

    ``{"range", "step", "resolution", "start", "end", "series": [{"id", "key", "metric", "label",
    "unit", "node", "endpoint", "device", "replica", "last", "t": [...], "v": [...], "min": [...],
    "max": [...]}]}`` with ``t`` in Unix seconds (bucket start) and ``v`` the bucket's mean."""
    seconds, step, resolution = plan(range_key)
    end = int(now if now is not None else time.time()) + 1
    start = (end - seconds) // step * step
    if since is not None:
        start = max(start, int(since) // step * step)
    ids = [s.pk for s in series]
    buckets: dict[tuple[int, int], list] = {}

    def add(rows):
        for sid, b, total, n, mn, mx in rows:
            if not n:
                continue
            cur = buckets.get((sid, b))
            if cur is None:
                buckets[(sid, b)] = [total or 0.0, n, mn, mx]
            else:
                cur[0] += total or 0.0
                cur[1] += n
                cur[2], cur[3] = min(cur[2], mn), max(cur[3], mx)

    if ids:
        raw_from = start
        if resolution == "rollup":
            rolled = Rollup.objects.aggregate(m=Max("minute"))["m"]
            if rolled is not None and rolled >= start:
                add(_rollup_buckets(ids, start, rolled + 60, step))
                raw_from = rolled + 60
        add(_raw_buckets(ids, raw_from, end, step))

    out = []
    per_series: dict[int, list] = {sid: [] for sid in ids}
    for (sid, b), (total, n, mn, mx) in buckets.items():
        per_series[sid].append((b, total / n, mn, mx))
    for s in series:
        rows = sorted(per_series[s.pk])
        out.append(
            {
                "id": s.pk,
                "key": s.key,
                "metric": s.metric,
                "label": s.label or s.key,
                "unit": s.unit,
                "node": s.node_id,
                "endpoint": s.endpoint_id,
                "device": s.device,
                "replica": s.replica,
                "last": {"t": s.last_ts, "v": s.last_value},
                "t": [r[0] for r in rows],
                "v": [_round(r[1]) for r in rows],
                "min": [_round(r[2]) for r in rows],
                "max": [_round(r[3]) for r in rows],
            }
        )
    return {"range": range_key, "step": step, "resolution": resolution, "start": start, "end": end, "series": out}


def _round(value):
    return None if value is None else round(value, 4)


def find_series(
    *,
    metrics: list[str],
    node: int | None = None,
    endpoint: int | None = None,
    device: int | None = None,
    gateway_key: int | None = None,
    hidden_keys: Set[str] = frozenset(),
    hidden_endpoints: Set[int] = frozenset(),
) -> list[Series]:
    """`hidden_keys`, `hidden_endpoints`: gateway keys (ids) and endpoints whose series are left out, another
    team's (sources.hidden_keys, sources.hidden_endpoints)."""
    qs = Series.objects.filter(metric__in=metrics)
    if hidden_endpoints:
        qs = qs.exclude(endpoint_id__in=hidden_endpoints)
    if gateway_key is not None:  # the gateway's per-key series are keyed gk<id>.<metric>
        qs = qs.filter(key__startswith=f"gk{gateway_key}.")
    if node is not None:
        qs = qs.filter(node_id=node)
    if endpoint is not None:
        qs = qs.filter(endpoint_id=endpoint)
    if device is not None:
        qs = qs.filter(device=device)
    found = qs.order_by("metric", "device", "replica", "key")
    if hidden_keys:
        return [s for s in found if not (s.metric.startswith("gk.") and key_id(s) in hidden_keys)][:64]
    return list(found[:64])


def key_id(s: Series) -> str:
    """A gateway key's series are keyed gk<id>.<metric>: the id."""
    return s.key.split(".", 1)[0].removeprefix("gk")


# --- fleet ---------------------------------------------------------------------------------


def fresh_cutoff() -> int:
    return int(time.time() - stale_seconds())


def fleet_summary(*, hidden_endpoints: Set[int] = frozenset()) -> dict:
    """The Overview cards: nodes online, accelerators healthy/total, endpoints ready, total QPS,
    worst P99 and the fleet error rate (request-weighted; the worst one while idle). `hidden_endpoints`: other
    teams' endpoints, left out of the endpoint figures (nodes and accelerators are everyone's)."""
    nodes = list(Node.objects.only("pk", "name", "last_heartbeat", "platform"))
    online = [n for n in nodes if n.online]
    online_ids = {n.pk for n in online}
    devices = list(Device.objects.values_list("node_id", "health"))
    healthy = sum(1 for node_id, h in devices if node_id in online_ids and (h or "").upper() == "OK")
    endpoints = [ep for ep in served_facts() if ep.id not in hidden_endpoints]
    running = len(endpoints)
    ready = sum(1 for ep in endpoints if ep.ready)
    cutoff = fresh_cutoff()
    latest: dict[str, dict[str, float | None]] = {}  # metric -> endpoint key (e.g. "e7") -> last value
    for metric, key, value in (
        Series.objects.filter(metric__in=("ep.qps", "ep.p99_s", "ep.error_rate"), last_ts__gte=cutoff)
        .exclude(endpoint_id__in=hidden_endpoints)
        .values_list("metric", "key", "last_value")
    ):
        latest.setdefault(metric, {})[key.rsplit(".", 2)[0]] = value
    qps = latest.get("ep.qps", {})
    total_qps = sum(v for v in qps.values() if v is not None)
    p99s = [v for v in latest.get("ep.p99_s", {}).values() if v is not None]
    rates = latest.get("ep.error_rate", {})
    error_rate: float | None
    if total_qps > 0:
        error_rate = sum(rate * (qps.get(k) or 0) for k, rate in rates.items() if rate is not None) / total_qps
        error_rate = max(error_rate, max((r for k, r in rates.items() if not qps.get(k) and r), default=0))
    else:
        error_rate = max((r for r in rates.values() if r is not None), default=None)
    return {
        "nodes": nodes,
        "nodes_online": len(online),
        "nodes_total": len(nodes),
        "devices_healthy": healthy,
        "devices_total": len(devices),
        "endpoints_ready": ready,
        "endpoints_running": running,
        "qps": round(total_qps, 3),
        "worst_p99": max(p99s) if p99s else None,
        "error_rate": error_rate,
        "error_rate_pct": None if error_rate is None else 100 * error_rate,
    }
