"""The accuracy gates on recorded lm-eval figures (the real runs are tests/e2e/test_evaluations_e2e.py): the
rollout controller holds a promotion for an evaluation of both sides, rolls back on a drop beyond the gate with
the figures in the event, promotes an equal one; the quantize hook marks the artifact with both figures."""

import time
from datetime import UTC, datetime, timedelta

import pytest

from console.models import AuditEvent
from endpoints.gateway import services as gateway
from endpoints.gateway.controller import evaluate_rollouts
from endpoints.gateway.models import GatewayEndpoint
from endpoints.gateway.rollout import HOLD, PROMOTE, ROLLBACK
from endpoints.gateway.selectors import Backend, KeyInfo
from endpoints.gateway.stats import Stats
from endpoints.models import EndpointEvent
from evaluations import gates
from evaluations.compare import compare_rows, gate_verdict
from evaluations.models import Evaluation, GateRun
from models_registry import hooks
from models_registry.models import Artifact, Model
from tests.endpoints.test_gateway_routing import pair
from tests.evaluations.conftest import changed
from workers.models import Node

DAMAGED = {"acc,none": 0.25, "acc_norm,none": 0.25, "exact_match,strip": 0.0}


def test_the_verdict_judges_each_tasks_primary_metric_against_the_gate(recorded_rows):
    types = {"console_mc": "multiple_choice", "console_gen": "generate_until"}
    same = gate_verdict(compare_rows(recorded_rows, recorded_rows), max_drop_points=1.0, output_types=types)
    assert same["passed"] and [t["drop_points"] for t in same["tasks"]] == [0.0, 0.0]
    # 0.675 → 0.665 is a 1.0-point drop: at the gate, within it; 0.66 is 1.5 points, beyond it.
    at = gate_verdict(
        compare_rows(recorded_rows, changed(recorded_rows, **{"acc,none": 0.665})),
        max_drop_points=1.0,
        output_types=types,
    )
    over = gate_verdict(
        compare_rows(recorded_rows, changed(recorded_rows, **{"acc,none": 0.66})),
        max_drop_points=1.0,
        output_types=types,
    )
    assert at["passed"] and not over["passed"]
    mc = next(t for t in over["tasks"] if t["task"] == "console_mc")
    assert mc["metric"] == "acc,none" and mc["drop_points"] == pytest.approx(1.5)
    assert mc["beyond_noise"] is False and mc["noise_points"] == pytest.approx(21.21, abs=0.01)
    assert "console_mc acc 67.5 → 66.0 (-1.5 points, noise ±21.2)" in over["reason"]
    # A better candidate never fails the gate.
    better = gate_verdict(
        compare_rows(recorded_rows, changed(recorded_rows, **{"acc,none": 0.9})),
        max_drop_points=1.0,
        output_types=types,
    )
    assert better["passed"]


def _finish(evaluation: Evaluation, rows: list[dict]) -> None:
    Evaluation.objects.filter(pk=evaluation.pk).update(status="succeeded", results=rows)


@pytest.fixture
def gated_pair(admin, operator, api_for, settings, tokenizer_dir, redis_conn):
    """A canary pair at its last share before 100 with a clean SLO window, and an accuracy gate on it."""
    settings.GATEWAY_ROLLOUT_MIN_REQUESTS = 50
    blue, green = pair()
    for ep in (blue, green):
        Artifact.objects.filter(pk=ep.artifact_id).update(path=str(tokenizer_dir))
    gateway.stage(endpoint=blue, staged=green, actor=admin)
    gateway.set_rollout(
        endpoint=blue, p99_ms=500, error_pct=1.0, ttft_p99_ms=None, window_seconds=60, steps=[50, 100], auto=True
    )
    api = api_for(operator)
    refused = api.post(f"/api/v1/endpoints/{blue.pk}/rollout/accuracy-gate", {"tasks": ["nope"]})
    assert refused.status_code == 400 and "tasks" in refused.json()["errors"]
    refused = api.post(
        f"/api/v1/endpoints/{blue.pk}/rollout/accuracy-gate", {"tasks": ["console_mc"], "max_drop_points": -1}
    )
    assert refused.status_code == 400 and "max_drop_points" in refused.json()["errors"]
    set_gate = api.post(
        f"/api/v1/endpoints/{blue.pk}/rollout/accuracy-gate",
        {"tasks": ["console_mc", "console_gen"], "limit": 10, "max_drop_points": 1},
    )
    assert set_gate.status_code == 200, set_gate.content
    GatewayEndpoint.objects.filter(endpoint=blue).update(canary_set_at=datetime.now(UTC) - timedelta(seconds=61))
    stats = Stats()
    for _ in range(60):
        stats.record(endpoint_id=green.pk, key_id=None, status=200, latency=0.1, ttft=0.02, tokens=1)
    gateway.store_gateway_stats(stats, 10)
    return blue, green


