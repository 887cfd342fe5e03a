"""The members of multi-node replicas, on the node whose agent runs them: `ray start --head` and
`ray start --address` for a Ray replica, a headless `vllm serve` for each other node of a data-parallel
one. What waits for what: the head node claims the replica's rendezvous port first; Ray workers
start once the Ray head is up; the replica's vLLM server on the head starts once every Ray node is in
the cluster (data-parallel ranks need no order: the server waits for its engines itself). A member
that dies is restarted with the replicas' backoff (failed starts count towards giving up; a node that was up
always comes back), and the server it served is restarted with it."""

import logging
from datetime import timedelta

from django.conf import settings
from django.db.utils import DatabaseError
from django.utils import timezone

from endpoints.engine_log import root_cause
from endpoints.launch import (
    EngineRefused,
    make_engine_cache_dir,
    make_profile_dir,
    make_work_dir,
    member_process,
    member_work_dir,
    recorded_log,
)
from endpoints.models import Endpoint, Replica, ReplicaMember
from endpoints.ports import claim_port
from endpoints.replica_state import DB_AWAY, ENGINE_REFUSED, backoff_seconds, event, stop_unowned
from workers import nudges
from workers.agent.handles import PROCESS
from workers.agent.supervisor import LeaseLost, ProcessHandle, Supervisor, rotate_if_large, tail_lines
from workers.models import Node

log = logging.getLogger("console.agent")
S = Endpoint.State
Role = ReplicaMember.Role

# `ray start` prints this once its node is registered with the cluster's GCS (ray/_private/node.py
# waits in services.wait_for_node before ray/scripts/scripts.py prints it; Ray 2.48).
RAY_STARTED = "Ray runtime started."
RUNNING = (S.STARTING, S.READY, S.DEGRADED)


def member_handle(member: ReplicaMember) -> ProcessHandle:
    """Members always run as processes of the node's engine venv (endpoints.launch.member_process)."""
    return ProcessHandle(
        pid=member.pid or 0,
        create_time=member.pid_create_time or 0.0,
        argv=list(member.argv or []),
        runtime=PROCESS,
        log_path=recorded_log(member.log_path),
    )


def cluster_wait(replica: Replica, node: Node) -> str:
    """Why the replica's vLLM server must not start yet on its head node, or "" when it may. Claims the
    rendezvous port the members need first."""
    if not replica.endpoint.distributed:
        return ""
    if replica.cluster_port is None:
        replica.cluster_port = claim_port(node, replica, field="cluster_port")
        nudge_members(replica)
    if replica.endpoint.distributed != Endpoint.Distributed.RAY:
        return ""
    members = list(replica.members.select_related("node"))
    down = [m for m in members if m.state != S.READY]
    if not down:
        return ""
    return (
        f"waiting for the Ray cluster: {len(members) - len(down)} of {len(members)} nodes up ("
        + ", ".join(f"{m.role} on {m.node.name}: {m.state}" for m in down)
        + ")"
    )


def member_refused(replica: Replica) -> str:
    """Why the replica cannot start because a member's node refused its part (its vLLM parser), or ""."""
    member = replica.members.filter(state=S.FAILED, state_reason__startswith=ENGINE_REFUSED).first()
    return f"{member.role}: {member.state_reason}" if member else ""


def release_cluster_port(replica: Replica) -> None:
    """A stopped replica gives its rendezvous port back once no member runs on it any more."""
    if replica.cluster_port is not None and not replica.members.filter(pid__isnull=False).exists():
        Replica.objects.filter(pk=replica.pk).update(cluster_port=None)


def nudge_members(replica: Replica) -> None:
    for name in {m.node.name for m in replica.members.select_related("node")} | {replica.node.name}:
        nudges.publish(name)


def _waits_for(member: ReplicaMember) -> str:
    replica = member.replica
    if replica.cluster_port is None:
        return f"waiting for node {replica.node.name} to claim the replica's port"
    if member.role == Role.RAY_WORKER:
        head = replica.members.filter(role=Role.RAY_HEAD).first()
        if head is None or head.state != S.READY:
            return f"waiting for the Ray head on node {replica.node.name}"
    return ""


def _is_ready(member: ReplicaMember) -> bool:
    if member.role == Role.DP_HEADLESS:
        # The head's API server answers only once every engine of the group has joined it.
        return Replica.objects.filter(pk=member.replica_id, state=S.READY).exists()
    return RAY_STARTED in tail_lines(recorded_log(member.log_path))


def _joined_an_older_head(member: ReplicaMember) -> bool:
    """A Ray worker that joined a head which has since restarted belongs to a cluster that is gone."""
    if member.role != Role.RAY_WORKER or not member.started_at:
        return False
    head = member.replica.members.filter(role=Role.RAY_HEAD).first()
    return bool(head and head.started_at and head.started_at > member.started_at)


