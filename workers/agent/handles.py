"""What the agent is handed to run and what it hands back, whatever runs it: a ProcessSpec in, a
ProcessHandle out (a PID, or a container's name and id), Stopped at the end. The runtimes
(supervisor.ProcessRuntime, containers.ContainerRuntime) each implement Runtime."""

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

PROCESS = "process"


@dataclass(frozen=True)
class ProcessSpec:
    """What to run: argv (never a shell string), the child's whole environment, its log file. For a
    container runtime argv is the `docker run -d …` that starts it, named container_name."""

    argv: list[str]
    env: dict[str, str]
    log_path: Path
    cwd: str | None = None
    log_keep: int = 5  # rotated logs kept beside the live one
    runtime: str = PROCESS  # "process" | "docker" | "podman"
    container_name: str = ""


@dataclass(frozen=True)
class ProcessHandle:
    """A started replica. A process: PID, start time and command line (a PID alone may be reused). A
    container: its name and id (pid is the container's main process on this host, for telemetry).
    ``create_time``: seconds from the host's boot to the process's start (supervisor.started_since_boot); an
    epoch time in rows written by an agent before that; 0: not checked (a container)."""

    pid: int
    create_time: float
    argv: list[str] = field(default_factory=list)
    runtime: str = PROCESS
    container_name: str = ""
    container_id: str = ""
    log_path: str = ""  # a container's log follower writes here


@dataclass(frozen=True)
class Running:
    """A handle found alive, with what its runtime needs to stop it (psutil.Process, container facts)."""

    handle: ProcessHandle
    native: Any

    @property
    def pid(self) -> int:
        return self.handle.pid


class RuntimeUnavailable(RuntimeError):
    """The container runtime did not answer (daemon down, CLI missing): nothing is known about the
    replica, so it is neither crashed nor stopped; the workload retries on its next pass."""


class LeaseLost(RuntimeError):
    """This agent's lease on its node is gone (another agent runs it now): it may start or stop nothing more,
    even in the middle of a pass (Supervisor.fence); the pass ends and so does the agent."""


@dataclass(frozen=True)
class Stopped:
    exit_code: int | None  # None when an earlier agent started it (its exit code went to init)
    killed: bool  # it outlived the grace period and got SIGKILL


class Runtime(Protocol):
    def start(self, spec: ProcessSpec) -> ProcessHandle: ...

    def find(self, handle: ProcessHandle) -> Any | None:
        """What terminate() takes, if the handle's replica is still alive (re-adoption); else None."""

    def terminate(self, native: Any, *, grace: float) -> Stopped: ...

    def exit_code(self, handle: ProcessHandle) -> int | None: ...

    def reap(self, handle: ProcessHandle) -> None:
        """Remove what is left of a replica that ended by itself (children, a stopped container)."""

    def log_tail(self, handle: ProcessHandle, log_path: str, count: int = 200) -> str: ...
