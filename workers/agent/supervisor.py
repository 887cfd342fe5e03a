"""The process supervisor: starts argvs in sessions of their own, finds them alive again after an
agent restart, stops whole process groups, and keeps their logs. It knows processes, not what
they serve: the workload that asked for a process decides what its exit or silence means."""
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from django.utils import timezone

log = logging.getLogger("console.agent")


@dataclass(frozen=True)
class ProcessSpec:
    """What to run: argv (never a shell string), the child's whole environment, its log file."""
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    cwd: str | None = None
    log_keep: int = 5  # rotated logs kept beside the live one


@dataclass(frozen=True)
class ProcessHandle:
    """A started process, identified by PID, start time and command line (a PID alone may be reused)."""
    pid: int
    create_time: float
    argv: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Stopped:
    exit_code: int | None  # None when an earlier agent started it (its exit code went to init)
    killed: bool  # it outlived the grace period and got SIGKILL


def tail_lines(path: str, count: int = 200) -> str:
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - 256 * 1024))
            return b"\n".join(handle.read().splitlines()[-count:]).decode(errors="replace")
    except OSError:
        return ""


def _shift(live: Path, keep: int) -> None:
    for n in range(keep - 1, 0, -1):
        older = live.with_name(f"{live.name}.{n}")
        if older.exists():
            older.replace(live.with_name(f"{live.name}.{n + 1}"))


def rotate_log(path: Path, keep: int) -> None:
    """replica.log -> replica.log.1 -> … -> .keep (oldest dropped). Called before each start."""
    if not path.exists():
        return
    _shift(path, keep)
    path.replace(path.with_name(f"{path.name}.1"))


def rotate_if_large(path: str, *, max_bytes: int, keep: int) -> None:
    """Copy-and-truncate a running process's log past max_bytes: the process keeps its
    descriptor (opened for append), so the live file must stay where it is."""
    try:
        if not path or os.path.getsize(path) <= max_bytes:
            return
        live = Path(path)
        _shift(live, keep)
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


def reap_process_group(pgid: int) -> None:
    """Kill what is left of a process group. When vLLM's API server dies (kill -9, OOM), its
    engine-core and worker children live on holding the model's memory; the process ran in
    its own session, so its PID is the group id."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class Supervisor:
    def __init__(self, owner: str):
        self.owner = owner  # the agent's node name, written into each log
        self.children: dict[int, subprocess.Popen] = {}  # pid -> a process this agent started

    def start(self, spec: ProcessSpec) -> ProcessHandle:
        spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        rotate_log(spec.log_path, spec.log_keep)
        with open(spec.log_path, "ab") as log_file:
            log_file.write(f"# {timezone.now():%Y-%m-%d %H:%M:%S} started by agent {self.owner}\n".encode())
            log_file.flush()
            child = subprocess.Popen(spec.argv, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=spec.env, cwd=spec.cwd, start_new_session=True, close_fds=True)
        self.children[child.pid] = child
        return ProcessHandle(pid=child.pid, create_time=psutil.Process(child.pid).create_time(), argv=list(spec.argv))

    def find(self, handle: ProcessHandle) -> psutil.Process | None:
        """The process, if it is still alive (same PID, start time and argv): re-adoption."""
        if not handle.pid:
            return None
        try:
            proc = psutil.Process(handle.pid)
            if handle.create_time and abs(proc.create_time() - handle.create_time) > 0.05:
                return None  # the PID was reused by another process
            if proc.status() == psutil.STATUS_ZOMBIE:
                return None
            if handle.argv and proc.cmdline() != handle.argv:
                return None
            return proc
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return None

    def exit_code(self, pid: int) -> int | None:
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
            alive = [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
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
        return Stopped(exit_code=self.exit_code(proc.pid), killed=killed)
