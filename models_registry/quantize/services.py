"""Writes for quantization: calibration datasets and the quantize job (validated, deduplicated,
disk-checked and enqueued like a conversion)."""

from __future__ import annotations

import json

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.db.models import Q

from console.audit import audit_log
from console.exceptions import Conflict
from console.teams import team_for_new, visible_or_shared
from console.validation import NumberError, parse_float
from models_registry.models import NAME_VALIDATOR, Artifact
from models_registry.options import QuantizeOptions
from models_registry.quantize import selectors
from models_registry.quantize.calibrate import SUPPORTED_ARCHITECTURES
from models_registry.quantize.models import CalibrationDataset
from models_registry.quantize.msmodelslim_run import ANTI_OUTLIER
from models_registry.selectors import store_shortfall
from workers.jobs.models import Job
from workers.jobs.services import job_enqueue

TARGETS = (Artifact.Format.COMPRESSED_TENSORS, Artifact.Format.MODELSLIM)
SCHEMES = ("w8a8_dynamic", "w8a8_static", "w8a16")
METHODS = ("kl", "minmax", "histogram", "auto")
# Bounds of the numeric options: the web form parses within them, the service checks them (API, retries).
GATE_PCT = (0.0, 100.0)
SMOOTHING = (0.05, 1.0)
MAX_FALLBACK_LAYERS = (1, 256)
NUM_SAMPLES = (1, 1024)
MAX_SEQ_LEN = (16, 8192)
GUIDANCE = "Use 10–64 samples from the target domain (plain prose, chat logs or code as the model will see)."


# --- calibration datasets ------------------------------------------------------------------------


