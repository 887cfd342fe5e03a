"""The node agent: makes the processes on this host match the desired state in the database.

Modelled on healthchecks' sendalerts: a long-running loop, a SIGTERM flag, race-safe
`update()` writes. Replicas run in their own sessions, so the agent can stop, crash or be
upgraded without taking endpoints down; a new agent re-adopts them by PID, process start
time and command line."""
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from datetime import timedelta
from pathlib import Path

import psutil
from django.conf import settings
from django.db import IntegrityError, close_old_connections, transaction
from django.db.utils import DatabaseError
from django.utils import timezone

from endpoints.models import Endpoint, EndpointEvent, Replica
from workers.models import Node

log = logging.getLogger("console.agent")

# Variables of the console that an engine process must not inherit.
PRIVATE_ENV = {"DATABASE_URL", "SECRET_KEY", "SECRET_KEY_FILE", "CONSOLE_ADMIN_PASSWORD",
               "CONSOLE_ADMIN_PASSWORD_FILE", "DJANGO_SETTINGS_MODULE", "REDIS_URL"}
ACTIVE_STATES = {Endpoint.State.STARTING, Endpoint.State.READY, Endpoint.State.DEGRADED}


def nudge_channel(node_name: str) -> str:
    return f"console:agent:{node_name}"


def event(endpoint_id: int, kind: str, message: str, *, replica: int | None = None, level: str = "info") -> None:
    EndpointEvent.objects.create(endpoint_id=endpoint_id, replica_index=replica, kind=kind, message=message[:4000], level=level)
    log.log(logging.WARNING if level != "info" else logging.INFO, "[endpoint %s#%s] %s: %s", endpoint_id, replica, kind, message)


def tail_lines(path: str, count: int = 200) -> str:
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - 256 * 1024))
            return b"\n".join(handle.read().splitlines()[-count:]).decode(errors="replace")
    except OSError:
        return ""


def rotate_log(path: Path, keep: int) -> None:
    """replica.log -> replica.log.1 -> … -> .keep (oldest dropped). Called before each start."""
    if not path.exists():
        return
    for n in range(keep - 1, 0, -1):
        older = path.with_name(f"{path.name}.{n}")
        if older.exists():
            older.replace(path.with_name(f"{path.name}.{n + 1}"))
    path.replace(path.with_name(f"{path.name}.1"))


def rotate_if_large(path: str) -> None:
    """Copy-and-truncate a running replica's log past ENDPOINT_LOG_MAX_BYTES: the process keeps
    its descriptor (opened for append), so the live file must stay where it is."""
    try:
        if not path or os.path.getsize(path) <= settings.ENDPOINT_LOG_MAX_BYTES:
            return
        live = Path(path)
        for n in range(settings.ENDPOINT_LOG_KEEP - 1, 0, -1):
            older = live.with_name(f"{live.name}.{n}")
            if older.exists():
                older.replace(live.with_name(f"{live.name}.{n + 1}"))
        shutil.copyfile(live, live.with_name(f"{live.name}.1"))
        with open(live, "r+b") as handle:
            handle.truncate(0)
    except OSError as exc:
        log.warning("log rotation of %s failed: %s", path, exc)


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def claim_port(node: Node, replica: Replica) -> int:
    """Reserve a free port for the replica. The unique (port_host, port) constraint makes the
    claim race-safe between agents on the same host."""
    low, high = settings.ENDPOINT_PORT_RANGE
    taken = set(Replica.objects.filter(port_host=node.hostname, port__isnull=False).exclude(pk=replica.pk)
                .values_list("port", flat=True))
    for port in range(low, high + 1):
        if port in taken or not port_is_free(port, settings.ENDPOINT_BIND_HOST):
            continue
        try:
            with transaction.atomic():
                Replica.objects.filter(pk=replica.pk).update(port=port, port_host=node.hostname)
            return port
        except IntegrityError:
            continue  # another agent claimed it a moment ago
    raise RuntimeError(f"No free port in {low}-{high} on {node.name}")


def http_get_json(url: str, timeout: float = 3.0):
    with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 (our own replica URL)
        body = response.read()
        return response.status, (json.loads(body) if body else None)


