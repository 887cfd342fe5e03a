"""Reads for the model registry."""

from pathlib import Path

from django.conf import settings
from django.contrib.contenttypes.models import ContentType
from django.db.models import Count, Q

from console.roles import VIEWER
from console.teams import visible, visible_get
from models_registry import hooks
from models_registry.models import Artifact, Model
from workers.jobs.context import free_bytes
from workers.jobs.selectors import jobs_on


def model_list(*, user):
    """The models of the user's teams (every team's for the console Admin)."""
    return visible(Model.objects.alive(), user).annotate(
        artifact_count=Count("artifacts", filter=~Q(artifacts__status=Artifact.Status.DELETED))
    )


def model_get(model_id: int, *, user, role: str = VIEWER) -> Model:
    """404 for another team's model; 403 where the user's role in its team is below `role`."""
    return visible_get(Model.objects.alive(), user, role=role, pk=model_id)


def artifacts_of(model: Model):
    return model.artifacts.alive().select_related("parent", "producing_job").order_by("created_at", "id")


def artifact_get(artifact_id: int, *, user, role: str = VIEWER) -> Artifact:
    """404 for another team's artifact; 403 where the user's role in its team is below `role`."""
    artifacts = Artifact.objects.alive().select_related("model", "parent")
    return visible_get(artifacts, user, role=role, pk=artifact_id)


def artifact_jobs(artifact: Artifact):
    """The jobs that worked on the artifact, newest first."""
    return jobs_on(artifact).select_related("created_by", "target_type").prefetch_related("target")


def model_jobs_q(model_id: int) -> Q:
    """Jobs on the model or on any of its artifacts (also the job list's `model` filter)."""
    return Q(target_type=ContentType.objects.get_for_model(Model), target_id=model_id) | Q(
        target_type=ContentType.objects.get_for_model(Artifact),
        target_id__in=Artifact.objects.filter(model_id=model_id).values("pk"),
    )


def artifact_in_use(artifact: Artifact) -> list[str]:
    """Names of the endpoints that use the artifact (not stopped), as serving registered them."""
    return hooks.artifact_users(artifact)


def store_shortfall(*, needed: int, what: str) -> str:
    """Why the artifact store cannot take `needed` more bytes for `what` ("this conversion") while keeping
    ARTIFACT_STORE_MIN_FREE_BYTES free, or "" when it can. Asked when the work is requested and again when its
    job starts: the disk may fill while the job waits in its queue."""
    keep = settings.ARTIFACT_STORE_MIN_FREE_BYTES
    free = max(free_bytes(Path(settings.ARTIFACT_STORE)) - keep, 0)
    if needed <= free:
        return ""
    return (
        f"Not enough room in the artifact store ({settings.ARTIFACT_STORE}): {what} needs about "
        f"{needed / 1e9:.2f} GB ({needed:,} bytes) and {free / 1e9:.2f} GB ({free:,} bytes) is available "
        f"(keeping {keep / 1e9:.1f} GB free)."
    )