class MemberReconciler:
    """Runs, watches and stops this node's members; called by ReplicaWorkload on every agent tick."""

    def reconcile(self, *, node: Node, supervisor: Supervisor) -> tuple[set[int], bool]:
        """(the endpoints touched, whether a member is starting)."""
        members = list(
            ReplicaMember.objects.filter(node=node).select_related(
                "replica", "replica__endpoint", "replica__endpoint__artifact", "replica__node", "node"
            )
        )
        touched = set()
        for member in members:
            try:
                self.reconcile_member(member, supervisor=supervisor)
            except (*DB_AWAY, LeaseLost):
                raise  # the agent's loop waits for the database (the processes keep running), or ends
            except DatabaseError:  # one row's write refused: the other members go on
                log.exception("reconcile %s: a database write failed", member)
            except Exception as exc:  # one bad member must not stop the others
                log.exception("reconcile %s", member)
                ReplicaMember.objects.filter(pk=member.pk).update(state=S.FAILED, state_reason=str(exc)[:500])
                event(
                    member.replica.endpoint_id,
                    "error",
                    f"{member.role} on {node.name}: {type(exc).__name__}: {exc}",
                    replica=member.replica.index,
                    level="error",
                )
            touched.add(member.replica.endpoint_id)
        starting = ReplicaMember.objects.filter(node=node, state=S.STARTING).exists()
        return touched, starting

    def reconcile_member(self, member: ReplicaMember, *, supervisor: Supervisor) -> None:
        replica, endpoint = member.replica, member.replica.endpoint
        # A replica held failed (a refused start, here or on another node, or given up) runs no server that
        # needs its members: a Ray head and its workers would hold their ports, memory and devices' processes
        # until an operator's Start or Restart.
        wanted = replica.wanted and not replica.held_failed
        proc = supervisor.find(member_handle(member))
        now = timezone.now()
        if not wanted:
            if proc is not None:
                self.terminate(member, proc, supervisor=supervisor)
                why = f": its replica failed: {replica.state_reason}" if replica.held_failed else " on request"
                event(
                    endpoint.pk,
                    "member-stopped",
                    f"{member.role} on {member.node.name} stopped{why}",
                    replica=replica.index,
                )
            if replica.held_failed and member.state == S.FAILED and not member.pid:
                return  # its own refusal or give-up stays on the page
            if member.state != S.STOPPED or member.pid:
                ReplicaMember.objects.filter(pk=member.pk).update(
                    state=S.STOPPED, pid=None, state_reason="", crashes_in_a_row=0, next_start_at=None
                )
            return
        if proc is None and member.pid:
            self.crashed(member, supervisor=supervisor, now=now)
            return
        if proc is None:
            self.maybe_start(member, supervisor=supervisor, now=now)
            return
        if _joined_an_older_head(member):
            self.terminate(member, proc, supervisor=supervisor)
            ReplicaMember.objects.filter(pk=member.pk).update(
                state=S.RESTARTING,
                pid=None,
                next_start_at=None,
                state_reason="the Ray head restarted: joining it again",
            )
            event(
                endpoint.pk,
                "member-restarting",
                f"{member.role} on {member.node.name}: the Ray head restarted",
                replica=replica.index,
            )
            return
        # A member runs as long as its replica (`ray start --block`, a headless rank): its log is rotated as it runs.
        rotate_if_large(
            recorded_log(member.log_path), max_bytes=settings.ENDPOINT_LOG_MAX_BYTES, keep=settings.ENDPOINT_LOG_KEEP
        )
        if member.state != S.READY and _is_ready(member):
            ReplicaMember.objects.filter(pk=member.pk).update(
                state=S.READY, ready_at=now, state_reason="", crashes_in_a_row=0
            )
            took = (now - member.started_at).total_seconds() if member.started_at else 0
            event(
                endpoint.pk,
                "member-ready",
                f"{member.role} on {member.node.name} up after {took:.1f} s",
                replica=replica.index,
            )
            nudge_members(replica)  # the head's server may be waiting for it

    def maybe_start(self, member: ReplicaMember, *, supervisor: Supervisor, now) -> None:
        if member.state == S.FAILED:
            return  # given up: the endpoint's Start or Restart clears it
        if member.next_start_at and member.next_start_at > now:
            return
        why = _waits_for(member)
        if why:
            if member.state_reason != why or member.state not in (S.PENDING, S.RESTARTING):
                ReplicaMember.objects.filter(pk=member.pk).update(
                    state=S.RESTARTING if member.state == S.RESTARTING else S.PENDING, state_reason=why
                )
            return
        try:
            spec, env_added = member_process(member)
        except EngineRefused as exc:
            self.refuse_start(member, str(exc))
            return
        if member.role == ReplicaMember.Role.DP_HEADLESS:  # a vLLM of the replica: its workers profile here
            make_profile_dir(member.replica)
            make_engine_cache_dir(member.node)
        make_work_dir(member_work_dir(member))
        handle = supervisor.start(spec)
        restarts = member.restarts + (1 if member.state == S.RESTARTING else 0)
        recorded = ReplicaMember.objects.filter(pk=member.pk).update(
            pid=handle.pid,
            pid_create_time=handle.create_time,
            argv=handle.argv,
            env=env_added,
            log_path=str(spec.log_path),
            state=S.STARTING,
            state_reason="",
            started_at=now,
            ready_at=None,
            next_start_at=None,
            last_exit_code=None,
            restarts=restarts,
        )
        if not recorded:  # the endpoint was deleted during the start: nothing else would ever stop it
            stop_unowned(handle, supervisor=supervisor, what=f"{member.role} of {member.replica} (pid {handle.pid})")
            return
        event(
            member.replica.endpoint_id,
            "member-started",
            f"{member.role} on {member.node.name}: pid {handle.pid}",
            replica=member.replica.index,
        )

    def refuse_start(self, member: ReplicaMember, reason: str) -> None:
        """This node's vLLM no longer knows the member's flags: failed, and the replica's server, which
        cannot run without it, is stopped (if it runs) and held failed by its own agent (member_refused)."""
        replica = member.replica
        ReplicaMember.objects.filter(pk=member.pk).update(state=S.FAILED, state_reason=reason[:500], next_start_at=None)
        event(replica.endpoint_id, "start-refused", f"{member.role}: {reason}", replica=replica.index, level="error")
        Replica.objects.filter(pk=replica.pk, pid__isnull=False, state__in=RUNNING).update(restart_requested=True)
        nudge_members(replica)

    def terminate(self, member: ReplicaMember, proc, *, supervisor: Supervisor) -> None:
        stopped = supervisor.terminate(proc, grace=settings.ENDPOINT_STOP_GRACE_SECONDS)
        supervisor.reap(member_handle(member))  # Ray's daemons (raylet, GCS, workers) share the member's process group
        ReplicaMember.objects.filter(pk=member.pk).update(last_exit_code=stopped.exit_code)

    def crashed(self, member: ReplicaMember, *, supervisor: Supervisor, now) -> None:
        """The member's process is gone (a Ray node died, a rank crashed): back off and start it again, and
        restart the replica's server, whose Ray workers or engines ran on it."""
        replica, endpoint = member.replica, member.replica.endpoint
        handle = member_handle(member)
        code = supervisor.exit_code(handle)
        last = supervisor.log_tail(handle, handle.log_path)
        supervisor.reap(handle)
        reason = (
            root_cause(last) or next((line for line in reversed(last.splitlines()) if line.strip()), "no output")
        )[:300]
        # A node that was up and died (a lost host, the OOM killer) always comes back; only failed starts
        # count towards giving up, so a member that cannot start at all stops being retried.
        was_up = member.state == S.READY
        crashes = member.crashes_in_a_row + (0 if was_up else 1)
        what = f"{member.role} on {member.node.name}"
        if not was_up and crashes >= settings.ENDPOINT_MAX_CRASHES:
            ReplicaMember.objects.filter(pk=member.pk).update(
                state=S.FAILED,
                pid=None,
                crashes_in_a_row=crashes,
                last_exit_code=code,
                last_log=last,
                state_reason=f"gave up after {crashes} crashes in a row; last: {reason}"[:500],
            )
            event(
                endpoint.pk,
                "member-failed",
                f"{what}: gave up after {crashes} crashes in a row (exit code {code}): {reason}",
                replica=replica.index,
                level="error",
            )
        else:
            delay = backoff_seconds(max(crashes, 1))
            ReplicaMember.objects.filter(pk=member.pk).update(
                state=S.RESTARTING,
                pid=None,
                crashes_in_a_row=crashes,
                last_exit_code=code,
                last_log=last,
                next_start_at=now + timedelta(seconds=delay),
                state_reason=f"crashed (exit code {code}); restarting in {delay:.0f} s: {reason}"[:500],
            )
            event(
                endpoint.pk,
                "member-crashed",
                f"{what}: process {member.pid} exited (code {code}); restart in {delay:.0f} s: {reason}",
                replica=replica.index,
                level="error",
            )
        # The server's workers on that node are gone with it: start it again once the cluster is whole.
        if Replica.objects.filter(pk=replica.pk, pid__isnull=False, state__in=RUNNING).update(restart_requested=True):
            event(
                endpoint.pk,
                "restarting",
                f"{what} crashed: the server restarts once every node is back",
                replica=replica.index,
                level="warning",
            )
        nudge_members(replica)
