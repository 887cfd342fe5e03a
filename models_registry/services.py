"""Writes for the model registry: register, delete, and queue hashing and conversions."""

import json
import logging

from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.utils import timezone

from console.audit import audit_log
from console.exceptions import Conflict, ServiceUnavailable
from console.teams import team_for_new
from console.validation import int_in_range
from models_registry.convert.atc import ATC_PRECISION_MODES, normalize_soc
from models_registry.convert.common import ConversionError
from models_registry.convert.sizes import estimate_output_bytes
from models_registry.inspection import InspectionError, inspect_path
from models_registry.lora import LoraError, base_mismatch, inspect_lora_dir
from models_registry.models import NAME_VALIDATOR, Artifact, Model
from models_registry.options import ConvertOptions
from models_registry.paths import PathRefused, validate_model_path
from models_registry.selectors import artifact_in_use, model_jobs_q, store_shortfall
from workers.jobs.models import Job
from workers.jobs.selectors import jobs_on
from workers.jobs.services import job_enqueue

log = logging.getLogger(__name__)

CONVERT_TARGETS = ("hf", "fp16", "bf16", "om")
HF_DTYPES = {"bfloat16", "float16"}
PRECISION_DTYPE = {"fp16": "float16", "bf16": "bfloat16"}


def _format_of(inspection: dict) -> str:
    fmt = inspection.get("format") or "hf"
    return fmt if fmt in Artifact.Format.values else Artifact.Format.HF


def _dtype_of(inspection: dict) -> str:
    quant = inspection.get("quantization") or {}
    return str(quant.get("scheme") or inspection.get("dtype") or "")


def model_register(
    *, name: str, path: str, user, description: str = "", team_id: int | None = None, request=None
) -> Model:
    """Register a model from a path on the server, for a team of the user's (console.teams.team_for_new). Nothing
    is written unless every check passes."""
    team_id = team_for_new(user, team_id)
    name = (name or "").strip()
    if not name:
        raise ValidationError({"name": "Enter a name."})
    try:
        NAME_VALIDATOR(name)
    except ValidationError as exc:
        raise ValidationError({"name": exc.messages}) from exc
    if Model.objects.filter(name=name).exists():
        raise ValidationError({"name": f"A model named {name!r} already exists."})
    try:
        resolved = validate_model_path(path)
    except ValidationError as exc:
        raise ValidationError({"path": exc.messages}) from exc
    try:
        inspection = inspect_path(resolved)
    except (InspectionError, PathRefused) as exc:  # PathRefused: a link planted since validate_model_path
        raise ValidationError({"path": str(exc)}) from exc
    try:
        with transaction.atomic():
            model = Model.objects.create(name=name, description=description, created_by=user, team_id=team_id)
            artifact = Artifact.objects.create(
                model=model,
                format=_format_of(inspection),
                dtype=_dtype_of(inspection),
                path=str(resolved),
                size_bytes=inspection.get("size_bytes"),
                inspection=inspection,
                status=Artifact.Status.READY,
                created_by=user,
            )
            audit_log(
                actor=user,
                action="model.register",
                obj=model,
                request=request,
                changes={"path": str(resolved), "format": artifact.format, "artifact": artifact.pk},
            )
            artifact_hash_enqueue(artifact=artifact)
    except IntegrityError as exc:  # a concurrent register of the same name
        raise ValidationError({"name": f"A model named {name!r} already exists."}) from exc
    return model


#: The artifacts an adapter is checked against: the model's own checkpoints (not its adapters, nor ONNX/OM exports).
ADAPTER_BASE_FORMATS = (Artifact.Format.HF, Artifact.Format.COMPRESSED_TENSORS, Artifact.Format.MODELSLIM)


def adapter_bases(model: Model) -> list[Artifact]:
    """The model's ready checkpoints an adapter must fit (each with config.json's sizes)."""
    return list(
        model.artifacts.alive().filter(status=Artifact.Status.READY, format__in=ADAPTER_BASE_FORMATS).order_by("pk")
    )


