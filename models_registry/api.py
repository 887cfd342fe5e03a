from ninja import Router, Schema
from pydantic import ConfigDict

from console.api_auth import api_route
from console.roles import ADMIN, OPERATOR, VIEWER
from models_registry import selectors, services
from models_registry.capacity_view import artifact_capacity
from models_registry.models import Artifact, Model
from models_registry.options import ConvertOptions

router = Router(tags=["models"])


class ModelIn(Schema):
    model_config = ConfigDict(extra="forbid")  # a misspelt field is refused, not dropped

    name: str
    path: str
    description: str = ""
    team: int | None = None  # a team where the caller is an Operator; none: console.teams.team_for_new


class AdapterIn(Schema):
    model_config = ConfigDict(extra="forbid")

    name: str
    path: str


class ConvertIn(Schema):
    model_config = ConfigDict(extra="forbid")  # an unknown option is an error, not silently dropped

    to: str
    dtype: str | None = None
    batch_size: int | None = None
    seq_len: int | None = None
    soc_version: str | None = None
    precision_mode: str | None = None


def artifact_json(artifact: Artifact) -> dict:
    return {
        "id": artifact.pk,
        "model": artifact.model_id,
        "team": artifact.team_id,
        "format": artifact.format,
        "name": artifact.name or None,  # a LoRA adapter's
        "dtype": artifact.dtype,
        "status": artifact.status,
        "parent": artifact.parent_id,
        "producing_job": artifact.producing_job_id,
        "params": artifact.params,
        "path": artifact.path,
        "size_bytes": artifact.size_bytes,
        "sha256": artifact.sha256 or None,
        "servable": artifact.servable,
        "recommended": artifact.recommended,
        "inspection": artifact.inspection,
        "verification": artifact.verification or None,
        "accuracy": artifact.accuracy,
        "note": artifact.note,
        "created_at": artifact.created_at.isoformat(),
    }


def model_json(model: Model, *, with_artifacts=True) -> dict:
    data = {
        "id": model.pk,
        "name": model.name,
        "team": model.team_id,
        "description": model.description,
        "created_at": model.created_at.isoformat(),
    }
    if with_artifacts:
        data["artifacts"] = [artifact_json(a) for a in selectors.artifacts_of(model)]
    return data


@api_route(router, "get", "/models", role=VIEWER, response=list[dict])
def list_models(request):
    return [
        model_json(m, with_artifacts=False) | {"artifact_count": m.artifact_count}
        for m in selectors.model_list(user=request.user)
    ]


@api_route(router, "post", "/models", role=OPERATOR, response={201: dict})
def register_model(request, payload: ModelIn):
    model = services.model_register(
        name=payload.name,
        path=payload.path,
        description=payload.description,
        team_id=payload.team,
        user=request.user,
        request=request,
    )
    return 201, model_json(model)


@api_route(router, "get", "/models/{model_id}", role=VIEWER, response=dict)
def get_model(request, model_id: int):
    return model_json(selectors.model_get(model_id, user=request.user, role=VIEWER))


@api_route(router, "post", "/models/{model_id}/adapters", role=OPERATOR, response={201: dict})
def register_adapter(request, model_id: int, payload: AdapterIn):
    """Register a LoRA adapter (a PEFT directory inside MODEL_ROOTS) for this model; it must fit its checkpoints."""
    model = selectors.model_get(model_id, user=request.user, role=OPERATOR)
    adapter = services.adapter_register(
        model=model, name=payload.name, path=payload.path, user=request.user, request=request
    )
    return 201, artifact_json(adapter)


@api_route(router, "get", "/models/{model_id}/adapters", role=VIEWER, response=list[dict])
def list_adapters(request, model_id: int):
    model = selectors.model_get(model_id, user=request.user, role=VIEWER)
    return [artifact_json(a) for a in model.artifacts.alive().filter(format=Artifact.Format.LORA)]


@api_route(router, "delete", "/models/{model_id}", role=ADMIN, response={204: None})
def delete_model(request, model_id: int):
    services.model_delete(
        model=selectors.model_get(model_id, user=request.user, role=ADMIN), user=request.user, request=request
    )
    return 204, None


@api_route(router, "get", "/artifacts/{artifact_id}", role=VIEWER, response=dict)
def get_artifact(request, artifact_id: int):
    return artifact_json(selectors.artifact_get(artifact_id, user=request.user, role=VIEWER))


@api_route(router, "get", "/artifacts/{artifact_id}/capacity", role=VIEWER, response=dict)
def get_capacity(request, artifact_id: int, memory_utilization: float | None = None):
    artifact = selectors.artifact_get(artifact_id, user=request.user, role=VIEWER)
    return artifact_capacity(artifact, memory_utilization=memory_utilization)


@api_route(router, "delete", "/artifacts/{artifact_id}", role=ADMIN, response={204: None})
def delete_artifact(request, artifact_id: int):
    services.artifact_delete(
        artifact=selectors.artifact_get(artifact_id, user=request.user, role=ADMIN), user=request.user, request=request
    )
    return 204, None


@api_route(router, "post", "/artifacts/{artifact_id}/convert", role=OPERATOR, response={202: dict})
def convert_artifact(request, artifact_id: int, payload: ConvertIn):
    artifact = selectors.artifact_get(artifact_id, user=request.user, role=OPERATOR)
    job = services.artifact_convert(
        artifact=artifact, user=request.user, options=ConvertOptions(**payload.dict()), request=request
    )
    return 202, {"job": job.pk}