def check_ready(replica: Replica) -> tuple[bool, str]:
    """Ready = /health answers 200 and /v1/models lists the served name."""
    base = f"http://{settings.ENDPOINT_BIND_HOST}:{replica.port}"
    try:
        status, _ = http_get_json(base + "/health")
        if status != 200:
            return False, f"/health answered {status}"
        status, models = http_get_json(base + "/v1/models")
        names = {m.get("id") for m in (models or {}).get("data", [])}
        if replica.endpoint.served_model_name not in names:
            return False, f"/v1/models lists {sorted(names)}, not {replica.endpoint.served_model_name}"
        return True, "ok"
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return False, f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}"


def reap_process_group(pgid: int) -> None:
    """Kill what is left of a replica's process group. When vLLM's API server dies (kill -9,
    OOM), its engine-core and worker children live on holding the model's memory; the
    replica ran in its own session, so its PID is the group id."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


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


def aggregate_state(endpoint: Endpoint) -> tuple[str, str]:
    states = list(endpoint.replica_set.values_list("state", flat=True))
    S = Endpoint.State
    if endpoint.desired_state == Endpoint.Desired.STOPPED:
        if all(s in (S.STOPPED, S.FAILED, S.PENDING) for s in states):
            return S.STOPPED, ""
        return S.STOPPING, ""
    if not states:
        return S.PENDING, "no replicas"
    if all(s == S.READY for s in states):
        return S.READY, ""
    if any(s == S.READY for s in states):
        return S.DEGRADED, f"{states.count(S.READY)} of {len(states)} replicas ready"
    if all(s == S.FAILED for s in states):
        return S.FAILED, "every replica failed"
    for s in (S.RESTARTING, S.CRASHED, S.STARTING, S.DEGRADED, S.STOPPING, S.FAILED, S.PENDING):
        if s in states:
            return s, ""
    return S.PENDING, ""


def refresh_endpoint_state(endpoint: Endpoint) -> None:
    state, reason = aggregate_state(endpoint)
    if state == Endpoint.State.PENDING and not endpoint.node.online:
        reason = f"waiting for the agent of node {endpoint.node.name} (offline)"
    Endpoint.objects.filter(pk=endpoint.pk).update(state=state, state_reason=reason[:500])


class NodeAgent:
    def __init__(self, node_name: str, *, engine_python: str | None = None, address: str | None = None):
        self.node_name = node_name
        self.engine_python = engine_python or settings.ENGINE_PYTHON
        self.address = address or settings.NODE_ADDRESS
        self.children: dict[int, subprocess.Popen] = {}  # replica id -> process we started
        self.stopping = False
        self.node: Node | None = None
        self.last_heartbeat = 0.0
        self.last_devices = 0.0
        self.last_health: dict[int, float] = {}
        self._device_thread: threading.Thread | None = None
        self.busy = False

    # --- registration and heartbeat -----------------------------------------------------
    def register(self) -> Node:
        from workers.engine_info import cann_version, compat_warnings, detect_platform, probe_engine

        platform = detect_platform()
        engine = probe_engine(self.engine_python)
        cann = cann_version() if platform == "ascend" else None
        if cann:
            engine["cann"] = cann
        warnings = compat_warnings(engine, cann=cann) if platform == "ascend" else []
        if engine.get("error"):
            warnings.insert(0, engine["error"])
        now = timezone.now()
        node, _ = Node.objects.update_or_create(name=self.node_name, defaults={
            "hostname": socket.gethostname(), "address": self.address, "platform": platform,
            "engine_python": self.engine_python, "engine": engine, "compat_warnings": warnings,
            "agent_pid": os.getpid(), "agent_started_at": now, "last_heartbeat": now,
            "host": {"cpus": psutil.cpu_count(), "memory_bytes": psutil.virtual_memory().total},
        })
        self.node = node
        return node

    def heartbeat(self) -> None:
        Node.objects.filter(pk=self.node.pk).update(last_heartbeat=timezone.now(), agent_pid=os.getpid())
        self.node.last_heartbeat = timezone.now()

    def collect_telemetry(self) -> None:
        """Devices, host and endpoint readings. Runs off the main loop: a hung npu-smi or a
        slow /metrics must not stall reconciliation."""
        from workers.telemetry.collect import collect_node

        close_old_connections()
        try:
            collect_node(self.node)
        except Exception as exc:  # never let telemetry kill the agent
            log.exception("telemetry")
            Node.objects.filter(pk=self.node.pk).update(telemetry_error=f"{type(exc).__name__}: {exc}"[:2000])
        finally:
            close_old_connections()

    # --- processes ---------------------------------------------------------------------
    def process_of(self, replica: Replica) -> psutil.Process | None:
        """Our vLLM process for the replica, if it is still alive (same PID, start time and argv)."""
        if not replica.pid:
            return None
        try:
            proc = psutil.Process(replica.pid)
            if replica.pid_create_time and abs(proc.create_time() - replica.pid_create_time) > 0.05:
                return None  # the PID was reused by another process
            if proc.status() == psutil.STATUS_ZOMBIE:
                return None
            if replica.argv and proc.cmdline() != replica.argv:
                return None
            return proc
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return None

    def exit_code(self, replica: Replica) -> int | None:
        child = self.children.pop(replica.pk, None)
        if child is None:
            return None  # started by an earlier agent: its exit code went to init
        try:
            return child.wait(timeout=1)
        except subprocess.TimeoutExpired:
            return None

    def start(self, replica: Replica) -> None:
        from endpoints.commands import build_command
        from endpoints.services import launch_spec

        endpoint = replica.endpoint
        port = claim_port(self.node, replica)
        spec = launch_spec(endpoint=endpoint, replica=replica, node=self.node, port=port)
        argv, env_added = build_command(spec)
        log_path = Path(settings.DATA_DIR) / "logs" / "endpoints" / endpoint.name / f"replica-{replica.index}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        rotate_log(log_path, settings.ENDPOINT_LOG_KEEP)
        env = {k: v for k, v in os.environ.items() if k not in PRIVATE_ENV}
        env.update(env_added)
        with open(log_path, "ab") as log_file:
            log_file.write(f"# {timezone.now():%Y-%m-%d %H:%M:%S} started by agent {self.node_name}\n".encode())
            log_file.flush()
            child = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env, start_new_session=True, close_fds=True)
        self.children[replica.pk] = child
        create_time = psutil.Process(child.pid).create_time()
        now = timezone.now()
        Replica.objects.filter(pk=replica.pk).update(
            pid=child.pid, pid_create_time=create_time, argv=argv, env=env_added, port=port,
            state=Endpoint.State.STARTING, state_reason="", started_at=now, ready_at=None, next_start_at=None,
            stop_requested_at=None, restart_requested=False, health_failures=0, log_path=str(log_path),
            last_exit_code=None,
        )
        event(endpoint.pk, "started", f"pid {child.pid} on port {port}", replica=replica.index)

    def terminate(self, replica: Replica, proc: psutil.Process, *, reason: str) -> None:
        """SIGTERM to the process group, SIGKILL after the grace period; every descendant
        (vLLM's engine-core and workers) goes too."""
        grace = settings.ENDPOINT_STOP_GRACE_SECONDS
        try:
            tree = [proc] + proc.children(recursive=True)
        except psutil.NoSuchProcess:
            tree = [proc]
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
        for p in tree:
            try:
                p.terminate()
            except psutil.NoSuchProcess:
                pass
        child = self.children.get(replica.pk)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if child is not None:
                child.poll()  # reap, or the zombie counts as alive
            alive = [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
            if not alive:
                break
            time.sleep(0.1)
        else:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            for p in tree:
                try:
                    p.kill()
                except psutil.NoSuchProcess:
                    pass
            psutil.wait_procs(tree, timeout=5)
            event(replica.endpoint_id, "killed", f"did not stop within {grace:.0f} s: killed", replica=replica.index, level="warning")
        code = self.exit_code(replica)
        Replica.objects.filter(pk=replica.pk).update(last_exit_code=code)
        log.info("stopped %s (%s)", replica, reason)

    # --- reconciliation ----------------------------------------------------------------
    def reconcile(self) -> None:
        replicas = list(Replica.objects.filter(node=self.node).select_related("endpoint", "endpoint__artifact", "node"))
        # While a replica is starting, look twice a second: ready should show within ~0.5 s.
        self.busy = any(r.state in (Endpoint.State.STARTING, Endpoint.State.RESTARTING) for r in replicas)
        touched = set()
        for replica in replicas:
            try:
                self.reconcile_replica(replica)
            except IntegrityError:
                continue  # the endpoint was deleted while we worked on it
            except DatabaseError:
                raise
            except Exception as exc:  # one bad replica must not stop the others
                log.exception("reconcile %s", replica)
                Replica.objects.filter(pk=replica.pk).update(state=Endpoint.State.FAILED, state_reason=str(exc)[:500])
                event(replica.endpoint_id, "error", f"{type(exc).__name__}: {exc}", replica=replica.index, level="error")
            touched.add(replica.endpoint_id)
        for endpoint in Endpoint.objects.filter(pk__in=touched).select_related("node"):
            refresh_endpoint_state(endpoint)

    def reconcile_replica(self, replica: Replica) -> None:
        S = Endpoint.State
        endpoint = replica.endpoint
        wanted = endpoint.desired_state == Endpoint.Desired.RUNNING and replica.index < endpoint.replicas
        proc = self.process_of(replica)
        now = timezone.now()

        if not wanted:
            if proc is not None:
                Replica.objects.filter(pk=replica.pk).update(state=S.STOPPING, stop_requested_at=now)
                self.terminate(replica, proc, reason="stop requested")
                event(endpoint.pk, "stopped", "stopped on request", replica=replica.index)
            if replica.state != S.STOPPED or replica.pid:
                Replica.objects.filter(pk=replica.pk).update(state=S.STOPPED, pid=None, port=None, state_reason="",
                                                             crashes_in_a_row=0, next_start_at=None)
            return

        if proc is None and replica.pid:
            # It was running and is gone: a crash (or a kill from outside).
            code = self.exit_code(replica)
            reap_process_group(replica.pid)
            crashes = replica.crashes_in_a_row + 1
            last = tail_lines(replica.log_path)
            reason = next((line for line in reversed(last.splitlines()) if line.strip()), "no output")[:300]
            if crashes >= settings.ENDPOINT_MAX_CRASHES:
                Replica.objects.filter(pk=replica.pk).update(
                    state=S.FAILED, pid=None, crashes_in_a_row=crashes, last_exit_code=code, last_log=last,
                    state_reason=f"gave up after {crashes} crashes in a row; last: {reason}")
                event(endpoint.pk, "failed", f"gave up after {crashes} crashes in a row (exit code {code}): {reason}",
                      replica=replica.index, level="error")
                return
            delay = backoff_seconds(crashes)
            Replica.objects.filter(pk=replica.pk).update(
                state=S.RESTARTING, pid=None, crashes_in_a_row=crashes, last_exit_code=code, last_log=last,
                next_start_at=now + timedelta(seconds=delay),
                state_reason=f"crashed (exit code {code}); restarting in {delay:.0f} s")
            event(endpoint.pk, "crashed", f"process {replica.pid} exited (code {code}); restart in {delay:.0f} s: {reason}",
                  replica=replica.index, level="error")
            return

        if proc is None:
            if replica.state == S.FAILED and not replica.restart_requested:
                return  # given up: an operator's Start or Restart clears it
            if replica.next_start_at and replica.next_start_at > now:
                return
            if replica.state == S.RESTARTING or replica.restart_requested:
                Replica.objects.filter(pk=replica.pk).update(restarts=replica.restarts + 1)
            self.start(Replica.objects.select_related("endpoint", "endpoint__artifact", "node").get(pk=replica.pk))
            return

        # Running. An operator's restart, or a scheduled one, stops it; the next pass starts it.
        if replica.restart_requested:
            self.terminate(replica, proc, reason="restart requested")
            Replica.objects.filter(pk=replica.pk).update(state=S.RESTARTING, pid=None, next_start_at=None,
                                                         crashes_in_a_row=0, state_reason="restarting on request")
            event(endpoint.pk, "restarting", "restart requested", replica=replica.index)
            return

        rotate_if_large(replica.log_path)
        interval = settings.ENDPOINT_HEALTH_INTERVAL_SECONDS if replica.state != S.STARTING else 0.4
        if time.monotonic() - self.last_health.get(replica.pk, 0) < interval:
            return
        self.last_health[replica.pk] = time.monotonic()
        ok, detail = check_ready(replica)
        if replica.state == S.STARTING:
            if ok:
                Replica.objects.filter(pk=replica.pk).update(state=S.READY, ready_at=now, last_health_at=now,
                                                             crashes_in_a_row=0, health_failures=0, state_reason="")
                took = (now - replica.started_at).total_seconds() if replica.started_at else 0
                event(endpoint.pk, "ready", f"ready after {took:.1f} s", replica=replica.index)
            elif replica.started_at and (now - replica.started_at).total_seconds() > settings.ENDPOINT_START_TIMEOUT_SECONDS:
                self.terminate(replica, proc, reason="start timeout")
                Replica.objects.filter(pk=replica.pk).update(pid=None)  # next pass counts it as a crash
            return
        if ok:
            updates = {"last_health_at": now, "health_failures": 0}
            if replica.state != S.READY:
                updates.update(state=S.READY, state_reason="")
                event(endpoint.pk, "recovered", "health check passes again", replica=replica.index)
            Replica.objects.filter(pk=replica.pk).update(**updates)
            self.maybe_scheduled_restart(replica, now)
            return
        failures = replica.health_failures + 1
        if failures >= settings.ENDPOINT_HEALTH_FAILURES:
            event(endpoint.pk, "unhealthy", f"{failures} failed health checks in a row ({detail}): restarting",
                  replica=replica.index, level="error")
            self.terminate(replica, proc, reason="unhealthy")
            Replica.objects.filter(pk=replica.pk).update(state=S.RESTARTING, pid=None, health_failures=0,
                                                         state_reason=f"unhealthy: {detail}"[:500])
            return
        Replica.objects.filter(pk=replica.pk).update(state=S.DEGRADED, health_failures=failures,
                                                     state_reason=f"health check failed: {detail}"[:500])

    def maybe_scheduled_restart(self, replica: Replica, now) -> None:
        """Restart replicas every N hours or daily at a set time (memory fragmentation), one at a
        time: only when every other replica of the endpoint is ready, so the endpoint keeps serving."""
        reason = scheduled_restart_due(replica.endpoint, replica.ready_at, now)
        if not reason:
            return
        others = Replica.objects.filter(endpoint=replica.endpoint).exclude(pk=replica.pk)
        if others.exclude(state=Endpoint.State.READY).exists():
            return
        if Replica.objects.filter(pk=replica.pk, restart_requested=False).update(restart_requested=True):
            event(replica.endpoint_id, "scheduled-restart", reason, replica=replica.index)

    # --- the loop ----------------------------------------------------------------------
    def run(self, *, once: bool = False) -> None:
        self.register()
        log.info("agent %s up: platform %s, engine %s", self.node_name, self.node.platform, self.node.engine.get("vllm"))
        pubsub = None
        while not self.stopping:
            try:
                close_old_connections()
                if time.monotonic() - self.last_heartbeat >= settings.AGENT_HEARTBEAT_SECONDS:
                    self.heartbeat()
                    self.last_heartbeat = time.monotonic()
                if (time.monotonic() - self.last_devices >= settings.TELEMETRY_INTERVAL_SECONDS
                        and (self._device_thread is None or not self._device_thread.is_alive())):
                    self.last_devices = time.monotonic()
                    self._device_thread = threading.Thread(target=self.collect_telemetry, daemon=True)
                    self._device_thread.start()
                self.reconcile()
            except DatabaseError as exc:
                # The database is down for a while: keep the endpoints running, retry.
                log.warning("database unavailable (%s); endpoints keep running, retrying", exc)
                close_old_connections()
            if once:
                return
            pubsub = self.wait_for_nudge(pubsub)

    def wait_for_nudge(self, pubsub):
        """Sleep until the reconcile interval passes or someone publishes a nudge."""
        interval = 0.5 if self.busy else settings.AGENT_RECONCILE_SECONDS
        try:
            if pubsub is None:
                import django_rq

                pubsub = django_rq.get_connection("default").pubsub(ignore_subscribe_messages=True)
                pubsub.subscribe(nudge_channel(self.node_name))
            deadline = time.monotonic() + interval
            while not self.stopping and time.monotonic() < deadline:
                if pubsub.get_message(timeout=min(0.5, max(deadline - time.monotonic(), 0.01))):
                    break
            return pubsub
        except Exception as exc:  # Redis down: fall back to plain polling
            log.debug("nudges unavailable: %s", exc)
            time.sleep(interval)
            return None
