"""The rules of a replica's life that the reconcile loop applies: readiness, backoff after a
crash, scheduled restarts, device faults and where to go instead, the endpoint's overall state,
and the event log."""

import http.client
import json
import logging
import urllib.error
import urllib.request
from datetime import timedelta

from django.conf import settings
from django.db.utils import InterfaceError, OperationalError

from endpoints.commands import PROFILER_FLAG
from endpoints.models import Endpoint, EndpointEvent, Replica, ReplicaMember
from endpoints.telemetry import scrape
from endpoints.vllm_metrics import parse_metrics
from workers.agent.supervisor import ProcessHandle, Supervisor
from workers.models import Device

log = logging.getLogger("console.agent")

#: The database is away (a restart, a dropped connection): the agent's pass ends and its loop waits for it. Any
#: other DatabaseError is one row's (a value PostgreSQL refuses), and the pass goes on with the next.
DB_AWAY = (OperationalError, InterfaceError)


def event(endpoint_id: int, kind: str, message: str, *, replica: int | None = None, level: str = "info") -> None:
    EndpointEvent.objects.create(
        endpoint_id=endpoint_id, replica_index=replica, kind=kind, message=message[:4000], level=level
    )
    log.log(
        logging.WARNING if level != "info" else logging.INFO,
        "[endpoint %s#%s] %s: %s",
        endpoint_id,
        replica,
        kind,
        message,
    )


def stop_unowned(handle: ProcessHandle, *, supervisor: Supervisor, what: str) -> None:
    """Stop a process (its whole group) or container just started for a row that was deleted meanwhile (its
    endpoint deleted during the start): no row names it, so no pass would ever find, stop or reap it."""
    running = supervisor.find(handle)
    if running is not None:
        supervisor.terminate(running, grace=settings.ENDPOINT_STOP_GRACE_SECONDS)
    supervisor.reap(handle)  # what of its group outlived the tree, or a container that already ended
    log.warning("stopped %s: its row was deleted while it started (its endpoint deleted)", what)


def http_get_json(url: str, timeout: float = 3.0, headers: dict[str, str] | None = None):
    request = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310 (our own replica URL)
        body = response.read()
        return response.status, (json.loads(body) if body else None)


def model_unlisted(base: str, *, served_model_name: str, headers: dict[str, str]) -> str:
    """Why the server at base does not serve the model under that name (its keyed /v1/models), or "".
    Raises urllib.error.URLError, OSError or ValueError when it does not answer in JSON."""
    _, models = http_get_json(base + "/v1/models", headers=headers)
    names = {m.get("id") for m in (models or {}).get("data", [])}
    return "" if served_model_name in names else f"/v1/models lists {sorted(names)}, not {served_model_name}"


def check_ready(replica: Replica) -> tuple[bool, str]:
    """Ready = /health answers 200 and /v1/models lists the served name."""
    base = f"http://{settings.ENDPOINT_BIND_HOST}:{replica.port}"
    try:
        status, _ = http_get_json(base + "/health")
        if status != 200:
            return False, f"/health answered {status}"
        why = model_unlisted(base, served_model_name=replica.endpoint.served_model_name, headers=replica.auth_header)
        return (False, why) if why else (True, "ok")
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as exc:  # a cut answer too
        return False, f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}"


def in_flight(replica: Replica, *, from_elsewhere: bool = False, timeout: float = 3.0) -> float | None:
    """Requests the replica's vLLM is running or queueing (its /metrics gauges), None if unknown. Read where
    replicas bind (its agent, on its host), or `from_elsewhere` at its node's address (a gateway)."""
    text, _ = scrape(replica.port, timeout=timeout, host=(replica.node.address or None) if from_elsewhere else None)
    if text is None:
        return None
    try:
        snap = parse_metrics(text)
    except ValueError:
        return None
    if snap.running is None and snap.waiting is None:
        return None
    return (snap.running or 0) + (snap.waiting or 0)


