"""Reads for the evaluation pages and API."""

from django.db.models import QuerySet

from console.roles import VIEWER
from console.teams import visible, visible_get
from endpoints.bench.compare import plotly_text
from evaluations.models import Evaluation, GateRun


def evaluations_of(user) -> QuerySet:
    """The evaluations of the user's teams (every team's for the console Admin)."""
    return visible(Evaluation.objects.all(), user)


def recent(*, user, limit: int = 50):
    return evaluations_of(user).select_related("job", "created_by").order_by("-created_at", "-id")[:limit]


def evaluation_get(evaluation_id: int, *, user, role: str = VIEWER) -> Evaluation:
    """404 for another team's evaluation (console.teams)."""
    found = Evaluation.objects.select_related("job", "created_by", "endpoint", "artifact")
    return visible_get(found, user, role=role, pk=evaluation_id)


def recent_gates(*, user, limit: int = 20):
    """Accuracy gates whose candidate evaluation is of the user's teams."""
    return visible(GateRun.objects.select_related("baseline", "candidate"), user, field="candidate__team")[:limit]


def chart_rows(evaluations: list[Evaluation]) -> dict:
    """What evaluation.js draws: each evaluation's figures (value and 2·stderr as its error bar), by task and metric."""
    return {
        "evaluations": [
            {
                "id": e.pk,
                "title": plotly_text(f"#{e.pk} {e.title}"),  # a Plotly trace name: no tags of a label rendered
                "results": [
                    {
                        "label": plotly_text(f"{r['task']} {r['metric'].split(',')[0]}"),
                        "value": r["value"],
                        "stderr": r["stderr"],
                    }
                    for r in e.results
                    if r["value"] is not None
                ],
            }
            for e in evaluations
        ]
    }