def adapter_register(*, model: Model, name: str, path: str, user, request=None) -> Artifact:
    """Register a LoRA adapter (a PEFT directory on the server) for `model`: an Artifact of format lora, refused
    unless its weights fit every ready checkpoint of the model (architecture, layers, each adapted module's widths)."""
    name = (name or "").strip()
    if not name:
        raise ValidationError({"name": "Enter the adapter's name (requests name it as their model)."})
    try:
        NAME_VALIDATOR(name)
    except ValidationError as exc:
        raise ValidationError({"name": exc.messages}) from exc
    if Artifact.objects.alive().filter(format=Artifact.Format.LORA, name=name).exists():
        raise ValidationError({"name": f"An adapter named {name!r} exists already."})
    try:
        resolved = validate_model_path(path)
    except ValidationError as exc:
        raise ValidationError({"path": exc.messages}) from exc
    try:
        inspection = inspect_lora_dir(resolved)
    except (LoraError, PathRefused) as exc:
        raise ValidationError({"path": str(exc)}) from exc
    bases = adapter_bases(model)
    if not bases:
        raise ValidationError({"path": f"{model.name} has no ready checkpoint to check the adapter against."})
    for base in bases:
        why = base_mismatch(
            inspection,
            base.inspection or {},
            adapter_name=f"Adapter {name!r} ({resolved})",
            base_name=f"{model.name} (artifact #{base.pk}, {base.path})",
        )
        if why:
            raise ValidationError({"path": why})
    try:
        with transaction.atomic():
            artifact = Artifact.objects.create(
                model=model,
                name=name,
                format=Artifact.Format.LORA,
                dtype=inspection.get("dtype") or "",
                path=str(resolved),
                size_bytes=inspection.get("size_bytes"),
                inspection=inspection,
                params={"checked_against": [b.pk for b in bases]},
                status=Artifact.Status.READY,
                created_by=user,
            )
            audit_log(
                actor=user,
                action="adapter.register",
                obj=artifact,
                request=request,
                changes={"model": model.pk, "name": name, "path": str(resolved), "rank": inspection["rank"]},
            )
            artifact_hash_enqueue(artifact=artifact)
    except IntegrityError as exc:  # the same name registered at the same moment
        raise ValidationError({"name": f"An adapter named {name!r} exists already."}) from exc
    return artifact


def artifact_hash_enqueue(*, artifact: Artifact, user=None) -> Job | None:
    """Checksums run in the background; a registration doesn't fail because Redis is down."""
    try:
        return job_enqueue(
            kind="hash_artifact",
            params={"artifact": artifact.pk},
            user=user,
            target=artifact,
            dedupe_key=f"hash_artifact:{artifact.pk}",
        )
    except (ServiceUnavailable, Conflict) as exc:
        log.warning("Checksum of %s not queued: %s", artifact, exc)
        return None


def artifact_delete(*, artifact: Artifact, user, request=None) -> Artifact:
    """Soft delete: the row stays for lineage and audit; files are left untouched."""
    users = artifact_in_use(artifact)
    if users:
        raise Conflict(f"Artifact #{artifact.pk} is used by endpoint(s) {', '.join(users)}: stop them first.")
    if artifact.status == Artifact.Status.BUILDING:  # its job would mark it ready under the delete
        raise Conflict(
            f"Artifact #{artifact.pk} is being built by job #{artifact.producing_job_id}: cancel the job "
            "first (that removes its output)."
        )
    # A pending checksum doesn't block a delete; a conversion reading the files does.
    if jobs_on(artifact).filter(status__in=Job.ACTIVE).exclude(kind="hash_artifact").exists():
        raise Conflict(f"Artifact #{artifact.pk} has running jobs: cancel them first.")
    was = artifact.status
    artifact.status = Artifact.Status.DELETED
    artifact.deleted_at = timezone.now()
    artifact.save(update_fields=["status", "deleted_at"])
    audit_log(actor=user, action="artifact.delete", obj=artifact, changes={"status": [was, "deleted"]}, request=request)
    return artifact


def model_delete(*, model: Model, user, request=None) -> Model:
    artifacts = list(model.artifacts.alive())
    for artifact in artifacts:
        users = artifact_in_use(artifact)
        if users:
            raise Conflict(f"{model.name} is served by endpoint(s) {', '.join(users)}: stop them first.")
    if Job.objects.filter(model_jobs_q(model.pk), status__in=Job.ACTIVE).exclude(kind="hash_artifact").exists():
        raise Conflict(f"{model.name} has running jobs: cancel them first.")
    with transaction.atomic():
        now = timezone.now()
        model.artifacts.alive().update(status=Artifact.Status.DELETED, deleted_at=now)
        # Free the name for a later registration; the row keeps its history.
        old_name = model.name
        model.name = f"{old_name}~deleted-{model.pk}"[:100]
        model.deleted_at = now
        model.save(update_fields=["name", "deleted_at"])
        audit_log(
            actor=user,
            action="model.delete",
            obj=model,
            request=request,
            changes={"name": old_name, "artifacts": [a.pk for a in artifacts]},
        )
    return model


# --- conversions -------------------------------------------------------------------

OM_MAX_BATCH = 64


def om_max_seq_len(artifact: Artifact) -> int:
    """The longest fixed sequence an OM export of this artifact may take: its context length."""
    return (artifact.inspection or {}).get("max_position_embeddings") or 32768


