from collections.abc import Collection

from django.conf import settings

from console.roles import VIEWER
from console.teams import visible, visible_get
from endpoints.autoscale import Sample
from endpoints.models import Endpoint, ReplicaMember
from workers.models import Device
from workers.telemetry.models import Point, Series


def endpoint_list(*, user):
    """The endpoints of the user's teams (every team's for the console Admin)."""
    endpoints = Endpoint.objects.select_related("artifact", "artifact__model", "node").prefetch_related("replica_set")
    return visible(endpoints, user)


def endpoint_get(endpoint_id: int, *, user, role: str = VIEWER) -> Endpoint:
    """404 for another team's endpoint; 403 where the user's role in its team is below `role`."""
    endpoints = Endpoint.objects.select_related("artifact", "artifact__model", "node")
    return visible_get(endpoints, user, role=role, pk=endpoint_id)


def replicas_of(endpoint: Endpoint):
    return endpoint.replica_set.select_related("node").prefetch_related("members__node").order_by("index")


def replicas_on_node(node):
    """What a node runs now, for its page (stopped replicas left out)."""
    return node.replicas.select_related("endpoint").exclude(state=Endpoint.State.STOPPED)


def members_on_node(node):
    """The parts of multi-node replicas headed elsewhere that the node runs, for its page."""
    return (
        ReplicaMember.objects.filter(node=node)
        .exclude(replica__node=node)
        .exclude(state=Endpoint.State.STOPPED)
        .select_related("replica", "replica__endpoint")
    )


def unhealthy_replica_ids(replicas) -> set[int]:
    """Of these replicas, those with a device that left OK on any node they span (their own and their
    members'): the gateway routes none of them, from the moment an agent records the fault."""
    unhealthy = set(Device.objects.unhealthy().values_list("node_id", "index"))
    if not unhealthy:
        return set()
    held = {r.pk: {(r.node_id, d) for d in r.devices or ()} for r in replicas}
    for member in ReplicaMember.objects.filter(replica_id__in=held):
        held[member.replica_id] |= {(member.node_id, d) for d in member.devices or ()}
    return {pk for pk, devices in held.items() if devices & unhealthy}


def autoscaled_endpoints():
    """The endpoints the autoscaler looks after: autoscaling on, meant to be running, one node."""
    return Endpoint.objects.filter(
        desired_state=Endpoint.Desired.RUNNING, autoscale__isnull=False, distributed=""
    ).select_related("node")


# Per metric: the Sample field it adds into. gw.waiting is the gateway's own queue: only the requests
# it holds while an endpoint scaled to zero wakes. Those it has sent on are in vLLM's running/waiting
# already, so counting its in-flight requests too would count them twice.
_LOAD_METRICS = {
    "ep.waiting": "waiting",
    "gw.waiting": "waiting",
    "ep.running": "running",
    "ep.qps": "served",
    "gw.qps": "served",
}
_ROLE_METRICS = {"ep.kv_cache_pct": "kv_pct"}


def load_samples(
    endpoint_id: int, *, since: float, until: float, replicas: Collection[int] | None = None
) -> list[Sample]:
    """The endpoint's load in (since, until] as the autoscaler reads it, one sample per telemetry pass:
    queued requests (vLLM's num_requests_waiting, each replica's `ep.waiting`, plus the gateway's held
    ones, `gw.waiting`), running ones (`ep.running`) and requests served (`ep.qps`, `gw.qps`), each summed
    over the replicas (and gateways). Readings are bucketed by TELEMETRY_INTERVAL_SECONDS (a series'
    several readings in one bucket count once, the last); a bucket without vLLM's `ep.waiting` is not
    `scraped`. `replicas`: those replica indexes' series only (one role of a disaggregated endpoint, whose
    samples also sum the replicas' KV cache use, `ep.kv_cache_pct`, into kv_pct), the gateway's left out."""
    rows = Series.objects.filter(endpoint_id=endpoint_id, metric__in=[*_LOAD_METRICS, *_ROLE_METRICS])
    if replicas is None:
        rows = rows.exclude(metric__in=list(_ROLE_METRICS))
    else:
        rows = rows.filter(replica__in=list(replicas))
    series = dict(rows.values_list("pk", "metric"))
    step = max(1, int(settings.TELEMETRY_INTERVAL_SECONDS))
    buckets: dict[int, dict[int, float]] = {}
    for series_id, ts, value in (
        Point.objects.filter(series_id__in=list(series), ts__gt=int(since), ts__lte=int(until))
        .order_by("ts")
        .values_list("series_id", "ts", "value")
    ):
        buckets.setdefault(ts // step * step, {})[series_id] = value
    out = []
    for ts, values in sorted(buckets.items()):
        sums = {"waiting": 0.0, "running": 0.0, "served": 0.0, "kv_pct": 0.0}
        for pk, value in values.items():
            sums[_LOAD_METRICS.get(series[pk]) or _ROLE_METRICS[series[pk]]] += value
        metrics = {series[pk] for pk in values}
        # vLLM not saying how many it runs is not "none running".
        running = sums["running"] if "ep.running" in metrics or "ep.waiting" not in metrics else None
        out.append(
            Sample(
                ts=ts,
                waiting=sums["waiting"],
                running=running,
                served=sums["served"],
                scraped="ep.waiting" in metrics,
                kv_pct=sums["kv_pct"],
            )
        )
    return out
