"""The agent's supervisor: starts replicas, finds them alive again after an agent restart, stops
them and keeps their logs, through the runtime each one names: a process of the engine venv
(ProcessRuntime, here: its own session, the whole process group stopped) or a container
(containers.ContainerRuntime: Docker or Podman). It knows processes and containers, not what they
serve: the workload that asked for one decides what its exit or silence means."""

import logging
import os
import signal
import socket
import subprocess
import time

import psutil
from django.utils import timezone

from workers.agent.containers import ContainerRuntime
from workers.agent.handles import (
    PROCESS,
    LeaseLost,
    ProcessHandle,
    ProcessSpec,
    Running,
    Runtime,
    RuntimeUnavailable,
    Stopped,
)
from workers.agent.logfiles import rotate_if_large, rotate_log, tail_lines

__all__ = [
    "ProcessHandle",
    "ProcessRuntime",
    "ProcessSpec",
    "Running",
    "RuntimeUnavailable",
    "Stopped",
    "Supervisor",
    "port_is_free",
    "reap_process_group",
    "rotate_if_large",
    "rotate_log",
    "stop_strays",
    "tail_lines",
]

log = logging.getLogger("console.agent")


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def reap_process_group(pgid: int) -> None:
    """Kill what is left of a process group. When vLLM's API server dies (kill -9, OOM), its
    engine-core and worker children live on holding the model's memory; the process ran in
    its own session, so its PID is the group id."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def stop_strays(spec: ProcessSpec) -> list[int]:
    """Kill (with their process groups) the processes an earlier start of this spec left unrecorded: an agent
    killed between starting a process and writing its PID (or a database write that failed then) leaves one
    running that the next start would run beside, on the same devices and port, never reaped. Known by what
    only such a start makes: the leader of its own session (start_new_session), in this spec's working
    directory (one per replica, or per member: endpoints.launch.make_work_dir), running this spec's
    executable. Returns their PIDs."""
    strays = []
    for proc in psutil.process_iter(["pid", "cwd", "cmdline"]):
        info = proc.info
        if info["cwd"] != spec.cwd or (info["cmdline"] or [])[:1] != spec.argv[:1]:
            continue
        try:
            if os.getsid(info["pid"]) != info["pid"]:
                continue
        except ProcessLookupError:
            continue
        reap_process_group(info["pid"])
        strays.append(proc)
        log.warning(
            "killed pid %s, an engine process left running in %s by an earlier start that was never "
            "recorded (the agent stopped in between)",
            info["pid"],
            spec.cwd,
        )
    psutil.wait_procs(strays, timeout=10)
    return [p.pid for p in strays]


#: A recorded start time above this is an epoch time (an agent before started_since_boot), not seconds from boot.
_EPOCH_RECORDED = 1e9


def started_since_boot(pid: int) -> float:
    """Seconds from the host's boot to the process's start (/proc/<pid>/stat field 22, in clock ticks). psutil's
    create_time() adds /proc/stat's btime, which moves whenever the wall clock is stepped (NTP at boot, a VM
    migration, `date -s`): a process compared by it looks replaced, and was taken for a crash and killed."""
    with open(f"/proc/{pid}/stat", "rb") as stat_file:
        fields = stat_file.read().rsplit(b")", 1)[1].split()  # after the command name, which may hold spaces
    return int(fields[19]) / os.sysconf("SC_CLK_TCK")  # fields[0] is field 3 (state): field 22 is fields[19]


def _same_start(pid: int, recorded: float) -> bool:
    if recorded > _EPOCH_RECORDED:  # an older agent's row: through today's boot time, with a clock step's slack
        return abs((recorded - psutil.boot_time()) - started_since_boot(pid)) <= 2.0
    return abs(recorded - started_since_boot(pid)) <= 0.05  # ticks are 10 ms


def _wait_for_exec(child: subprocess.Popen, timeout: float = 2.0) -> None:
    """Popen returns when the exec has closed the child's close-on-exec pipe, a moment before the kernel has set
    up the new program's arguments: /proc/<pid>/cmdline reads empty then, and a find() in that moment took the new
    replica for another process (seen on a loaded CI machine: docs/ci.md)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and child.poll() is None:
        try:
            if psutil.Process(child.pid).cmdline():
                return
        except psutil.Error:
            return  # gone (its exit code tells) or not ours to read: find() answers for it
        time.sleep(0.005)


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:  # gone between the two questions
        return False