def backoff_seconds(crashes: int) -> float:
    return min(settings.ENDPOINT_BACKOFF_BASE_SECONDS * 2 ** max(crashes - 1, 0), settings.ENDPOINT_BACKOFF_MAX_SECONDS)


def scheduled_restart_due(endpoint: Endpoint, ready_at, now) -> str:
    """Why a replica ready since `ready_at` is due for its scheduled restart, or "" if it isn't."""
    if not ready_at:
        return ""
    hours = endpoint.restart_every_hours
    if hours and now - ready_at >= timedelta(hours=hours):
        return f"scheduled restart after {hours} h"
    daily = endpoint.restart_daily_at
    if daily:
        today = now.replace(hour=daily.hour, minute=daily.minute, second=0, microsecond=0)
        if ready_at < today <= now:
            return f"daily restart at {daily:%H:%M} UTC"
    return ""


def profiling_restart_due(replica: Replica) -> str:
    """Why a running replica must restart to follow its endpoint's profiling option (its argv was built
    with the other setting), or "". Read from the argv the replica runs, so turning the option off
    again before a replica restarted leaves that replica alone."""
    if (PROFILER_FLAG in (replica.argv or [])) == replica.endpoint.profiling:
        return ""
    return f"restart to {'enable' if replica.endpoint.profiling else 'disable'} profiling"


def settings_restart_due(replica: Replica) -> str:
    """Why a running replica must restart to take launch settings changed after it started (a tuning applied:
    endpoints.tuning.services.tuning_apply), or ""."""
    changed = replica.endpoint.settings_changed_at
    if not changed or not replica.started_at or replica.started_at >= changed:
        return ""
    return "restart to apply the changed launch settings"


DEVICE_FAULT = "device fault"  # how a replica's state_reason starts while a device of it is not OK
# How the reason of a start that the node's vLLM parser refused starts (launch.check_node_parser).
ENGINE_REFUSED = "not started"


def device_faults(replica: Replica) -> dict[int, str]:
    """The replica's devices on its own (head) node that left OK (the agent's last npu-smi/NVML sample), with why."""
    if not replica.devices:
        return {}
    found = Device.objects.filter(node_id=replica.node_id, index__in=replica.devices).unhealthy()
    return {device.index: device.fault for device in found}


def member_device_faults(replica: Replica) -> list[str]:
    """Why devices that a multi-node replica's members hold on the other nodes left OK, each naming its node
    (the head node's are device_faults'). Those devices are pinned on their node by the spec: no move."""
    faults = []
    for member in replica.members.exclude(node_id=replica.node_id).select_related("node"):
        found = Device.objects.filter(node_id=member.node_id, index__in=member.devices or []).unhealthy()
        faults += [f"{device.fault} on node {member.node.name} ({member.role})" for device in found]
    return faults


def healthy_placement(replica: Replica, faults: dict[int, str]) -> list[int] | None:
    """Devices to restart the replica on: its healthy ones plus, for each faulty one, a spare from
    the endpoint's own devices (the spec's placement) that is healthy and held by no other wanted
    replica of it. None when there are not enough spares: a pinned spec goes nowhere else."""
    endpoint = replica.endpoint
    held = {
        d
        for other in Replica.objects.filter(endpoint=endpoint, index__lt=endpoint.replicas).exclude(pk=replica.pk)
        for d in other.devices
    }
    bad = set(Device.objects.filter(node_id=replica.node_id).unhealthy().values_list("index", flat=True))
    spares = [d for d in endpoint.devices if d not in held and d not in bad and d not in replica.devices]
    keep = [d for d in replica.devices if d not in faults]
    need = len(replica.devices) - len(keep)
    if len(spares) < need:
        return None
    return keep + spares[:need]


# An autoscaled endpoint (min_replicas 0) with no replica wanted: nothing wrong, nothing stopped.
SCALED_TO_ZERO = "scaled to zero: the next request through the gateway starts a replica"

