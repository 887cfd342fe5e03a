"""The replica state machine: what to start, stop and restart on a node, crash counting,
backoff, giving up, health failures, the start timeout and scheduled restarts one at a time.
Registered with the node agent as a workload (EndpointsConfig.ready()); the agent's supervisor
runs the processes."""

import logging
import time
from datetime import timedelta

from django.conf import settings
from django.db import IntegrityError
from django.db.models import Case, CharField, DateTimeField, Value, When
from django.db.utils import DatabaseError
from django.utils import timezone

from endpoints.engine_log import root_cause
from endpoints.launch import (
    EngineRefused,
    cpu_share_note,
    make_engine_cache_dir,
    make_profile_dir,
    make_work_dir,
    recorded_log,
    replica_process,
    replica_work_dir,
)
from endpoints.members import MemberReconciler, cluster_wait, member_refused, nudge_members, release_cluster_port
from endpoints.models import Endpoint, Replica
from endpoints.node_files import SWEEP_EVERY_S, sweep_deleted_endpoints
from endpoints.ports import claim_port
from endpoints.replica_state import (
    DB_AWAY,
    DEVICE_FAULT,
    backoff_seconds,
    check_ready,
    device_faults,
    event,
    healthy_placement,
    in_flight,
    member_device_faults,
    profiling_restart_due,
    refresh_endpoint_state,
    scheduled_restart_due,
    settings_restart_due,
    stop_unowned,
)
from workers.agent.supervisor import LeaseLost, ProcessHandle, RuntimeUnavailable, Supervisor, rotate_if_large
from workers.models import Node

log = logging.getLogger("console.agent")
S = Endpoint.State


# What a replica that is no longer running keeps of its last start: nothing that identifies it.
NO_HANDLE = {"pid": None, "container_id": ""}


def handle_of(replica: Replica) -> ProcessHandle:
    return ProcessHandle(
        pid=replica.pid or 0,
        create_time=replica.pid_create_time or 0.0,
        argv=list(replica.argv or []),
        runtime=replica.runtime or "process",
        container_name=replica.container_name,
        container_id=replica.container_id,
        log_path=recorded_log(replica.log_path),
    )


def started_as(handle: ProcessHandle) -> str:
    if handle.container_id:
        return f"{handle.runtime} container {handle.container_name} ({handle.container_id[:12]})"
    return f"pid {handle.pid}"


