from dataclasses import fields
from typing import Literal

from django.http import Http404
from ninja import Router, Schema
from pydantic import ConfigDict, create_model

from console.api_auth import api_route
from console.roles import OPERATOR, VIEWER
from models_registry.options import QuantizeOptions
from models_registry.quantize import selectors, services
from models_registry.quantize.accuracy import labelled
from models_registry.quantize.models import CalibrationDataset
from models_registry.selectors import artifact_get

router = Router(tags=["quantization"])


class _StrictSchema(Schema):
    model_config = ConfigDict(extra="forbid")


# One declaration of the options (models_registry/options.py): the API's body is QuantizeOptions' fields, each
# optional (absent: the service's default, quantize_options_clean), and no other key.
QuantizeIn = create_model(
    "QuantizeIn",
    __base__=_StrictSchema,
    **{option.name: (option.type, option.default) for option in fields(QuantizeOptions)},
)


class DatasetIn(Schema):
    model_config = ConfigDict(extra="forbid")

    name: str
    content: str
    format: Literal["jsonl", "text"] = "jsonl"
    purpose: str = "calibration"
    description: str = ""
    source: str = ""


def dataset_json(ds: CalibrationDataset, *, samples: bool = False) -> dict:
    data = {
        "id": ds.pk,
        "name": ds.name,
        "team": ds.team_id,  # none: a built-in dataset, everyone's
        "purpose": ds.purpose,
        "description": ds.description,
        "source": ds.source,
        "sample_count": ds.sample_count,
        "char_count": ds.char_count,
        "builtin": ds.builtin,
        "preview": ds.preview(),
        "guidance": services.GUIDANCE,
        "created_at": ds.created_at.isoformat(),
    }
    if samples:
        data["samples"] = ds.samples
    return data


@api_route(router, "post", "/artifacts/{artifact_id}/quantize", role=OPERATOR, response={202: dict})
def quantize_artifact(request, artifact_id: int, payload: QuantizeIn):
    artifact = artifact_get(artifact_id, user=request.user, role=OPERATOR)  # another team's: 404
    job = services.artifact_quantize(
        artifact=artifact,
        user=request.user,
        options=QuantizeOptions(**payload.dict(exclude_unset=True)),
        request=request,
    )
    return 202, {"job": job.pk}


@api_route(router, "get", "/artifacts/{artifact_id}/accuracy", role=VIEWER, response=dict)
def artifact_accuracy(request, artifact_id: int):
    """The quantize job's accuracy report of an artifact it made, each figure with how it was measured
    (``measured_by``: "simulated" on the CPU, or "engine" for the serving check through vLLM; accuracy.py)."""
    artifact = artifact_get(artifact_id, user=request.user)  # another team's: 404
    if not artifact.accuracy:
        raise Http404(f"Artifact #{artifact.pk} has no accuracy report: only a quantize job's output has one.")
    return labelled(artifact.accuracy)


@api_route(router, "get", "/calibration-datasets", role=VIEWER, response=list[dict])
def list_datasets(request):
    return [dataset_json(d) for d in selectors.dataset_list(user=request.user)]


@api_route(router, "post", "/calibration-datasets", role=OPERATOR, response={201: dict})
def create_dataset(request, payload: DatasetIn):
    ds = services.dataset_create(
        name=payload.name,
        content=payload.content,
        user=request.user,
        filename="x.jsonl" if payload.format == "jsonl" else "x.txt",
        purpose=payload.purpose,
        description=payload.description,
        source=payload.source,
        request=request,
    )
    return 201, dataset_json(ds)


@api_route(router, "get", "/calibration-datasets/{dataset_id}", role=VIEWER, response=dict)
def get_dataset(request, dataset_id: int):
    return dataset_json(selectors.dataset_get(dataset_id, user=request.user), samples=True)
