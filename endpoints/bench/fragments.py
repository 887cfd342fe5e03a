"""The serving-speed line of a quantized artifact's report, as an htmx fragment for the registry page."""

from django.shortcuts import get_object_or_404, render
from django.views.decorators.http import require_GET

from console.roles import VIEWER, require_role
from endpoints.bench.models import BenchmarkRun, BenchStatus
from endpoints.bench.views import compare_url
from models_registry.models import Artifact


def speed_comparison(artifact) -> dict | None:
    """For a quantized artifact: the latest finished benchmark of an endpoint serving it and of one
    serving its source, and the compare page of the two when both exist."""
    if not artifact.accuracy or artifact.parent_id is None:
        return None

    def latest(artifact_id):
        return (
            BenchmarkRun.objects.filter(endpoint__artifact_id=artifact_id, status=BenchStatus.SUCCEEDED)
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
    artifact = get_object_or_404(Artifact.objects.alive(), pk=artifact_id)
    return render(request, "bench/_artifact_speed.html", {"speed": speed_comparison(artifact)})