def parse_samples(content: str, *, filename: str = "") -> list[str]:
    """JSONL ({"text": ...} per line) or plain text (paragraphs separated by blank lines)."""
    content = content.lstrip("\ufeff")
    stripped = content.strip()
    if filename.endswith(".jsonl") or stripped.startswith("{"):
        samples = []
        for n, line in enumerate(content.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError:
                raise ValidationError(
                    {"file": f"Line {n} is not JSON: JSONL needs one {{\"text\": ...}} per line."}
                ) from None
            if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                raise ValidationError({"file": f"Line {n} has no \"text\" string."})
            if obj["text"].strip():
                samples.append(obj["text"].strip())
        return samples
    return [" ".join(p.split()) for p in content.split("\n\n") if p.strip()]


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def dataset_upload_check(size: int | None) -> None:
    """An uploaded file, by its size (the upload's .size, known before it is read): at most
    QUANTIZE_MAX_DATASET_CHARS bytes, the limit on its text in characters (a UTF-8 text has at least as many
    bytes as characters), so a file too large is refused without being read into memory."""
    limit = settings.QUANTIZE_MAX_DATASET_CHARS
    if size is not None and size > limit:
        raise ValidationError(
            {
                "file": f"The file is {_size(size)}: an uploaded set may have at most {limit} bytes "
                f"({_size(limit)}, QUANTIZE_MAX_DATASET_CHARS)."
            }
        )


def dataset_create(
    *,
    name: str,
    content: str,
    user,
    filename: str = "",
    purpose: str = "calibration",
    description: str = "",
    source: str = "",
    request=None,
) -> CalibrationDataset:
    name = (name or "").strip()
    try:
        NAME_VALIDATOR(name)
    except ValidationError as exc:
        raise ValidationError({"name": exc.messages}) from exc
    if purpose not in CalibrationDataset.Purpose.values:
        raise ValidationError({"purpose": "Choose calibration or evaluation."})
    for field, text in (("source", source), ("description", description)):
        limit = getattr(CalibrationDataset._meta.get_field(field), "max_length", None)
        if limit and len(text or "") > limit:
            raise ValidationError({field: f"Keep the {field} under {limit} characters."})
    limit = settings.QUANTIZE_MAX_DATASET_CHARS
    if len(content) > limit:
        message = f"The text has {len(content)} characters: at most {limit} (QUANTIZE_MAX_DATASET_CHARS)."
        raise ValidationError({"file": message})
    samples = parse_samples(content, filename=filename)
    if not samples:
        raise ValidationError({"file": "The upload holds no text."})
    if purpose == "calibration" and len(samples) < settings.QUANTIZE_MIN_SAMPLES:
        raise ValidationError(
            {
                "file": f"{len(samples)} sample(s) is too few to calibrate: at least "
                f"{settings.QUANTIZE_MIN_SAMPLES}. {GUIDANCE}"
            }
        )
    try:
        with transaction.atomic():
            ds = CalibrationDataset.objects.create(
                name=name,
                purpose=purpose,
                description=description,
                source=source,
                samples=samples,
                sample_count=len(samples),
                char_count=sum(map(len, samples)),
                created_by=user,
                team_id=team_for_new(user, None) if user is not None else None,  # the uploader's team
            )
            audit_log(
                actor=user,
                action="calibration.create",
                obj=ds,
                request=request,
                changes={"samples": len(samples), "purpose": purpose},
            )
    except IntegrityError as exc:
        raise ValidationError({"name": f"A dataset named {name!r} already exists."}) from exc
    return ds


def dataset_delete(*, dataset: CalibrationDataset, user, request=None) -> None:
    """Delete an uploaded dataset; the built-in defaults stay, and so does a set an active quantize job reads."""
    if dataset.builtin:
        raise Conflict(
            f"{dataset.name} is a built-in default dataset: it cannot be deleted.", link=dataset.get_absolute_url()
        )
    with transaction.atomic():
        user_job = (
            Job.objects.select_for_update()
            .filter(kind="quantize", status__in=Job.ACTIVE)
            .filter(Q(params__calibration=dataset.pk) | Q(params__evaluation=dataset.pk))
            .first()
        )
        if user_job is not None:
            raise Conflict(
                f"Quantize job #{user_job.pk} ({user_job.status}) uses {dataset.name}: delete it once the "
                "job has ended.",
                link=user_job.get_absolute_url(),
                object_id=user_job.pk,
            )
        audit_log(
            actor=user,
            action="calibration.delete",
            obj=dataset,
            request=request,
            changes={"name": dataset.name, "purpose": dataset.purpose, "samples": dataset.sample_count},
        )
        dataset.delete()


# --- quantize -------------------------------------------------------------------------------------


def _dataset(value, purpose: str, field: str, user) -> CalibrationDataset:
    """A dataset by id or name: a built-in one or of the user's teams (another team's is as unknown)."""
    if value in (None, "", "default"):
        return selectors.default_dataset(purpose)
    qs = visible_or_shared(CalibrationDataset.objects.all(), user) if user is not None else CalibrationDataset.objects
    ds = qs.filter(pk=value).first() if str(value).isdigit() else qs.filter(name=value).first()
    if ds is None:
        raise ValidationError({field: f"No calibration dataset {value!r}."})
    return ds


def _number(opts, key, default, bounds):
    """A typed option (or its default), checked against its bounds."""
    value = opts.get(key, default)
    low, high = bounds
    try:
        parse_float(value, key, low=low, high=high, accept_text=False)  # typed already: the bounds only
    except NumberError:
        raise ValidationError({key: f"Enter a number between {low} and {high}."}) from None
    return value


def quantize_options_clean(*, artifact: Artifact, options: QuantizeOptions, user=None) -> dict:
    """Check quantize options against the source artifact; return the canonical set (the job's params)."""
    if artifact.status != Artifact.Status.READY:
        raise ValidationError(f"Artifact #{artifact.pk} is {artifact.status}, not ready: it cannot be quantized.")
    given = options.given()
    if artifact.format != Artifact.Format.HF:
        raise ValidationError(
            {
                "target": f"Quantization needs a Hugging Face (safetensors) artifact; this one is "
                f"{artifact.format}. Convert it to HF first."
            }
        )
    inspection = artifact.inspection or {}
    if inspection.get("quantization"):
        raise ValidationError({"target": "This artifact is already quantized; quantize its float parent instead."})
    arch = inspection.get("architecture")
    if arch and arch not in SUPPORTED_ARCHITECTURES:
        raise ValidationError(
            {
                "target": f"Unsupported architecture {arch}: quantization here (llm-compressor and the "
                f"ModelSlim writer) supports {', '.join(SUPPORTED_ARCHITECTURES)}."
            }
        )
    target = given.get("target") or "compressed-tensors"
    if target not in TARGETS:
        raise ValidationError({"target": f"Choose one of: {', '.join(TARGETS)}."})
    scheme = (given.get("scheme") or "w8a8_dynamic").lower()
    if scheme not in SCHEMES:
        raise ValidationError({"scheme": f"Choose one of: {', '.join(SCHEMES)}."})
    if target == Artifact.Format.MODELSLIM:
        support = selectors.modelslim_scheme_support()[scheme]
        if not support.supported:
            raise ValidationError({"scheme": support.refusal()})
    method = given.get("method") or "kl"
    if method not in METHODS:
        raise ValidationError({"method": f"Choose one of: {', '.join(METHODS)}."})
    calib = _dataset(given.get("calibration"), "calibration", "calibration", user)
    evaluation = _dataset(given.get("evaluation"), "evaluation", "evaluation", user)
    if calib.pk == evaluation.pk or set(calib.samples) & set(evaluation.samples):
        raise ValidationError({"evaluation": "The evaluation set overlaps the calibration set: use separate text."})
    if calib.sample_count < settings.QUANTIZE_MIN_SAMPLES:
        raise ValidationError(
            {
                "calibration": f"{calib.name} has {calib.sample_count} sample(s); at least "
                f"{settings.QUANTIZE_MIN_SAMPLES} are needed. {GUIDANCE}"
            }
        )
    smoothing = given.get("smoothing")
    smoothing = None if smoothing in (None, "", 0, False) else _number(given, "smoothing", 0.8, SMOOTHING)
    if smoothing and target == Artifact.Format.MODELSLIM:
        raise ValidationError(
            {
                "smoothing": "SmoothQuant strength is for compressed-tensors; for Ascend ModelSlim "
                "choose msModelSlim's outlier suppression (anti_outlier m1–m6)."
            }
        )

    anti_outlier = given.get("anti_outlier") or None
    if anti_outlier is not None:
        if target != Artifact.Format.MODELSLIM:
            raise ValidationError(
                {
                    "anti_outlier": "msModelSlim's outlier suppression is for the Ascend ModelSlim "
                    "target; for compressed-tensors use SmoothQuant (smoothing)."
                }
            )
        if anti_outlier not in ANTI_OUTLIER:
            raise ValidationError({"anti_outlier": f"Choose one of: {', '.join(ANTI_OUTLIER)}."})
        if scheme == "w8a16" and anti_outlier != "m3":
            raise ValidationError({"anti_outlier": "With W8A16 msModelSlim offers only m3 (weight-aware)."})
    clean = {
        "target": target,
        "scheme": scheme,
        "method": method,
        "calibration": calib.pk,
        "evaluation": evaluation.pk,
        "smoothing": smoothing,
        "anti_outlier": anti_outlier,
        "gate_pct": _number(given, "gate_pct", settings.QUANTIZE_GATE_PCT, GATE_PCT),
        "fallback": bool(given.get("fallback", True)),
        "max_fallback_layers": _number(given, "max_fallback_layers", 16, MAX_FALLBACK_LAYERS),
        "num_samples": _number(given, "num_samples", 64, NUM_SAMPLES),
        "max_seq_len": _number(given, "max_seq_len", 512, MAX_SEQ_LEN),
        # GPTQ by default for compressed-tensors: it is what brings W8A8 within the 2 % gate (docs/benchmarks.md).
        "gptq": bool(given.get("gptq", True)) and target == Artifact.Format.COMPRESSED_TENSORS,
        "serve_check": bool(given.get("serve_check", settings.QUANTIZE_SERVE_CHECK)),
    }
    return clean


def quantize_output_bytes(*, artifact: Artifact) -> int:
    """The room a quantization of `artifact` reserves in the store (checked on request and at its job's start):
    int8 weights with their scales, and the float layers a fallback keeps."""
    return int(((artifact.inspection or {}).get("param_count") or 0) * 1.2) + 64 * 1024**2


def artifact_quantize(
    *, artifact: Artifact, user, options: QuantizeOptions, request=None, retry_of: Job | None = None
) -> Job:
    clean = quantize_options_clean(artifact=artifact, options=options, user=user)
    same = {k: v for k, v in clean.items() if k != "serve_check"}
    for existing in Artifact.objects.alive().filter(
        parent=artifact, status=Artifact.Status.READY, format=clean["target"]
    ):
        if {k: v for k, v in (existing.params or {}).items() if k != "serve_check"} == same:
            raise Conflict(
                f"This quantization already exists as artifact #{existing.pk}.",
                link=existing.get_absolute_url(),
                object_id=existing.pk,
            )
    shortfall = store_shortfall(needed=quantize_output_bytes(artifact=artifact), what="this quantization")
    if shortfall:
        raise ValidationError(shortfall)
    dedupe = f"quantize:{artifact.pk}:{json.dumps(same, sort_keys=True)}"
    with transaction.atomic():
        job = job_enqueue(
            kind="quantize",
            params=clean,
            user=user,
            target=artifact,
            dedupe_key=dedupe,
            request=request,
            retry_of=retry_of,
        )
    return job
