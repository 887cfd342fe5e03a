"""Reads for the model registry."""
from django.contrib.contenttypes.models import ContentType
from django.db.models import Count, Q

from models_registry import hooks
from models_registry.models import Artifact, Model
from workers.jobs.selectors import jobs_on


def model_list():
    return Model.objects.alive().annotate(
        artifact_count=Count("artifacts", filter=~Q(artifacts__status=Artifact.Status.DELETED))
    )


def model_get(model_id: int) -> Model:
    return Model.objects.alive().get(pk=model_id)


def artifacts_of(model: Model):
    return model.artifacts.alive().select_related("parent", "producing_job").order_by("created_at", "id")


def artifact_get(artifact_id: int) -> Artifact:
    return Artifact.objects.alive().select_related("model", "parent").get(pk=artifact_id, model__deleted_at__isnull=True)


def artifact_jobs(artifact: Artifact):
    """The jobs that worked on the artifact, newest first."""
    return jobs_on(artifact).select_related("created_by", "target_type").prefetch_related("target")


def model_jobs_q(model_id: int) -> Q:
    """Jobs on the model or on any of its artifacts (also the job list's `model` filter)."""
    return (Q(target_type=ContentType.objects.get_for_model(Model), target_id=model_id)
            | Q(target_type=ContentType.objects.get_for_model(Artifact),
                target_id__in=Artifact.objects.filter(model_id=model_id).values("pk")))


def artifact_in_use(artifact: Artifact) -> list[str]:
    """Names of the endpoints that use the artifact (not stopped), as serving registered them."""
    return hooks.artifact_users(artifact)
