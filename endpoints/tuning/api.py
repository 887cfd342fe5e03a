"""Tunings API: search an endpoint's launch settings against an SLO (a `tune` job), read the trials and the best
configuration, apply it."""

from typing import Any

from ninja import Router, Schema
from pydantic import ConfigDict

from console.api_auth import api_route
from console.roles import OPERATOR, VIEWER
from endpoints.api import endpoint_json
from endpoints.tuning import selectors, services
from endpoints.tuning.models import Tuning

router = Router(tags=["tunings"])


class TuningIn(Schema):
    model_config = ConfigDict(extra="forbid")

    endpoint: int | str | None = None  # or an artifact and a node (no endpoint: its trials start from the launch)
    artifact: int | None = None
    node: int | str | None = None
    workload: dict[str, Any] = {}  # the benchmark form's settings (num_prompts, input_len, max_concurrency, ...)
    slo: dict[str, Any]  # ttft_p99_ms, itl_p99_ms, min_throughput (output tok/s); null or absent: no bound
    space: dict[str, Any]  # knob -> choices (endpoints.tuning.search.KNOBS)
    trials: int | None = None  # search trials besides the baseline and the two repeats (default 6, at most 50)
    search: str = "tpe"  # "tpe" (Optuna, seeded) or "grid" (seeded order, early stopping)
    seed: int | None = None


class ApplyIn(Schema):
    model_config = ConfigDict(extra="forbid")

    trial: int | None = None  # default: the best trial meeting the SLO


def tuning_json(tuning: Tuning) -> dict:
    read = selectors.analysis(tuning)
    return {
        "id": tuning.pk,
        "team": tuning.team_id,
        "state": tuning.state,
        "error": tuning.error or (tuning.job.error if tuning.job and tuning.state == "failed" else "") or None,
        "endpoint": tuning.endpoint_id,
        "endpoint_name": tuning.endpoint_name,
        "artifact": tuning.artifact_id,
        "node": tuning.node.name if tuning.node_id else None,
        "subject": tuning.subject,
        # An artifact's tuning: the launch spec the trials started from, and the best's (POST /api/v1/endpoints).
        "base_spec": tuning.base_spec or None,
        "job": tuning.job_id,
        "workload": tuning.workload,
        "slo": tuning.slo,
        "space": tuning.space,
        "search": tuning.search,
        "trials_wanted": tuning.trials_wanted,
        "seed": tuning.seed,
        "trials": [selectors.trial_json(t) for t in read["trials"]],
        "pareto": read["pareto"],
        "best": ({**tuning.best, "spec": selectors.best_spec(tuning)} if tuning.best else None),
        "confidence": tuning.confidence or None,
        "applied_at": tuning.applied_at.isoformat() if tuning.applied_at else None,
        "applied_params": tuning.applied_params or None,
        "created_by": tuning.created_by.username if tuning.created_by else None,
        "created_at": tuning.created_at.isoformat(),
        "finished_at": tuning.finished_at.isoformat() if tuning.finished_at else None,
        "url": tuning.get_absolute_url(),
    }


@api_route(router, "post", "/tunings", role=OPERATOR, response={202: dict})
def create_tuning(request, payload: TuningIn):
    tuning = services.tuning_create(
        endpoint=payload.endpoint,
        artifact=payload.artifact,
        node=payload.node,
        workload=payload.workload,
        slo=payload.slo,
        space=payload.space,
        trials=payload.trials,
        search_kind=payload.search,
        seed=payload.seed,
        user=request.user,
        request=request,
    )
    return 202, tuning_json(tuning)


@api_route(router, "get", "/tunings/{tuning_id}", role=VIEWER, response=dict)
def get_tuning(request, tuning_id: int):
    return tuning_json(selectors.tuning_get(tuning_id, user=request.user))


@api_route(router, "post", "/tunings/{tuning_id}/apply", role=OPERATOR, response=dict)
def apply_tuning(request, tuning_id: int, payload: ApplyIn):
    """Apply the best configuration (or `trial`'s): the endpoint's settings change and its replicas restart one
    at a time."""
    tuning = selectors.tuning_get(tuning_id, user=request.user, role=OPERATOR)
    endpoint = services.tuning_apply(tuning=tuning, number=payload.trial, user=request.user, request=request)
    return endpoint_json(endpoint)