MEMBER_DOWN = (Endpoint.State.CRASHED, Endpoint.State.RESTARTING, Endpoint.State.FAILED)


def member_down_reason(endpoint: Endpoint) -> str:
    """Why a node of a running multi-node replica is missing ("" when every member is up or starting)."""
    down = (
        ReplicaMember.objects.filter(
            replica__endpoint=endpoint, replica__index__lt=endpoint.replicas, state__in=MEMBER_DOWN
        )
        .select_related("node")
        .first()
    )
    return f"{down.role} on node {down.node.name}: {down.state_reason or down.state}" if down else ""


def aggregate_state(endpoint: Endpoint) -> tuple[str, str]:
    S = Endpoint.State
    states = list(endpoint.replica_set.values_list("state", flat=True))
    if endpoint.desired_state == Endpoint.Desired.RUNNING:  # replicas past the count (scaled down) are not wanted
        states = list(endpoint.replica_set.filter(index__lt=endpoint.replicas).values_list("state", flat=True))
    if endpoint.desired_state == Endpoint.Desired.STOPPED:
        members = ReplicaMember.objects.filter(replica__endpoint=endpoint).values_list("state", flat=True)
        if all(s in (S.STOPPED, S.FAILED, S.PENDING) for s in [*states, *members]):
            return S.STOPPED, ""
        return S.STOPPING, ""
    if endpoint.replicas == 0:
        return S.PENDING, SCALED_TO_ZERO
    every_failed = bool(states) and all(s == S.FAILED for s in states)
    if every_failed:  # a start refused by a node's parser says more than a member it left down
        refused = next(
            (r for r in endpoint.replica_set.values_list("state_reason", flat=True) if ENGINE_REFUSED in r), ""
        )
        if refused:
            return S.FAILED, refused
    if down := member_down_reason(endpoint):  # a node of the cluster died: degraded until it is back
        return S.DEGRADED, down
    if every_failed:
        return S.FAILED, "every replica failed"
    if not states:
        return S.PENDING, "no replicas"
    if all(s == S.READY for s in states):
        return S.READY, ""
    if any(s == S.READY for s in states):
        return S.DEGRADED, f"{states.count(S.READY)} of {len(states)} replicas ready"
    for s in (S.RESTARTING, S.CRASHED, S.STARTING, S.DEGRADED, S.STOPPING, S.FAILED, S.PENDING):
        if s in states:
            return s, ""
    return S.PENDING, ""


def refresh_endpoint_state(endpoint: Endpoint) -> None:
    state, reason = aggregate_state(endpoint)
    if state == Endpoint.State.PENDING and reason != SCALED_TO_ZERO and not endpoint.node.online:
        reason = f"waiting for the agent of node {endpoint.node.name} (offline)"
    if not reason:  # say why a replica is held out of routing, on the endpoint and in lists
        reason = next(
            (r for r in endpoint.replica_set.values_list("state_reason", flat=True) if r.startswith(DEVICE_FAULT)), ""
        )
    if not reason and endpoint.desired_state == Endpoint.Desired.RUNNING:
        draining = endpoint.replica_set.filter(index__gte=endpoint.replicas, state=Endpoint.State.STOPPING).count()
        wanted = endpoint.autoscale_wanted
        if wanted and wanted > endpoint.replicas:  # the autoscaler's scale-up that found no devices
            reason = f"wants {wanted}, has {endpoint.replicas}: no free devices"
        elif draining:
            reason = f"draining {draining} replica(s) after a scale-down"
    elif reason == SCALED_TO_ZERO:
        draining = endpoint.replica_set.filter(state=Endpoint.State.STOPPING).count()
        reason += f" (draining {draining} replica(s))" if draining else ""
    Endpoint.objects.filter(pk=endpoint.pk).update(state=state, state_reason=reason[:500])