def _start_gate(blue, green):
    [(_, decision, applied)] = evaluate_rollouts(now=time.time() + 1)
    assert decision.action == HOLD and not applied
    run = GateRun.objects.get()
    assert "accuracy gate: evaluating live" in decision.reason
    live, staged = run.baseline, run.candidate
    assert (live.endpoint_id, staged.endpoint_id) == (blue.pk, green.pk)
    assert live.tasks == staged.tasks == ["console_mc", "console_gen"]
    assert (live.seed, live.limit) == (staged.seed, staged.limit) == (1234, 10)
    assert live.purpose == staged.purpose == "rollout-gate"
    # Still running: the promotion waits.
    [(_, decision, applied)] = evaluate_rollouts(now=time.time() + 2)
    assert decision.action == HOLD and "waiting for evaluations" in decision.reason and not applied
    assert GateRun.objects.count() == 1 and Evaluation.objects.count() == 2
    return live, staged


@pytest.mark.django_db
def test_a_staged_side_that_scores_worse_is_rolled_back_with_the_figures(gated_pair, recorded_rows):
    blue, green = gated_pair
    live, staged = _start_gate(blue, green)
    _finish(live, recorded_rows)
    _finish(staged, changed(recorded_rows, **DAMAGED))
    [(_, decision, applied)] = evaluate_rollouts(now=time.time() + 3)
    assert decision.action == ROLLBACK and applied
    gw = GatewayEndpoint.objects.get(endpoint=blue)
    assert (gw.serving, gw.canary_percent, gw.rollout_auto) == ("live", 0, False)
    [message] = EndpointEvent.objects.filter(endpoint=blue, kind="rollout").values_list("message", flat=True)
    assert "rollout rollback: accuracy gate: accuracy dropped beyond the gate (1 points)" in message
    assert "console_mc acc 67.5 → 25.0 (-42.5 points" in message and "console_gen exact_match 73.3 → 0.0" in message
    audit = AuditEvent.objects.get(action="gateway.rollback", via="controller")
    figures = audit.changes["rollout"]["figures"]["evaluation"]
    assert figures["verdict"] == "failed" and figures["live"] == live.pk and figures["staged"] == staged.pk
    assert {t["task"]: t["drop_points"] for t in figures["tasks"]}["console_mc"] == pytest.approx(42.5)
    assert GateRun.objects.get().verdict == "failed"


@pytest.mark.django_db
def test_an_equal_staged_side_is_promoted(gated_pair, recorded_rows):
    blue, green = gated_pair
    live, staged = _start_gate(blue, green)
    _finish(live, recorded_rows)
    _finish(staged, recorded_rows)
    [(_, decision, applied)] = evaluate_rollouts(now=time.time() + 3)
    assert decision.action == PROMOTE and applied and "accuracy within the gate" in decision.reason
    gw = GatewayEndpoint.objects.get(endpoint=blue)
    assert gw.serving == "staged"
    [message] = EndpointEvent.objects.filter(endpoint=blue, kind="rollout").values_list("message", flat=True)
    assert "rollout promote" in message and "console_mc acc 67.5 → 67.5 (+0.0 points" in message


@pytest.mark.django_db
def test_a_failed_evaluation_holds_and_is_tried_once_more(gated_pair):
    blue, green = gated_pair
    live, staged = _start_gate(blue, green)
    Evaluation.objects.filter(pk=staged.pk).update(status="failed", error="lm-eval failed: boom")
    _finish(live, [])
    [(_, decision, _)] = evaluate_rollouts(now=time.time() + 3)
    assert decision.action == HOLD and "boom" in (GateRun.objects.order_by("pk").first().reason)
    assert GateRun.objects.count() == 1
    [(_, decision, _)] = evaluate_rollouts(now=time.time() + 4)
    assert decision.action == HOLD and GateRun.objects.count() == 2  # a second pair of evaluations
    assert GatewayEndpoint.objects.get(endpoint=blue).serving == "live"


# --- quantization ------------------------------------------------------------------------------------------


