"""Replicas in containers (Docker or Podman), run, found again and stopped as the process runtime does
processes: the container's name and id stand in for the PID. The workload hands over the whole
`docker run -d …` argv (endpoints.commands builds it); this module only runs the CLI.

- start: a leftover container under the replica's name is removed, `run -d` prints the id, and a
  `logs --follow` process (its own session, like a replica process) copies the container's output
  into the replica's log file, so the log tail, rotation and the endpoint page work as for a process.
- find (every pass; re-adoption after an agent restart): `inspect` by name, the same id, running.
  A follower the last agent started keeps running; if none is left, a new one follows from now.
- stop: `stop --time GRACE` (SIGTERM, SIGKILL after the grace), the exit code from `inspect`, then
  `rm -f`. A container that ended by itself keeps its exit code and logs until reap() removes it.

Both CLIs take the same commands and answer `inspect` with the same JSON keys used here (Id, Name,
State.Running/Pid/ExitCode)."""

import json
import logging
import math
import os
import subprocess
import time

import psutil
from django.utils import timezone

from workers.agent.handles import ProcessHandle, ProcessSpec, RuntimeUnavailable, Stopped
from workers.agent.logfiles import rotate_log, tail_lines
from workers.container_cli import client_environment

log = logging.getLogger("console.agent")


