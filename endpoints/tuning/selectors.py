"""Reads for tunings: one with its trials, and what its measured trials say (Pareto front, best, the chart's data)."""

from console.roles import VIEWER
from console.teams import visible_get
from endpoints.bench.compare import plotly_text
from endpoints.tuning import search
from endpoints.tuning.models import TrialKind, TrialState, Tuning, TuningTrial


def tuning_get(tuning_id: int, *, user, role: str = VIEWER) -> Tuning:
    """404 for another team's tuning; 403 where the user's role in its team is below `role` (console.teams)."""
    return visible_get(
        Tuning.objects.select_related("endpoint", "job", "created_by", "artifact", "node"),
        user,
        role=role,
        pk=tuning_id,
    )


def best_spec(tuning: Tuning) -> dict | None:
    """An artifact's tuning: the launch spec of its best trial (what to POST to /api/v1/endpoints, a name given);
    an endpoint's tuning is applied to it instead (None)."""
    from endpoints.tuning.services import base_of, trial_spec  # pure: the spec a trial replica is launched with

    if not tuning.for_artifact or not tuning.best:
        return None
    space = search.Space(choices={}, speculative_config=tuning.space.get("speculative_config"))
    spec = trial_spec(base_of(tuning), name="", params=tuning.best.get("params") or {}, space=space)
    return spec.model_dump(mode="json", exclude={"name", "served_model_name"})


def tunings_of(endpoint, *, limit: int = 10):
    return Tuning.objects.filter(endpoint=endpoint).select_related("job")[:limit]


def trial_json(trial: TuningTrial) -> dict:
    return {
        "number": trial.number,
        "kind": trial.kind,
        "repeat_of": trial.repeat_of,
        "params": trial.params,
        "state": trial.state,
        "metrics": trial.metrics,
        "meets_slo": trial.meets_slo,
        "error": trial.error or None,
        "replica_endpoint": trial.replica_endpoint,
        "benchmark": trial.benchmark_id,
        "started_at": trial.started_at.isoformat() if trial.started_at else None,
        "finished_at": trial.finished_at.isoformat() if trial.finished_at else None,
    }


def analysis(tuning: Tuning) -> dict:
    """The measured trials as the result page and the API read them: every point, the Pareto front, the SLO."""
    slo = search.parse_slo(tuning.slo)
    trials = list(tuning.trials.all())
    measured = [
        {"number": t.number, "params": t.params, "metrics": t.metrics}
        for t in trials
        if t.state == TrialState.COMPLETE and t.kind != TrialKind.REPEAT
    ]
    found = search.points(measured, slo)
    front = search.pareto_front(found)
    kinds = {t.number: t.kind for t in trials}
    return {
        "trials": trials,
        "points": found,
        "pareto": [p.number for p in front],
        "chart": {
            "points": [
                {
                    "number": p.number,
                    "throughput": p.throughput,
                    "p99_ms": p.p99_ms,
                    "meets": p.meets,
                    "kind": kinds.get(p.number, ""),
                    "label": plotly_text(
                        f"#{p.number} "
                        + (", ".join(f"{k}={v}" for k, v in p.params.items()) or "the endpoint's own settings")
                    ),
                }
                for p in found
            ],
            "pareto": [p.number for p in front],
            "best": (tuning.best or {}).get("number"),
            "slo": tuning.slo,
        },
    }