@pytest.fixture
def quantized_pair(db, tokenizer_dir, redis_conn):
    Node.objects.create(name="cpu-host", address="127.0.0.1", platform="cpu", last_heartbeat=datetime.now(UTC))
    model = Model.objects.create(name="demo")
    source = Artifact.objects.create(model=model, format="hf", path=str(tokenizer_dir), dtype="bfloat16")
    quantized = Artifact.objects.create(
        model=model,
        parent=source,
        format="compressed-tensors",
        path=str(tokenizer_dir),
        dtype="W8A8",
        accuracy={"ppl_change_pct": 0.8, "passed": True, "measured_by": "simulated"},
        note="GPTQ",
    )
    return source, quantized


@pytest.mark.django_db
def test_the_quantize_hook_evaluates_both_and_keeps_a_worse_artifact_marked(
    quantized_pair, recorded_rows, client, viewer
):
    source, quantized = quantized_pair
    hooks.quantized(quantized, source)  # what the quantize job calls once its perplexity gate passed
    run = GateRun.objects.get()
    assert (run.baseline.artifact_id, run.candidate.artifact_id) == (source.pk, quantized.pk)
    assert run.baseline.launched and run.baseline.spec == {"node": "cpu-host"}
    assert run.baseline.tasks == ["console_mc", "console_gen"] and run.max_drop_points == 1.0
    quantized.refresh_from_db()
    assert not quantized.recommended and "Awaiting the accuracy evaluation" in quantized.note
    _finish(run.baseline, recorded_rows)
    gates.settle_for(run.baseline)
    assert GateRun.objects.get().verdict == "pending"
    _finish(run.candidate, changed(recorded_rows, **{"acc,none": 0.6}))
    gates.settle_for(run.candidate)
    quantized.refresh_from_db()
    assert not quantized.recommended and quantized.note.startswith("Kept, not recommended: accuracy dropped")
    assert "console_mc acc 67.5 → 60.0 (-7.5 points" in quantized.note
    figures = quantized.accuracy["evaluation"]
    assert figures["measured_by"] == "served by an engine" and figures["verdict"] == "failed"
    assert quantized.accuracy["measured_by"] == "simulated"  # the perplexity's own label stays
    assert AuditEvent.objects.filter(action="artifact.accuracy_gate").count() == 1
    client.force_login(viewer)
    page = client.get(f"/artifacts/{quantized.pk}/").content.decode()
    assert 'id="accuracy-evaluation"' in page and "dropped beyond 1.0 points" in page
    assert (
        "measured by: <strong>served by an engine</strong>" in page
        and "measured by: <strong>simulated</strong>" in page
    )


@pytest.mark.django_db
def test_the_quantize_hook_recommends_an_artifact_within_the_gate(quantized_pair, recorded_rows, settings):
    settings.EVALUATION_GATE_POINTS = 10.0
    source, quantized = quantized_pair
    hooks.quantized(quantized, source)
    run = GateRun.objects.get()
    _finish(run.baseline, recorded_rows)
    _finish(run.candidate, changed(recorded_rows, **{"acc,none": 0.6}))
    gates.settle_for(run.candidate)
    quantized.refresh_from_db()
    assert quantized.recommended and "Accuracy evaluation passed" in quantized.note


@pytest.mark.django_db
def test_no_evaluation_where_no_node_can_serve_the_artifact(quantized_pair):
    source, quantized = quantized_pair
    Artifact.objects.filter(pk=quantized.pk).update(format="ascend-modelslim")  # an Ascend node's, none here
    quantized.refresh_from_db()
    hooks.quantized(quantized, source)
    assert not GateRun.objects.exists()
    quantized.refresh_from_db()
    assert quantized.recommended  # the perplexity gate's verdict stands


def test_an_exact_endpoint_scope_admits_one_side_of_a_canary_pair_alone():
    """An evaluation's key ("=name") reaches that endpoint only; a plain endpoint scope also admits the staged side,
    whose replicas carry the public name."""
    live = Backend(
        url="http://a",
        endpoint_id=1,
        endpoint_name="blue",
        replica_index=0,
        queue_depth=8,
        scope_names=frozenset({"blue"}),
    )
    staged = Backend(
        url="http://b",
        endpoint_id=2,
        endpoint_name="green",
        replica_index=0,
        queue_depth=8,
        scope_names=frozenset({"green", "blue"}),
        staged=True,
    )

    def key(*scope):
        return KeyInfo(id=1, name="k", models=frozenset(), endpoints=frozenset(scope), rpm_limit=None, tpm_limit=None)

    assert [key("blue").allows_backend(b, "demo") for b in (live, staged)] == [True, True]
    assert [key("=blue").allows_backend(b, "demo") for b in (live, staged)] == [True, False]
    assert [key("=green").allows_backend(b, "demo") for b in (live, staged)] == [False, True]
    assert key("=green").endpoint_names == {"green"}
