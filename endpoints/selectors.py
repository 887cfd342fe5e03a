from django.conf import settings

from endpoints.autoscale import Sample
from endpoints.models import Endpoint, ReplicaMember
from workers.models import Device
from workers.telemetry.models import Point, Series


def endpoint_list():
    return Endpoint.objects.select_related("artifact", "artifact__model", "node").prefetch_related("replica_set")


def replicas_of(endpoint: Endpoint):
    return endpoint.replica_set.select_related("node").prefetch_related("members__node").order_by("index")


def replicas_on_node(node):
    """What a node runs now, for its page (stopped replicas left out)."""
    return node.replicas.select_related("endpoint").exclude(state=Endpoint.State.STOPPED)


def members_on_node(node):
    """The parts of multi-node replicas headed elsewhere that the node runs, for its page."""
    return (ReplicaMember.objects.filter(node=node).exclude(replica__node=node).exclude(state=Endpoint.State.STOPPED)
            .select_related("replica", "replica__endpoint"))


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
    return (Endpoint.objects.filter(desired_state=Endpoint.Desired.RUNNING, autoscale__isnull=False, distributed="")
            .select_related("node"))


def waiting_samples(endpoint_id: int, *, since: float, until: float) -> list[Sample]:
    """The endpoint's queued requests (vLLM's num_requests_waiting, each replica's `ep.waiting` series)
    in (since, until], summed over its replicas per telemetry pass: readings of one pass are bucketed
    by TELEMETRY_INTERVAL_SECONDS (a replica's several readings in one bucket count once, the last)."""
    series = list(Series.objects.filter(endpoint_id=endpoint_id, metric="ep.waiting").values_list("pk", flat=True))
    step = max(1, int(settings.TELEMETRY_INTERVAL_SECONDS))
    buckets: dict[int, dict[int, float]] = {}
    for series_id, ts, value in (Point.objects.filter(series_id__in=series, ts__gt=int(since), ts__lte=int(until))
                                 .order_by("ts").values_list("series_id", "ts", "value")):
        buckets.setdefault(ts // step * step, {})[series_id] = value
    return [Sample(ts=ts, waiting=sum(v.values())) for ts, v in sorted(buckets.items())]