class ProcessRuntime:
    """Replicas as processes of the engine venv, each in a session of its own."""

    def __init__(self, owner: str):
        self.owner = owner  # the agent's node name, written into each log
        self.children: dict[int, subprocess.Popen] = {}  # pid -> a process this agent started

    def start(self, spec: ProcessSpec) -> ProcessHandle:
        if spec.cwd:
            stop_strays(spec)
        spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        rotate_log(spec.log_path, spec.log_keep)
        with open(spec.log_path, "ab") as log_file:
            log_file.write(f"# {timezone.now():%Y-%m-%d %H:%M:%S} started by agent {self.owner}\n".encode())
            log_file.flush()
            child = subprocess.Popen(
                spec.argv,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=spec.env,
                cwd=spec.cwd,
                start_new_session=True,
                close_fds=True,
            )
        self.children[child.pid] = child
        _wait_for_exec(child)
        return ProcessHandle(pid=child.pid, create_time=started_since_boot(child.pid), argv=list(spec.argv))

    def find(self, handle: ProcessHandle) -> psutil.Process | None:
        """The process, if it is still alive (same PID, start time and argv): re-adoption."""
        if not handle.pid:
            return None
        try:
            proc = psutil.Process(handle.pid)
            if handle.create_time and not _same_start(handle.pid, handle.create_time):
                return None  # the PID was reused by another process
            if proc.status() == psutil.STATUS_ZOMBIE:
                return None
            if handle.argv and proc.cmdline() != handle.argv:
                return None
            return proc
        except (psutil.NoSuchProcess, psutil.AccessDenied, FileNotFoundError, ProcessLookupError):
            return None

    def exit_code(self, handle: ProcessHandle) -> int | None:
        return self._exit_code(handle.pid)

    def reap(self, handle: ProcessHandle) -> None:
        """Kill what is left of the handle's process group (vLLM's engine core outlives its API server). A PID
        held by a process of another start time (reused: after a reboot, or long after) leads a group that is
        not ours: Linux gives no process a PID while a group of that id lives, so ours is gone then. Our own
        leader may still hold it as a zombie (a host whose init does not reap it): same start, so ours."""
        if not handle.pid:
            return
        if handle.create_time and handle.pid not in self.children and psutil.pid_exists(handle.pid):
            try:
                ours = _same_start(handle.pid, handle.create_time)
            except (FileNotFoundError, ProcessLookupError):
                ours = True  # gone meanwhile: no other process holds the id
            if not ours:
                log.warning("pid %s is another process now: its process group is left alone", handle.pid)
                return
        reap_process_group(handle.pid)

    def log_tail(self, handle: ProcessHandle, log_path: str, count: int = 200) -> str:
        return tail_lines(log_path, count)

    def _exit_code(self, pid: int) -> int | None:
        child = self.children.pop(pid, None)
        if child is None:
            return None  # started by an earlier agent: its exit code went to init
        try:
            return child.wait(timeout=1)
        except subprocess.TimeoutExpired:
            return None

    def terminate(self, proc: psutil.Process, *, grace: float) -> Stopped:
        """SIGTERM to the process group, SIGKILL after the grace period; every descendant
        (vLLM's engine-core and workers) goes too."""
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
        child = self.children.get(proc.pid)
        killed = False
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if child is not None:
                child.poll()  # reap, or the zombie counts as alive
            alive = [p for p in tree if _alive(p)]
            if not alive:
                break
            time.sleep(0.1)
        else:
            killed = True
            reap_process_group(proc.pid)
            for p in tree:
                try:
                    p.kill()
                except psutil.NoSuchProcess:
                    pass
            psutil.wait_procs(tree, timeout=5)
        return Stopped(exit_code=self._exit_code(proc.pid), killed=killed)


class Supervisor:
    """The one object the agent hands its workloads: each call goes to the runtime the spec or handle
    names, so a workload treats processes and containers alike."""

    def __init__(self, owner: str):
        self.owner = owner
        self.fenced = False
        self.runtimes: dict[str, Runtime] = {PROCESS: ProcessRuntime(owner)}
        for name in ContainerRuntime.BINARIES:
            self.runtimes[name] = ContainerRuntime(name, owner=owner)

    def runtime(self, name: str) -> Runtime:
        try:
            return self.runtimes[name or PROCESS]
        except KeyError:
            raise ValueError(f"unknown engine runtime {name!r}: one of {', '.join(self.runtimes)}") from None

    def fence(self) -> None:
        """The agent lost its lease: from now on every start and stop raises LeaseLost (a pass under way, or one
        blocked past AGENT_PASS_STUCK_SECONDS, would otherwise start replicas beside the new agent's and stop
        what it runs)."""
        self.fenced = True

    def _unfenced(self) -> None:
        if self.fenced:
            raise LeaseLost(
                f"agent {self.owner} no longer holds its node's lease: starting and stopping are the new agent's"
            )

    def start(self, spec: ProcessSpec) -> ProcessHandle:
        self._unfenced()
        return self.runtime(spec.runtime).start(spec)

    def find(self, handle: ProcessHandle) -> Running | None:
        """The replica, if it is still alive (re-adoption after an agent restart)."""
        native = self.runtime(handle.runtime).find(handle)
        return None if native is None else Running(handle, native)

    def terminate(self, running: Running, *, grace: float) -> Stopped:
        self._unfenced()
        return self.runtime(running.handle.runtime).terminate(running.native, grace=grace)

    def exit_code(self, handle: ProcessHandle) -> int | None:
        return self.runtime(handle.runtime).exit_code(handle)

    def reap(self, handle: ProcessHandle) -> None:
        self.runtime(handle.runtime).reap(handle)

    def log_tail(self, handle: ProcessHandle, log_path: str, count: int = 200) -> str:
        return self.runtime(handle.runtime).log_tail(handle, log_path, count)
