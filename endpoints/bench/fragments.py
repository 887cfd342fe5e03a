"""The serving-speed line of a quantized artifact's report, as an htmx fragment for the registry page."""

from django.shortcuts import render
from django.views.decorators.http import require_GET

from console.roles import VIEWER, require_role
from console.teams import visible
from endpoints.bench.models import BenchmarkRun, BenchStatus
from endpoints.bench.views import compare_url
from models_registry.selectors import artifact_get


def speed_comparison(artifact, *, user) -> dict | None:
    """For a quantized artifact: the latest finished benchmark (of the user's teams) of an endpoint serving it and
    of one serving its source, and the compare page of the two when both exist."""
    if not artifact.accuracy or artifact.parent_id is None:
        return None

    def latest(artifact_id):
        return (
            visible(BenchmarkRun.objects.filter(endpoint__artifact_id=artifact_id, status=BenchStatus.SUCCEEDED), user)
            .order_by("-pk")
            .first()
        )

    quantized, source = latest(artifact.pk), latest(artifact.parent_id)
    return {
        "quantized": quantized,
        "source": source,
        "url": compare_url([source.pk, quantized.pk]) if quantized and source else None,
    }


@require_role(VIEWER)
@require_GET
def artifact_speed(request, artifact_id: int):
    artifact = artifact_get(artifact_id, user=request.user)  # another team's: 404
    return render(request, "bench/_artifact_speed.html", {"speed": speed_comparison(artifact, user=request.user)})