def convert_options_clean(*, artifact: Artifact, options: ConvertOptions) -> dict:
    """Check conversion options against the source artifact; return the canonical set (the job's params)."""
    if artifact.status != Artifact.Status.READY:
        raise ValidationError(f"Artifact #{artifact.pk} is {artifact.status}, not ready: it cannot be converted.")
    given = options.given()
    to = given.get("to")
    if to not in CONVERT_TARGETS:
        raise ValidationError({"to": f"Choose one of: {', '.join(CONVERT_TARGETS)}."})
    source_dtype = (artifact.inspection or {}).get("dtype") or artifact.dtype
    if to == "hf":
        if artifact.format != Artifact.Format.GGUF:
            raise ValidationError({"to": "Conversion to Hugging Face format needs a GGUF artifact."})
        dtype = given.get("dtype") or "bfloat16"
        if dtype not in HF_DTYPES:
            raise ValidationError({"dtype": "Choose bfloat16 or float16."})
        return {"to": to, "dtype": dtype}
    # Before the format check: a ModelSlim checkpoint has no HF form to convert to (a GGUF has: convert it first).
    if artifact.is_quantized and artifact.format != Artifact.Format.GGUF:
        raise ValidationError({"to": "This artifact is already quantized; convert its float parent instead."})
    if artifact.format != Artifact.Format.HF:
        raise ValidationError(
            {
                "to": f"Conversion to {to} needs a Hugging Face (safetensors) artifact; "
                f"this one is {artifact.format}. Convert it to HF first."
            }
        )
    if given.get("dtype") and to != "hf":
        raise ValidationError({"dtype": "dtype applies to GGUF → HF only; choose fp16 or bf16 as the target instead."})
    if to in PRECISION_DTYPE:
        if source_dtype == PRECISION_DTYPE[to]:
            raise ValidationError({"to": f"The artifact is already {source_dtype}."})
        return {"to": to}
    batch_size = int_in_range(given.get("batch_size"), "batch_size", low=1, high=OM_MAX_BATCH, default=1)
    seq_len = int_in_range(given.get("seq_len"), "seq_len", low=1, high=om_max_seq_len(artifact), default=128)
    soc = str(given.get("soc_version") or "").strip()
    if not soc:
        raise ValidationError(
            {"soc_version": "Name the target chip as npu-smi reports it, e.g. Ascend910B4 or Ascend310P3."}
        )
    try:  # ATC's own list, checked here and not first in the job after the ONNX export
        soc = normalize_soc(soc)
    except ConversionError as exc:
        raise ValidationError({"soc_version": str(exc)}) from exc
    precision_mode = given.get("precision_mode") or "force_fp16"
    if precision_mode not in ATC_PRECISION_MODES:
        raise ValidationError({"precision_mode": f"Choose one of: {', '.join(ATC_PRECISION_MODES)}."})
    return {
        "to": to,
        "batch_size": batch_size,
        "seq_len": seq_len,
        "soc_version": soc,
        "precision_mode": precision_mode,
    }


def convert_targets(*, artifact: Artifact) -> tuple[list[str], str]:
    """The targets the artifact converts to (by convert_options_clean's own rules) and, when there is
    none, why (one line)."""
    targets, reasons = [], []
    for to in CONVERT_TARGETS:
        try:
            convert_options_clean(artifact=artifact, options=ConvertOptions(to=to))
        except ValidationError as exc:
            if not hasattr(exc, "error_dict") or "to" in exc.error_dict:
                reasons.append(exc.message_dict["to"][0] if hasattr(exc, "error_dict") else exc.messages[0])
                continue
        targets.append(to)
    return targets, ("" if targets else reasons[-1])


def convert_output_bytes(*, artifact: Artifact, to: str) -> int:
    """The room a conversion of `artifact` reserves in the store (checked on request and at its job's start)."""
    return estimate_output_bytes(param_count=(artifact.inspection or {}).get("param_count") or 0, to=to)


def artifact_convert(
    *, artifact: Artifact, user, options: ConvertOptions, request=None, retry_of: Job | None = None
) -> Job:
    clean = convert_options_clean(artifact=artifact, options=options)
    # The target's own format: an OM conversion's ONNX intermediate carries the same options, and must not
    # block a second try at the OM after ATC failed.
    made = {"hf": Artifact.Format.HF, "fp16": Artifact.Format.HF, "bf16": Artifact.Format.HF, "om": Artifact.Format.OM}
    existing = (
        Artifact.objects.alive()
        .filter(parent=artifact, params=clean, status=Artifact.Status.READY, format=made[clean["to"]])
        .first()
    )
    if existing is not None:
        raise Conflict(
            f"This conversion already exists as artifact #{existing.pk}.",
            link=existing.get_absolute_url(),
            object_id=existing.pk,
        )
    shortfall = store_shortfall(needed=convert_output_bytes(artifact=artifact, to=clean["to"]), what="this conversion")
    if shortfall:
        raise ValidationError(shortfall)
    dedupe = f"convert:{artifact.pk}:{json.dumps(clean, sort_keys=True)}"
    with transaction.atomic():
        job = job_enqueue(
            kind="convert",
            params=clean,
            user=user,
            target=artifact,
            dedupe_key=dedupe,
            request=request,
            retry_of=retry_of,
        )
    return job
