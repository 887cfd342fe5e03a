"""Evaluations API: the tasks available here, start an evaluation of an endpoint or an artifact, read its state and
results, compare two; a canary pair's accuracy gate."""

from ninja import Router, Schema
from pydantic import ConfigDict

from console.api_auth import api_route
from console.roles import OPERATOR, VIEWER
from console.teams import visible_get
from endpoints.models import Endpoint
from evaluations import gates, selectors, services
from evaluations import tasks as catalogue
from evaluations.compare import compare_rows
from evaluations.models import Evaluation
from models_registry.models import Artifact

router = Router(tags=["evaluations"])


class EvaluationIn(Schema):
    model_config = ConfigDict(extra="forbid")

    endpoint: int | str | None = None  # id or name
    artifact: int | None = None
    node: str | int | None = None  # an artifact's evaluation: where its endpoint is launched (default: any)
    tasks: list[str] | str
    limit: int | None = None
    seed: int | None = None
    api: str = "completions"
    label: str = ""


class RolloutGateIn(Schema):
    model_config = ConfigDict(extra="forbid")

    tasks: list[str] = []  # empty: no accuracy gate
    limit: int | None = None
    max_drop_points: float | None = None
    above_share: int | None = None  # a step past which the staged share waits for it (blank: the promotion)


def evaluation_json(evaluation: Evaluation) -> dict:
    return {
        "id": evaluation.pk,
        "team": evaluation.team_id,
        "state": evaluation.state,
        "error": evaluation.display_error or None,
        "measured": evaluation.measured,
        "purpose": evaluation.purpose,
        "label": evaluation.label,
        "endpoint": evaluation.endpoint_id,
        "endpoint_name": evaluation.endpoint_name or None,
        "artifact": evaluation.artifact_id,
        "artifact_name": evaluation.artifact_label,
        "launched": evaluation.launched,
        "job": evaluation.job_id,
        "tasks": evaluation.tasks,
        "limit": evaluation.limit,
        "seed": evaluation.seed,
        "api": evaluation.api,
        "results": [
            {"task": r["task"], "metric": r["metric"], "value": r["value"], "stderr": r["stderr"], "n": r.get("n")}
            for r in evaluation.results
        ],
        "versions": evaluation.versions,
        "engine": evaluation.engine,
        "spec": evaluation.spec,
        "samples": evaluation.get_absolute_url() + "samples.jsonl" if evaluation.samples_path else None,
        "created_at": evaluation.created_at.isoformat(),
        "finished_at": evaluation.finished_at.isoformat() if evaluation.finished_at else None,
        "url": evaluation.get_absolute_url(),
    }


@api_route(router, "get", "/evaluations/tasks", role=VIEWER, response=list[dict])
def list_tasks(request):
    return catalogue.task_catalogue_json()


@api_route(router, "post", "/evaluations", role=OPERATOR, response={202: dict})
def create_evaluation(request, payload: EvaluationIn):
    endpoint = artifact = None
    if payload.endpoint not in (None, ""):
        field = {"pk": payload.endpoint} if str(payload.endpoint).isdigit() else {"name": payload.endpoint}
        # Another team's: 404, as one that does not exist; an Operator of its team only (console.teams).
        endpoint = visible_get(Endpoint.objects.select_related("artifact"), request.user, role=OPERATOR, **field)
    if payload.artifact is not None:
        artifact = visible_get(Artifact.objects.all(), request.user, role=OPERATOR, pk=payload.artifact)
    evaluation = services.evaluation_create(
        endpoint=endpoint,
        artifact=artifact,
        tasks=payload.tasks,
        limit=payload.limit,
        seed=payload.seed,
        api=payload.api,
        node=payload.node,
        label=payload.label,
        user=request.user,
        request=request,
    )
    return 202, evaluation_json(evaluation)


@api_route(router, "get", "/evaluations", role=VIEWER, response=list[dict])
def list_evaluations(request, limit: int = 50):
    return [evaluation_json(e) for e in selectors.recent(user=request.user, limit=max(1, min(limit, 500)))]


@api_route(router, "get", "/evaluations/{evaluation_id}", role=VIEWER, response=dict)
def get_evaluation(request, evaluation_id: int):
    return evaluation_json(selectors.evaluation_get(evaluation_id, user=request.user))


@api_route(router, "get", "/evaluations/{first_id}/compare/{second_id}", role=VIEWER, response=dict)
def compare_evaluations(request, first_id: int, second_id: int):
    first = selectors.evaluation_get(first_id, user=request.user)
    second = selectors.evaluation_get(second_id, user=request.user)
    return {"baseline": first.pk, "candidate": second.pk, "rows": compare_rows(first.results, second.results)}


@api_route(router, "post", "/endpoints/{endpoint_id}/rollout/accuracy-gate", role=OPERATOR, response=dict)
def set_rollout_gate(request, endpoint_id: int, payload: RolloutGateIn):
    endpoint = visible_get(Endpoint.objects.all(), request.user, role=OPERATOR, pk=endpoint_id)
    gate = gates.set_rollout_gate(
        endpoint=endpoint,
        tasks=payload.tasks,
        limit=payload.limit,
        max_drop_points=payload.max_drop_points,
        above_share=payload.above_share,
        actor=request.user,
        request=request,
    )
    return {
        "tasks": gate.tasks,
        "limit": gate.limit,
        "max_drop_points": gate.threshold,
        "above_share": gate.above_share,
    }