class ContainerRuntime:
    BINARIES = ("docker", "podman")
    CLI_TIMEOUT = 60.0
    RUN_TIMEOUT = 180.0  # `run` creates the container (the image is never pulled here: --pull=never)

    def __init__(self, binary: str, *, owner: str):
        self.binary = binary
        self.owner = owner  # the agent's node name, written into each log
        self.followers: dict[str, subprocess.Popen | psutil.Process] = {}  # container name -> its log follower

    # --- the CLI -------------------------------------------------------------------------
    def _env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        return client_environment(base)

    def _cli(
        self,
        *args: str,
        timeout: float | None = None,
        env: dict[str, str] | None = None,
    ) -> subprocess.CompletedProcess:
        argv = [self.binary, *args]
        try:
            return subprocess.run(
                argv,
                capture_output=True,
                text=True,
                stdin=subprocess.DEVNULL,
                timeout=timeout or self.CLI_TIMEOUT,
                env=env or self._env(),
            )
        except FileNotFoundError:
            raise RuntimeUnavailable(
                f"{self.binary} is not on this node's PATH: install it, or set the node's "
                "engine runtime back to process"
            ) from None
        except subprocess.TimeoutExpired:
            waited = timeout or self.CLI_TIMEOUT
            raise RuntimeUnavailable(f"`{self.binary} {args[0]}` did not answer within {waited:.0f} s") from None

    @staticmethod
    def _said(result: subprocess.CompletedProcess) -> str:
        lines = (result.stderr or result.stdout or "").strip().splitlines()
        return lines[-1] if lines else f"exit status {result.returncode}"

    def inspect(self, name: str) -> dict | None:
        """The container's facts, None when there is no container of that name."""
        result = self._cli("inspect", "--type", "container", name)
        if result.returncode != 0:
            if "no such" in (result.stderr + result.stdout).lower():
                return None
            raise RuntimeUnavailable(f"`{self.binary} inspect {name}` failed: {self._said(result)}")
        try:
            found = json.loads(result.stdout or "[]")
        except ValueError:
            raise RuntimeUnavailable(f"`{self.binary} inspect {name}` answered something other than JSON") from None
        return found[0] if found else None

    # --- the log follower ----------------------------------------------------------------
    def _follow(self, name: str, log_path: str, *, from_now: bool) -> None:
        argv = [self.binary, "logs", "--follow", *(["--tail", "0"] if from_now else []), name]
        with open(log_path, "ab") as log_file:
            self.followers[name] = subprocess.Popen(
                argv,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self._env(),
                start_new_session=True,
                close_fds=True,
            )

    @staticmethod
    def _alive(follower) -> bool:
        if isinstance(follower, subprocess.Popen):
            return follower.poll() is None
        try:
            return follower.is_running() and follower.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    def _running_follower(self, name: str) -> psutil.Process | None:
        """A follower an earlier agent started (it outlives the agent, in its own session)."""
        for proc in psutil.process_iter(["cmdline"]):
            cmd = proc.info["cmdline"] or []
            if (
                len(cmd) > 2
                and cmd[-1] == name
                and "logs" in cmd
                and "--follow" in cmd
                and any(os.path.basename(part) == self.binary or part.endswith(f"/{self.binary}") for part in cmd)
            ):
                return proc
        return None

    def _keep_following(self, name: str, log_path: str) -> None:
        follower = self.followers.get(name)
        if follower is not None and self._alive(follower):
            return
        if follower is None and (adopted := self._running_follower(name)) is not None:
            self.followers[name] = adopted
            return
        if log_path:
            self._follow(name, log_path, from_now=True)  # what it printed in between is in `logs`

    def _stop_following(self, name: str) -> None:
        follower = self.followers.pop(name, None)
        if follower is None:
            follower = self._running_follower(name)
        if follower is None:
            return
        # It ends by itself once the container is gone; a stuck one is not worth waiting for.
        try:
            follower.wait(timeout=3)
        except (subprocess.TimeoutExpired, psutil.TimeoutExpired):
            follower.kill()
        except psutil.NoSuchProcess:
            pass

    def _remove(self, name: str) -> None:
        result = self._cli("rm", "-f", name)
        if result.returncode != 0 and "no such" not in (result.stderr + result.stdout).lower():
            log.warning("%s rm -f %s: %s", self.binary, name, self._said(result))
        self._stop_following(name)

    # --- the runtime -----------------------------------------------------------------------
    def start(self, spec: ProcessSpec) -> ProcessHandle:
        name = spec.container_name
        if not name or spec.argv[:2] != [self.binary, "run"]:
            raise ValueError(f"a {self.binary} replica needs a container name and a `{self.binary} run` argv")
        if self.inspect(name) is not None:
            self._remove(name)  # ours by its name: left by an earlier start
        spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        rotate_log(spec.log_path, spec.log_keep)
        with open(spec.log_path, "ab") as log_file:
            log_file.write(
                f"# {timezone.now():%Y-%m-%d %H:%M:%S} started by agent {self.owner} "
                f"in {self.binary} container {name}\n".encode()
            )
        try:
            result = subprocess.run(
                spec.argv,
                capture_output=True,
                text=True,
                stdin=subprocess.DEVNULL,
                env=self._env(spec.env),
                cwd=spec.cwd,
                timeout=self.RUN_TIMEOUT,
            )
        except FileNotFoundError:
            raise RuntimeUnavailable(
                f"{self.binary} is not on this node's PATH: install it, or set the node's "
                "engine runtime back to process"
            ) from None
        except subprocess.TimeoutExpired:
            raise RuntimeUnavailable(f"`{self.binary} run` did not answer within {self.RUN_TIMEOUT:.0f} s") from None
        if result.returncode != 0:
            with open(spec.log_path, "a") as log_file:
                log_file.write(result.stderr)
            raise RuntimeError(f"{self.binary} run failed (exit status {result.returncode}): {self._said(result)}")
        container_id = (result.stdout.strip().splitlines() or [""])[-1].strip()
        info = self.inspect(name) or {}
        self._follow(name, str(spec.log_path), from_now=False)
        return ProcessHandle(
            pid=int((info.get("State") or {}).get("Pid") or 0),
            create_time=0.0,
            argv=list(spec.argv),
            runtime=self.binary,
            container_name=name,
            container_id=info.get("Id") or container_id,
            log_path=str(spec.log_path),
        )

    def find(self, handle: ProcessHandle) -> dict | None:
        """The container's facts while it runs under the handle's name and id; None when it has gone,
        ended, or is another container by that name. Without an id nothing was launched (or its stop was
        recorded): no CLI call, as a stopped replica is looked at on every pass."""
        if not handle.container_name or not handle.container_id:
            return None
        info = self.inspect(handle.container_name)
        if info is None or info.get("Id") != handle.container_id:
            return None
        if not (info.get("State") or {}).get("Running"):
            return None
        self._keep_following(handle.container_name, handle.log_path)
        return info

    def terminate(self, info: dict, *, grace: float) -> Stopped:
        name = (info.get("Name") or "").lstrip("/")
        started = time.monotonic()
        result = self._cli("stop", "--time", str(max(0, math.ceil(grace))), name, timeout=grace + self.CLI_TIMEOUT)
        if result.returncode != 0:
            log.warning("%s stop %s: %s", self.binary, name, self._said(result))
        after = self.inspect(name)
        code = (after.get("State") or {}).get("ExitCode") if after else None
        self._remove(name)
        # 137 = 128 + SIGKILL: it outlived the grace period (or was killed from outside meanwhile).
        killed = code == 137 and time.monotonic() - started >= grace
        return Stopped(exit_code=code, killed=killed)

    def exit_code(self, handle: ProcessHandle) -> int | None:
        info = self.inspect(handle.container_name) if handle.container_name else None
        if info is None or (handle.container_id and info.get("Id") != handle.container_id):
            return None
        state = info.get("State") or {}
        return None if state.get("Running") else state.get("ExitCode")

    def reap(self, handle: ProcessHandle) -> None:
        if handle.container_name:
            self._remove(handle.container_name)

    def log_tail(self, handle: ProcessHandle, log_path: str, count: int = 200) -> str:
        """The container's own last lines while it exists (the follower may not have caught up)."""
        if handle.container_name:
            try:
                result = subprocess.run(
                    [self.binary, "logs", "--tail", str(count), handle.container_name],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    timeout=self.CLI_TIMEOUT,
                    env=self._env(),
                )
                if result.returncode == 0:
                    return result.stdout.decode(errors="replace").rstrip("\n")
            except (OSError, subprocess.TimeoutExpired):
                pass
        return tail_lines(log_path, count)
