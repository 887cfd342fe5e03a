"""The agent's process runtime: a start finds what an earlier, unrecorded start of the same process left running."""

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import time

import psutil

from workers.agent.handles import ProcessHandle
from workers.agent.supervisor import ProcessRuntime, ProcessSpec, started_since_boot


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_start_stops_the_engine_an_unrecorded_earlier_start_left_in_its_work_dir(tmp_path):
    """The agent killed between starting a replica and writing its PID: the next pass starts it again, and the
    first ran on beside it (same devices, same port), never reaped. The stray is known by its own session, the
    replica's working directory and the engine's executable; an operator's shell there, or another replica's
    engine elsewhere, is left alone."""
    work, elsewhere = tmp_path / "replica-0", tmp_path / "replica-1"
    work.mkdir()
    elsewhere.mkdir()
    engine = [
        sys.executable,
        "-c",
        (
            "import subprocess, sys, time; "
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']); time.sleep(300)"
        ),
    ]
    stray = subprocess.Popen(engine, cwd=work, start_new_session=True)
    neighbour = subprocess.Popen(engine, cwd=elsewhere, start_new_session=True)
    shell = subprocess.Popen(["sleep", "300"], cwd=work, start_new_session=True)  # not the engine's executable
    time.sleep(0.5)
    stray_child = psutil.Process(stray.pid).children()[0].pid
    runtime = ProcessRuntime("test-node")
    try:
        handle = runtime.start(
            ProcessSpec(
                argv=[sys.executable, "-c", "import time; time.sleep(300)"],
                env={},
                log_path=tmp_path / "replica-0.log",
                cwd=str(work),
            )
        )
        stray.wait(timeout=10)
        assert not _running(stray.pid) and not _running(stray_child)  # its whole process group
        assert _running(handle.pid) and _running(neighbour.pid) and _running(shell.pid)
    finally:
        for pgid in (neighbour.pid, shell.pid, stray.pid, *runtime.children):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
        for proc in (neighbour, shell, stray, *runtime.children.values()):
            proc.wait()


def test_a_stepped_wall_clock_leaves_a_running_replica_found_and_a_reused_pids_group_alone(tmp_path, monkeypatch):
    """psutil's create_time() moves with the wall clock (it adds /proc/stat's btime): after an NTP step the
    agent took every healthy replica for a crash and killed it. The start is now read from boot in clock ticks.
    A handle whose PID is another process now (after a reboot) no longer gets that process's group killed;
    an older agent's epoch start times are still matched."""
    runtime = ProcessRuntime("test-node")
    unrelated = subprocess.Popen(["sleep", "300"], start_new_session=True)
    time.sleep(0.3)  # another start time: what a PID reused after a reboot has
    try:
        handle = runtime.start(
            ProcessSpec(
                argv=[sys.executable, "-c", "import time; time.sleep(300)"], env={}, log_path=tmp_path / "replica-0.log"
            )
        )
        assert runtime.find(handle) is not None
        real_boot = psutil.boot_time()
        older_agents = dataclasses.replace(handle, create_time=psutil.Process(handle.pid).create_time())
        monkeypatch.setattr(psutil, "boot_time", lambda: real_boot + 1.0)  # `date -s` one second ahead
        monkeypatch.setattr(psutil.Process, "create_time", lambda self: 0.0)  # not read any more
        assert runtime.find(handle) is not None and runtime.find(older_agents) is not None

        stale = dataclasses.replace(handle, pid=unrelated.pid)  # a row from before a reboot: the PID is reused
        assert runtime.find(stale) is None
        runtime.reap(stale)
        time.sleep(0.2)
        assert _running(unrelated.pid)
    finally:
        for pgid in (unrelated.pid, *runtime.children):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
        for proc in (unrelated, *runtime.children.values()):
            proc.wait()


def test_a_crashed_leader_left_a_zombie_still_has_its_group_reaped(tmp_path):
    """Where init does not reap an orphan (a container's PID 1), a killed vLLM leader stays a zombie holding its
    PID: its engine core, in its group, must still go. (An earlier version of the reused-PID guard left it.)"""
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import subprocess, sys, time; "
                "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']); "
                "time.sleep(300)"
            ),
        ],
        start_new_session=True,
    )
    time.sleep(0.5)
    engine_core = psutil.Process(parent.pid).children()[0].pid
    os.kill(parent.pid, signal.SIGKILL)
    time.sleep(0.2)
    try:
        assert psutil.Process(parent.pid).status() == psutil.STATUS_ZOMBIE  # not reaped: a handle of another agent
        recorded = ProcessHandle(pid=parent.pid, create_time=started_since_boot(parent.pid), argv=[])
        ProcessRuntime("test-node").reap(recorded)  # an agent that did not start it (re-adopted, then it crashed)
        time.sleep(0.3)
        assert not _running(engine_core)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(parent.pid, signal.SIGKILL)
        parent.wait()