class ReplicaWorkload:
    """One per agent process: remembers when each replica's health was last checked."""

    def __init__(self):
        self.last_health: dict[int, float] = {}
        self.members = MemberReconciler()  # this node's parts of multi-node replicas
        self.next_sweep = 0.0  # monotonic time of the next sweep of deleted endpoints' files (the first pass)

    def reconcile(self, *, node: Node, supervisor: Supervisor) -> bool:
        replicas = list(Replica.objects.filter(node=node).select_related("endpoint", "endpoint__artifact", "node"))
        touched = set()
        for replica in replicas:
            try:
                self.reconcile_replica(replica, node=node, supervisor=supervisor)
            except IntegrityError:
                continue  # the endpoint was deleted while we worked on it
            except (*DB_AWAY, LeaseLost):
                raise  # the agent's loop waits for the database (the processes keep running), or ends
            except (
                DatabaseError
            ):  # a write this row's data cannot make (e.g. a value PostgreSQL refuses): the others go on
                log.exception("reconcile %s: a database write failed", replica)
                continue
            except RuntimeUnavailable as exc:  # nothing known of it: neither crashed nor stopped, retried next pass
                log.warning("reconcile %s: %s", replica, exc)
                Replica.objects.filter(pk=replica.pk).update(state_reason=str(exc)[:500])
            except Exception as exc:  # one bad replica must not stop the others
                log.exception("reconcile %s", replica)
                Replica.objects.filter(pk=replica.pk).update(state=S.FAILED, state_reason=str(exc)[:500])
                event(
                    replica.endpoint_id, "error", f"{type(exc).__name__}: {exc}", replica=replica.index, level="error"
                )
            touched.add(replica.endpoint_id)
        member_endpoints, members_starting = self.members.reconcile(node=node, supervisor=supervisor)
        for endpoint in Endpoint.objects.filter(pk__in=touched | member_endpoints).select_related("node"):
            refresh_endpoint_state(endpoint)
        if time.monotonic() >= self.next_sweep:
            self.next_sweep = time.monotonic() + SWEEP_EVERY_S
            try:
                sweep_deleted_endpoints()
            except DatabaseError:
                raise  # the agent's loop waits for the database
            except Exception:  # a root it cannot read (permissions, a stale NFS handle): housekeeping only
                log.exception("sweep of deleted endpoints' files failed; trying again in %d s", SWEEP_EVERY_S)
        return members_starting or any(r.state in (S.STARTING, S.RESTARTING) for r in replicas)

    def start(self, replica: Replica, *, node: Node, supervisor: Supervisor) -> None:
        port = claim_port(node, replica)
        try:
            spec, env_added = replica_process(replica=replica, node=node, port=port)
        except EngineRefused as exc:  # the node's vLLM changed since the launch: not started, until an operator's Start
            self.refuse_start(replica, str(exc))
            return
        try:
            make_profile_dir(replica)
            make_engine_cache_dir(node)
            make_work_dir(replica_work_dir(replica))
            handle = supervisor.start(spec)
        except (DatabaseError, RuntimeUnavailable, LeaseLost):
            raise  # the database's, or no container runtime to ask: the replica waits (reconcile); or not ours now
        except Exception as exc:  # the engine's venv not mounted yet, a container runtime's hiccup, a full disk
            self.start_failed(replica, f"{type(exc).__name__}: {exc}")
            return
        recorded = Replica.objects.filter(pk=replica.pk).update(
            pid=handle.pid or None,
            pid_create_time=handle.create_time,
            argv=handle.argv,
            env=env_added,
            port=port,
            runtime=handle.runtime,
            container_name=handle.container_name,
            container_id=handle.container_id,
            state=S.STARTING,
            state_reason="",
            started_at=timezone.now(),
            ready_at=None,
            next_start_at=None,
            stop_requested_at=None,
            health_failures=0,
            log_path=str(spec.log_path),
            last_exit_code=None,
        )
        if not recorded:  # the endpoint was deleted during the start: nothing else would ever stop it
            stop_unowned(handle, supervisor=supervisor, what=f"replica {replica} ({started_as(handle)})")
            return
        event(replica.endpoint_id, "started", f"{started_as(handle)} on port {port}", replica=replica.index)
        if note := cpu_share_note(replica=replica, node=node):
            event(replica.endpoint_id, "cpu-share", note, replica=replica.index, level="warning")

    def start_failed(self, replica: Replica, error: str) -> None:
        """A start that raised before a process ran: counted like a crash (backoff, then give up), the port given
        back; a transient cause (a mount not there yet) clears on a later try without an operator."""
        crashes = replica.crashes_in_a_row + 1
        reason = f"could not start: {error}"[:400]
        if crashes >= settings.ENDPOINT_MAX_CRASHES:
            Replica.objects.filter(pk=replica.pk).update(
                state=S.FAILED,
                crashes_in_a_row=crashes,
                port=None,
                next_start_at=None,
                **NO_HANDLE,
                state_reason=f"gave up after {crashes} failed starts in a row; last: {reason}"[:500],
            )
            event(
                replica.endpoint_id,
                "failed",
                f"gave up after {crashes} failed starts in a row: {reason}",
                replica=replica.index,
                level="error",
            )
            return
        delay = backoff_seconds(crashes)
        Replica.objects.filter(pk=replica.pk).update(
            state=S.RESTARTING,
            crashes_in_a_row=crashes,
            port=None,
            **NO_HANDLE,
            next_start_at=timezone.now() + timedelta(seconds=delay),
            state_reason=f"{reason}; trying again in {delay:.0f} s"[:500],
        )
        event(
            replica.endpoint_id,
            "start-failed",
            f"{reason}; trying again in {delay:.0f} s",
            replica=replica.index,
            level="error",
        )

    def refuse_start(self, replica: Replica, reason: str) -> None:
        """Failed (an operator's Start or Restart tries again), the port given back, the reason on the
        endpoint page and its event; the endpoint's failed state raises the "Endpoint not ready" alert."""
        Replica.objects.filter(pk=replica.pk).update(
            state=S.FAILED,
            state_reason=reason[:500],
            port=None,
            restart_requested=False,
            next_start_at=None,
            **NO_HANDLE,
        )
        if replica.state != S.FAILED or replica.state_reason != reason[:500]:
            event(replica.endpoint_id, "start-refused", reason, replica=replica.index, level="error")
        if replica.endpoint.distributed:
            nudge_members(replica)  # its members stop: nothing will run on them

    def terminate(self, replica: Replica, proc, *, supervisor: Supervisor, reason: str) -> None:
        grace = settings.ENDPOINT_STOP_GRACE_SECONDS
        stopped = supervisor.terminate(proc, grace=grace)
        handle = handle_of(replica)
        if not handle.container_id:  # what of its group outlived the tree terminate waited on (a reparented worker)
            supervisor.reap(handle)
        if stopped.killed:
            event(
                replica.endpoint_id,
                "killed",
                f"did not stop within {grace:.0f} s: killed",
                replica=replica.index,
                level="warning",
            )
        Replica.objects.filter(pk=replica.pk).update(last_exit_code=stopped.exit_code)
        log.info("stopped %s (%s)", replica, reason)

    def reconcile_replica(self, replica: Replica, *, node: Node, supervisor: Supervisor) -> None:
        endpoint = replica.endpoint
        wanted = replica.wanted
        proc = supervisor.find(handle_of(replica))
        now = timezone.now()

        if not wanted:
            if (
                proc is not None
                and endpoint.desired_state == Endpoint.Desired.RUNNING
                and not self.drained(replica, now)
            ):
                return  # scaled down: it finishes its requests first
            if proc is not None:
                Replica.objects.filter(pk=replica.pk).update(state=S.STOPPING, stop_requested_at=now)
                self.terminate(replica, proc, supervisor=supervisor, reason="stop requested")
                event(endpoint.pk, "stopped", "stopped on request", replica=replica.index)
            if replica.state != S.STOPPED or replica.launched:
                Replica.objects.filter(pk=replica.pk).update(
                    state=S.STOPPED, port=None, state_reason="", crashes_in_a_row=0, next_start_at=None, **NO_HANDLE
                )
            release_cluster_port(replica)
            return

        if proc is None and replica.launched:
            self.crashed(replica, supervisor=supervisor, now=now)
            return

        if proc is None:
            if replica.held_failed:
                release_cluster_port(replica)  # once its members have stopped (MemberReconciler)
                return  # given up or refused: an operator's Start or Restart clears it
            if replica.next_start_at and replica.next_start_at > now:
                return

        faults, elsewhere = device_faults(replica), member_device_faults(replica)
        if faults or elsewhere:
            self.leave_faulty_devices(replica, proc, faults, elsewhere=elsewhere, supervisor=supervisor)
            return

        if proc is None:
            refused = member_refused(replica)  # a node of a multi-node replica cannot run its part
            if refused:
                self.refuse_start(replica, refused)
                release_cluster_port(replica)
                return
            waiting = cluster_wait(replica, node)  # a multi-node replica's server starts on a whole cluster
            if waiting:
                if replica.state_reason != waiting:
                    Replica.objects.filter(pk=replica.pk).update(state_reason=waiting[:500])
                return
            if replica.state == S.RESTARTING or replica.restart_requested:
                Replica.objects.filter(pk=replica.pk).update(restarts=replica.restarts + 1)
            # The Restart is taken before the fresh read, not cleared by the start's write: one asked for while
            # this start runs (an edit, then Restart) stays asked for, and restarts it with the new settings.
            Replica.objects.filter(pk=replica.pk, restart_requested=True).update(restart_requested=False)
            fresh = Replica.objects.select_related("endpoint", "endpoint__artifact", "node").get(pk=replica.pk)
            # The node as the database has it now: its engine runtime may have changed on its page.
            self.start(fresh, node=fresh.node, supervisor=supervisor)
            return

        # Running. An operator's restart, or a scheduled one, stops it; the next pass starts it.
        if replica.restart_requested:
            self.terminate(replica, proc, supervisor=supervisor, reason="restart requested")
            Replica.objects.filter(pk=replica.pk).update(
                state=S.RESTARTING,
                next_start_at=None,
                crashes_in_a_row=0,
                state_reason="restarting on request",
                **NO_HANDLE,
            )
            event(endpoint.pk, "restarting", "restart requested", replica=replica.index)
            return

        rotate_if_large(
            recorded_log(replica.log_path), max_bytes=settings.ENDPOINT_LOG_MAX_BYTES, keep=settings.ENDPOINT_LOG_KEEP
        )
        self.check_health(replica, proc, supervisor=supervisor, now=now)

    def drained(self, replica: Replica, now) -> bool:
        """A replica the endpoint no longer counts (scaled down) stops only once drained: first it is
        STOPPING (the gateway already routes only to replicas below the count, and only READY ones),
        then it stops when its vLLM has no request running or queued, but not before the gateway's
        routing table has refreshed (a request routed just before may still arrive), or after
        GATEWAY_DRAIN_SECONDS whatever it is doing."""
        if replica.state in (S.STARTING, S.RESTARTING, S.PENDING):
            return True  # never ready since it started: the gateway sent it nothing
        if replica.state != S.STOPPING or replica.stop_requested_at is None:
            bound = settings.GATEWAY_DRAIN_SECONDS
            Replica.objects.filter(pk=replica.pk).update(
                state=S.STOPPING,
                stop_requested_at=now,
                state_reason=f"draining after a scale-down: stops when idle, at most {bound} s",
            )
            event(
                replica.endpoint_id,
                "draining",
                f"scaled down: out of routing, stopping when its requests finish (at most {bound} s)",
                replica=replica.index,
            )
            return False
        waited = (now - replica.stop_requested_at).total_seconds()
        if waited >= settings.GATEWAY_DRAIN_SECONDS:
            event(
                replica.endpoint_id,
                "drained",
                f"drain bound of {settings.GATEWAY_DRAIN_SECONDS} s reached: stopping",
                replica=replica.index,
            )
            return True
        if waited < 2 * settings.GATEWAY_ROUTES_REFRESH_SECONDS:
            return False
        busy = in_flight(replica)
        if busy == 0:
            event(
                replica.endpoint_id,
                "drained",
                f"no request in flight after {waited:.0f} s: stopping",
                replica=replica.index,
            )
            return True
        return False

    def leave_faulty_devices(
        self, replica: Replica, proc, faults: dict[int, str], *, elsewhere: list[str] = (), supervisor: Supervisor
    ) -> None:
        """A device of this replica left OK (or vanished): its state leaves READY at once, so the
        gateway stops routing to it; it restarts on healthy spares of the endpoint's devices when
        there are some, else it stays out of routing with the reason shown until the chip is OK.
        `elsewhere`: faults on the other nodes of a multi-node replica (member_device_faults), whose
        devices the spec pins there: the replica is held the same way."""
        endpoint = replica.endpoint
        why = "; ".join([faults[i] for i in sorted(faults)] + list(elsewhere))
        # A multi-node replica's devices are the spec's on every node it spans: nowhere else to go.
        pinned = bool(elsewhere or endpoint.distributed)
        placement = None if pinned else healthy_placement(replica, faults)
        if placement is not None:
            if proc is not None:
                self.terminate(replica, proc, supervisor=supervisor, reason="device fault")
            Replica.objects.filter(pk=replica.pk).update(
                devices=placement,
                state=S.RESTARTING,
                next_start_at=None,
                health_failures=0,
                **NO_HANDLE,
                state_reason=f"{DEVICE_FAULT}: {why}; restarting on devices {placement}"[:500],
            )
            event(
                endpoint.pk,
                "device-fault",
                f"{why}: restarting on devices {placement} (was on {replica.devices})",
                replica=replica.index,
                level="error",
            )
            return
        where = (
            f"devices {endpoint.devices} pinned on each of its nodes"
            if pinned
            else f"no healthy spare among the endpoint's devices {endpoint.devices}"
        )
        reason = f"{DEVICE_FAULT}: {why}; {where}: out of routing until it is OK again"[:500]
        state = S.DEGRADED if proc is not None else S.PENDING  # a running process is kept for the recovery
        if replica.state != state or replica.state_reason != reason:
            Replica.objects.filter(pk=replica.pk).update(state=state, state_reason=reason)
        if replica.state_reason != reason:
            event(endpoint.pk, "device-fault", reason, replica=replica.index, level="error")

    def crashed(self, replica: Replica, *, supervisor: Supervisor, now, why: str = "") -> None:
        """It was running and is gone: a crash (or a kill from outside), or stopped for `why` (a start that
        never became ready). Back off, or give up."""
        endpoint = replica.endpoint
        handle = handle_of(replica)
        code = supervisor.exit_code(handle)
        last = supervisor.log_tail(handle, handle.log_path)  # before reap: a container's logs go with it
        supervisor.reap(handle)
        crashes = replica.crashes_in_a_row + 1
        reason = (
            root_cause(last) or next((line for line in reversed(last.splitlines()) if line.strip()), "no output")
        )[:300]
        if why:
            reason = f"{why}; its last output: {reason}"[:400]
        if crashes >= settings.ENDPOINT_MAX_CRASHES:
            # Not over an operator's Restart asked for since this pass read the row: that one reset only
            # failed replicas' counts, so it would start this one with no crash left to spare. (A restart asked
            # for before, as a member's crash asks for one, still gives up: a flapping cluster must end.)
            if Replica.objects.filter(pk=replica.pk, restart_requested=replica.restart_requested).update(
                state=S.FAILED,
                crashes_in_a_row=crashes,
                last_exit_code=code,
                last_log=last,
                **NO_HANDLE,
                state_reason=f"gave up after {crashes} crashes in a row; last: {reason}",
            ):
                event(
                    endpoint.pk,
                    "failed",
                    f"gave up after {crashes} crashes in a row (exit code {code}): {reason}",
                    replica=replica.index,
                    level="error",
                )
                if endpoint.distributed:
                    nudge_members(replica)  # its members stop: nothing will run on them
                return
            crashes = 0  # as a Restart pressed once it had given up: a fresh count, started now (below)
        delay = backoff_seconds(crashes)
        cause = why or f"crashed (exit code {code})"
        # An operator's Restart asked for since this pass read the row (restart_requested, next_start_at None:
        # start now) is kept: the row decides in the same UPDATE, or the backoff would delay it by minutes.
        Replica.objects.filter(pk=replica.pk).update(
            state=S.RESTARTING,
            crashes_in_a_row=crashes,
            last_exit_code=code,
            last_log=last,
            **NO_HANDLE,
            next_start_at=Case(
                When(restart_requested=True, then=Value(None)),
                default=Value(now + timedelta(seconds=delay)),
                output_field=DateTimeField(),
            ),
            state_reason=Case(
                When(restart_requested=True, then=Value(f"{cause}; restarting now on request"[:500])),
                default=Value(f"{cause}; restarting in {delay:.0f} s"[:500]),
                output_field=CharField(),
            ),
        )
        when = f"restart in {delay:.0f} s"
        if Replica.objects.filter(pk=replica.pk, restart_requested=True).exists():
            when = "restarting now on request"
        what = f"process {replica.pid}" if not handle.container_id else f"container {handle.container_name}"
        if why:
            event(
                endpoint.pk, "start-timeout", f"{what} stopped; {when}: {reason}", replica=replica.index, level="error"
            )
            return
        event(
            endpoint.pk,
            "crashed",
            f"{what} exited (code {code}); {when}: {reason}",
            replica=replica.index,
            level="error",
        )

    def check_health(self, replica: Replica, proc, *, supervisor: Supervisor, now) -> None:
        endpoint = replica.endpoint
        interval = settings.ENDPOINT_HEALTH_INTERVAL_SECONDS if replica.state != S.STARTING else 0.4
        if time.monotonic() - self.last_health.get(replica.pk, 0) < interval:
            return
        self.last_health[replica.pk] = time.monotonic()
        ok, detail = check_ready(replica)
        if replica.state == S.STARTING:
            if ok:
                Replica.objects.filter(pk=replica.pk).update(
                    state=S.READY,
                    ready_at=now,
                    last_health_at=now,
                    crashes_in_a_row=0,
                    health_failures=0,
                    state_reason="",
                )
                took = (now - replica.started_at).total_seconds() if replica.started_at else 0
                event(endpoint.pk, "ready", f"ready after {took:.1f} s", replica=replica.index)
            elif (
                replica.started_at
                and (now - replica.started_at).total_seconds() > settings.ENDPOINT_START_TIMEOUT_SECONDS
            ):
                # A start that hangs (an HCCL rendezvous, a stuck compile) counts as a crash: backed off, and
                # given up after ENDPOINT_MAX_CRASHES, not started again at once for ever.
                self.terminate(replica, proc, supervisor=supervisor, reason="start timeout")
                self.crashed(
                    replica,
                    supervisor=supervisor,
                    now=now,
                    why=f"not ready within {settings.ENDPOINT_START_TIMEOUT_SECONDS} s ({detail})",
                )
            return
        if ok:
            updates = {"last_health_at": now, "health_failures": 0}
            if replica.state != S.READY:
                updates.update(state=S.READY, state_reason="")
                event(endpoint.pk, "recovered", "health check passes again", replica=replica.index)
            elif replica.state_reason:  # e.g. the container runtime did not answer for a while
                updates.update(state_reason="")
            Replica.objects.filter(pk=replica.pk).update(**updates)
            self.maybe_scheduled_restart(replica, now)
            return
        failures = replica.health_failures + 1
        if failures >= settings.ENDPOINT_HEALTH_FAILURES:
            event(
                endpoint.pk,
                "unhealthy",
                f"{failures} failed health checks in a row ({detail}): restarting",
                replica=replica.index,
                level="error",
            )
            self.terminate(replica, proc, supervisor=supervisor, reason="unhealthy")
            Replica.objects.filter(pk=replica.pk).update(
                state=S.RESTARTING, health_failures=0, **NO_HANDLE, state_reason=f"unhealthy: {detail}"[:500]
            )
            return
        Replica.objects.filter(pk=replica.pk).update(
            state=S.DEGRADED, health_failures=failures, state_reason=f"health check failed: {detail}"[:500]
        )
        if replica.state != S.DEGRADED:  # the transition only: a failing check repeats every interval
            event(
                endpoint.pk,
                "degraded",
                f"health check failed ({detail}): out of routing; restarts after "
                f"{settings.ENDPOINT_HEALTH_FAILURES} failures in a row",
                replica=replica.index,
                level="warning",
            )

    def maybe_scheduled_restart(self, replica: Replica, now) -> None:
        """Restart replicas every N hours or daily at a set time (memory fragmentation), or to follow a
        change of the endpoint's profiling option, one at a time: only when every other replica of the
        endpoint is ready and none has a restart pending, so the endpoint keeps serving."""
        kind, reason = "scheduled-restart", scheduled_restart_due(replica.endpoint, replica.ready_at, now)
        if not reason:
            kind, reason = "profiling-restart", profiling_restart_due(replica)
        if not reason:
            kind, reason = "settings-restart", settings_restart_due(replica)
        if not reason:
            return
        others = Replica.objects.filter(endpoint=replica.endpoint, index__lt=replica.endpoint.replicas).exclude(
            pk=replica.pk
        )
        # A replica asked to restart is still READY until its agent stops it: without the second test
        # two replicas checked in one pass would both go.
        if others.exclude(state=S.READY).exists() or others.filter(restart_requested=True).exists():
            return
        if Replica.objects.filter(pk=replica.pk, restart_requested=False).update(restart_requested=True):
            event(replica.endpoint_id, kind, reason, replica=replica.index)
