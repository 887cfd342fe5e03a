"""Reads for the model registry."""
from django.db.models import Count, Q

from models_registry import hooks
from models_registry.models import Artifact, Model


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


def artifact_in_use(artifact: Artifact) -> list[str]:
    """Names of the endpoints that use the artifact (not stopped), as serving registered them."""
    return hooks.artifact_users(artifact)
