"""Reads for the evaluation pages and API."""

from endpoints.bench.compare import plotly_text
from evaluations.models import Evaluation


def recent(*, limit: int = 50):
    return Evaluation.objects.select_related("job", "created_by").order_by("-created_at", "-id")[:limit]


def evaluation_get(evaluation_id: int) -> Evaluation:
    return Evaluation.objects.select_related("job", "created_by", "endpoint", "artifact").get(pk=evaluation_id)


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
