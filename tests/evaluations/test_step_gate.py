"""A canary step may require the accuracy evaluation (issue 38: "a canary step may require an evaluation of the
staged side against the live side"): with `above_share`, the step past that share holds for the evaluation of both
sides, a drop rolls back at that step, a pass lets the step through with its figures, and the later steps and the
promotion go on without evaluating again. On recorded lm-eval figures (the real runs: tests/e2e/)."""

import time
from datetime import UTC, datetime, timedelta

import pytest

from console.models import AuditEvent
from endpoints.gateway import services as gateway
from endpoints.gateway.controller import evaluate_rollouts
from endpoints.gateway.models import GatewayEndpoint
from endpoints.gateway.rollout import HOLD, PROMOTE, ROLLBACK, STEP
from endpoints.gateway.stats import Stats
from evaluations.models import Evaluation, GateRun, RolloutGate
from models_registry.models import Artifact
from tests.endpoints.test_gateway_routing import pair
from tests.evaluations.conftest import changed

DAMAGED = {"acc,none": 0.25, "acc_norm,none": 0.25, "exact_match,strip": 0.0}


def _finish(evaluation: Evaluation, rows: list[dict]) -> None:
    Evaluation.objects.filter(pk=evaluation.pk).update(status="succeeded", results=rows)


def _window(blue, green, seconds_ago: int = 61) -> None:
    """The SLO window is over and clean: 60 fast requests to the staged side, stored as the gateway stores them."""
    GatewayEndpoint.objects.filter(endpoint=blue).update(
        canary_set_at=datetime.now(UTC) - timedelta(seconds=seconds_ago)
    )
    stats = Stats()
    for _ in range(60):
        stats.record(endpoint_id=green.pk, key_id=None, status=200, latency=0.1, ttft=0.02, tokens=1)
    gateway.store_gateway_stats(stats, 10)


@pytest.fixture
def step_gated_pair(admin, operator, api_for, settings, tokenizer_dir, redis_conn):
    """A canary pair at 10 % of a 10 → 50 → 100 plan, its accuracy gate required above the first step."""
    settings.GATEWAY_ROLLOUT_MIN_REQUESTS = 50
    blue, green = pair()
    for ep in (blue, green):
        Artifact.objects.filter(pk=ep.artifact_id).update(path=str(tokenizer_dir))
    gateway.stage(endpoint=blue, staged=green, actor=admin)
    gateway.set_rollout(
        endpoint=blue, p99_ms=500, error_pct=1.0, ttft_p99_ms=None, window_seconds=60, steps=[10, 50, 100], auto=True
    )
    GatewayEndpoint.objects.filter(endpoint=blue).update(canary_percent=10)
    api = api_for(operator)
    url = f"/api/v1/endpoints/{blue.pk}/rollout/accuracy-gate"
    refused = api.post(url, {"tasks": ["console_mc"], "above_share": 100})
    assert refused.status_code == 400 and "above_share" in refused.json()["errors"]
    assert not RolloutGate.objects.exists()
    set_gate = api.post(
        url, {"tasks": ["console_mc", "console_gen"], "limit": 10, "max_drop_points": 1, "above_share": 10}
    )
    assert set_gate.status_code == 200 and set_gate.json()["above_share"] == 10, set_gate.content
    audit = AuditEvent.objects.get(action="gateway.rollout_accuracy_gate")
    assert audit.changes["above_share"] == 10
    _window(blue, green)
    return blue, green


def _held_at_the_step(blue, green) -> GateRun:
    [(_, decision, applied)] = evaluate_rollouts(now=time.time() + 1)
    assert decision.action == HOLD and not applied, decision
    assert "before the step to 50 %" in decision.reason, decision.reason
    assert GatewayEndpoint.objects.get(endpoint=blue).canary_percent == 10
    run = GateRun.objects.get()
    assert (run.baseline.endpoint_id, run.candidate.endpoint_id) == (blue.pk, green.pk)
    return run


@pytest.mark.django_db
def test_a_step_past_the_gate_waits_for_the_evaluation_and_the_promotion_needs_none_after_a_pass(
    step_gated_pair, recorded_rows
):
    blue, green = step_gated_pair
    run = _held_at_the_step(blue, green)
    _finish(run.baseline, recorded_rows)
    _finish(run.candidate, recorded_rows)
    [(_, decision, applied)] = evaluate_rollouts(now=time.time() + 2)
    assert decision.action == STEP and applied and decision.share == 50, decision
    assert "accuracy within the gate" in decision.reason and decision.figures["evaluation"]["verdict"] == "passed"
    assert GatewayEndpoint.objects.get(endpoint=blue).canary_percent == 50
    # The next window: the promotion goes through on the same staged side's pass, no second evaluation.
    _window(blue, green)
    [(_, decision, applied)] = evaluate_rollouts(now=time.time() + 3)
    assert decision.action == PROMOTE and applied, decision
    assert GateRun.objects.count() == 1 and Evaluation.objects.count() == 2
    assert GatewayEndpoint.objects.get(endpoint=blue).serving == "staged"


@pytest.mark.django_db
def test_a_worse_staged_side_is_rolled_back_at_the_step(step_gated_pair, recorded_rows):
    blue, green = step_gated_pair
    run = _held_at_the_step(blue, green)
    _finish(run.baseline, recorded_rows)
    _finish(run.candidate, changed(recorded_rows, **DAMAGED))
    [(_, decision, applied)] = evaluate_rollouts(now=time.time() + 2)
    assert decision.action == ROLLBACK and applied, decision
    assert "accuracy dropped beyond the gate" in decision.reason
    gw = GatewayEndpoint.objects.get(endpoint=blue)
    assert (gw.serving, gw.canary_percent) == ("live", 0)


@pytest.mark.django_db
def test_without_above_share_a_step_is_not_held(step_gated_pair):
    blue, green = step_gated_pair
    RolloutGate.objects.update(above_share=None)
    [(_, decision, applied)] = evaluate_rollouts(now=time.time() + 1)
    assert decision.action == STEP and applied and decision.share == 50, decision
    assert not GateRun.objects.exists()
