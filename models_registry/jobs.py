"""The registry's job kinds: checksums and conversions (quantization: models_registry.quantize.jobs).
Run inside a worker by workers.jobs, which owns claiming, logging, heartbeat, cancel and failure.
Imported by ModelsRegistryConfig.ready(): defining a JobRunner subclass registers it."""

import hashlib
import logging
from importlib import metadata
from pathlib import Path

from django.db import transaction

from console.audit import audit_log
from models_registry import convert as conversion
from models_registry.inspection import inspect_path
from models_registry.models import Artifact, Model
from models_registry.options import ConvertOptions
from models_registry.paths import (
    PathRefused,
    artifact_store_dir,
    check_tree,
    confine,
    open_confined,
    remove_unfinished_output,
    tree_files,
    tree_size,
)
from models_registry.selectors import model_jobs_q, store_shortfall
from models_registry.services import artifact_convert, artifact_hash_enqueue, convert_output_bytes
from workers.jobs.context import JobCancelled, JobFailed
from workers.jobs.models import Job
from workers.jobs.registry import register_target_filter
from workers.jobs.runner import JobRunner

log = logging.getLogger("console.job")
CHUNK = 8 * 1024 * 1024
# The libraries a conversion's output depends on (the GGUF reader, the ONNX exporter's), named in its record.
CONVERT_LIBRARIES = ("torch", "transformers", "safetensors", "gguf", "onnx")


class ArtifactJobRunner(JobRunner):
    """A job on an artifact (its target) that may build new artifacts (named by result["artifact_id"]).
    Subclasses do their work in work(); a file that leads outside the model roots fails the job with
    the refusal's message (models_registry.paths), and the runtime removes the staging directory."""

    def run(self, job, ctx) -> dict:
        try:
            return self.work(job, ctx)
        except PathRefused as exc:
            raise JobFailed(str(exc)) from exc

    def work(self, job, ctx) -> dict:
        raise NotImplementedError

    def on_failure(self, job) -> None:
        """A job that did not succeed leaves its 'building' artifacts marked failed, and the output a killed job
        committed before marking it ready removed (files first: a cleanup cut short is run again)."""
        note = job.error or f"job {job.status}"
        for artifact in Artifact.objects.filter(producing_job=job, status=Artifact.Status.BUILDING):
            if remove_unfinished_output(artifact.path):
                log.warning("removed %s: artifact #%s never became ready", artifact.path, artifact.pk)
            # Conditional, one artifact at a time: this cleanup runs more than once (the worker, a Cancel, the
            # reaper), and only the run that moves the row writes its audit entry.
            with transaction.atomic():
                if Artifact.objects.filter(pk=artifact.pk, status=Artifact.Status.BUILDING).update(
                    status=Artifact.Status.FAILED, note=note
                ):
                    audit_log(
                        action="artifact.failed",
                        obj=artifact,
                        via="system",
                        changes={
                            "status": [Artifact.Status.BUILDING, Artifact.Status.FAILED],
                            "job": job.pk,
                            "note": note[:1000],
                        },
                    )

    def result_object(self, job):
        artifact_id = job.result.get("artifact_id")
        return Artifact.objects.filter(pk=artifact_id).first() if artifact_id else None


class HashArtifact(ArtifactJobRunner):
    name = "hash_artifact"
    queue = "default"
    timeout = 3600

    def work(self, job, ctx) -> dict:
        return hash_artifact(job, ctx)


class Convert(ArtifactJobRunner):
    name = "convert"
    queue = "convert"
    timeout = 4 * 3600

    def work(self, job, ctx) -> dict:
        return convert_artifact(job, ctx)

    def resubmit(self, *, job, user, request=None):
        """The same options, validated again (the source may have been deleted meanwhile)."""
        return artifact_convert(
            artifact=job.target,
            user=user,
            options=ConvertOptions.from_params(job.params),
            request=request,
            retry_of=job,
        )


register_target_filter("model", jobs_q=model_jobs_q, choices=lambda: Model.objects.alive())


def live_source(pk: int) -> Artifact:
    """The artifact a job reads, as it is when the job starts: a delete (of it or its model) between the request
    and the job, unseen by either, fails the job instead of converting files nobody sees."""
    source = Artifact.objects.select_related("model").get(pk=pk)
    if source.deleted_at is not None or source.model.deleted_at is not None:
        raise JobFailed(f"Artifact #{pk} was deleted after this job was queued: nothing was read.")
    if source.status != Artifact.Status.READY:
        raise JobFailed(f"Artifact #{pk} is {source.status}, not ready: nothing was read.")
    return source


def run_facts(*, libraries: tuple[str, ...]) -> dict:
    """What a job's numbers depend on besides its inputs, recorded with them: torch's thread count (CPU
    reductions round differently per count) and the versions of the libraries that ran (None: not installed)."""
    import torch

    versions = {}
    for dist in libraries:
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = None
    return {"threads": torch.get_num_threads(), "versions": versions}


def check_room(*, needed: int, what: str) -> None:
    """The request's free-space check again as the job starts: the disk may have filled while it was queued.
    Fails the job before it writes anything."""
    shortfall = store_shortfall(needed=needed, what=what)
    if shortfall:
        raise JobFailed(f"{shortfall} The disk filled after the job was queued: nothing was written.")


def hash_artifact(job, ctx) -> dict:
    artifact = live_source(job.params["artifact"])
    root = Path(artifact.path)
    confine(root)
    files = tree_files(root)
    total = sum(p.stat().st_size for p in files) or 1
    done = 0
    digests = {}
    for path in files:
        digest = hashlib.sha256()
        with open_confined(path, tree=root) as handle:
            while chunk := handle.read(CHUNK):
                digest.update(chunk)
                done += len(chunk)
                ctx.progress(100 * done / total, f"sha256 {path.name}")
        digests[str(path.relative_to(root)) if root.is_dir() else path.name] = digest.hexdigest()
    combined = hashlib.sha256("".join(f"{name}\0{d}\n" for name, d in sorted(digests.items())).encode()).hexdigest()
    Artifact.objects.filter(pk=artifact.pk).update(sha256=combined, file_hashes=digests)
    log.info("sha256 of %d file(s): %s", len(digests), combined)
    return {"sha256": combined, "files": len(digests)}


def _destination(source: Artifact, job, suffix: str) -> Path:
    return artifact_store_dir(source.model.name) / f"{source.pk}-{suffix}-job{job.pk}"


def _scaled(ctx, low: float, high: float):
    def report(pct: float, stage: str) -> None:
        ctx.progress(low + (high - low) * pct / 100.0, stage)

    return report


def _building(source: Artifact, job, *, fmt: str, dtype: str, dest: Path, params: dict) -> Artifact:
    return Artifact.objects.create(
        model=source.model,
        parent=source,
        producing_job=job,
        params=params,
        format=fmt,
        dtype=dtype,
        path=str(dest),
        status=Artifact.Status.BUILDING,
        created_by=job.created_by,
    )


def _ready(artifact: Artifact, dest: Path, **extra) -> None:
    """Mark a committed output ready, only while its job still runs and the row still says building: a Cancel,
    a reap or a delete meanwhile wins (its cleanup removes the output), never the other way round."""
    inspection = inspect_path(dest) if fmt_inspectable(artifact.format) else {}
    size = inspection.get("size_bytes") or tree_size(dest)
    with transaction.atomic():
        running = Job.objects.select_for_update().filter(pk=artifact.producing_job_id, status=Job.Status.RUNNING)
        if not running.exists():
            raise JobCancelled(f"artifact #{artifact.pk}: the job ended before its output was ready")
        if not Artifact.objects.filter(pk=artifact.pk, status=Artifact.Status.BUILDING).update(
            status=Artifact.Status.READY, inspection=inspection, size_bytes=size, **extra
        ):
            raise JobFailed(f"Artifact #{artifact.pk} was deleted while it was being built.")
        audit_log(
            action="artifact.ready",
            obj=artifact,
            via="system",
            changes={
                "status": [Artifact.Status.BUILDING, Artifact.Status.READY],
                "job": artifact.producing_job_id,
                "size_bytes": size,
            },
        )
    artifact.refresh_from_db()
    transaction.on_commit(lambda: artifact_hash_enqueue(artifact=artifact))


def fmt_inspectable(fmt: str) -> bool:
    return fmt in {Artifact.Format.HF, Artifact.Format.GGUF}


def convert_artifact(job, ctx) -> dict:
    source = live_source(job.target_id)
    check_tree(source.path)  # transformers and safetensors read the source themselves: nothing may lead out
    opts = job.params
    to = opts["to"]
    check_room(needed=convert_output_bytes(artifact=source, to=to), what="this conversion")
    facts = run_facts(libraries=CONVERT_LIBRARIES)  # in the job's result, as a quantization records it
    try:
        if to == "hf":
            dest = _destination(source, job, f"hf-{opts['dtype']}")
            out = _building(source, job, fmt=Artifact.Format.HF, dtype=opts["dtype"], dest=dest, params=opts)
            staging = ctx.staging_dir(dest)
            ctx.progress(1, "loading and dequantising the GGUF")
            directory, gguf_name = conversion.resolve_model_source(Path(source.path))  # a folder holding one GGUF too
            if gguf_name is None:
                raise JobFailed(f"{source.path} holds no GGUF file to convert.")
            conversion.gguf_to_hf(directory / gguf_name, staging, dtype=opts["dtype"], progress=_scaled(ctx, 1, 95))
            ctx.commit_staging(staging, dest)
            _ready(out, dest)
            return {"artifact_id": out.pk, "reproducibility": facts}
        if to in ("fp16", "bf16"):
            dtype = {"fp16": "float16", "bf16": "bfloat16"}[to]
            dest = _destination(source, job, to)
            out = _building(source, job, fmt=Artifact.Format.HF, dtype=dtype, dest=dest, params=opts)
            staging = ctx.staging_dir(dest)
            conversion.convert_precision(Path(source.path), staging, dtype=dtype, progress=_scaled(ctx, 0, 70))
            ctx.progress(75, "verifying logits against the source")
            verification = conversion.compare_logits(Path(source.path), staging)
            log.info("verification: %s", verification)
            ctx.commit_staging(staging, dest)
            # The logits figures are the thread count's too: kept with them on the artifact.
            _ready(out, dest, verification={**verification, "reproducibility": facts})
            return {"artifact_id": out.pk, "verification": verification, "reproducibility": facts}
        # to == "om": ONNX first (kept as an artifact), then ATC.
        shape = f"b{opts['batch_size']}-s{opts['seq_len']}"
        onnx_dest = _destination(source, job, f"onnx-{shape}")
        onnx = _building(source, job, fmt=Artifact.Format.ONNX, dtype="float32", dest=onnx_dest, params=opts)
        staging = ctx.staging_dir(onnx_dest)
        conversion.export_onnx(
            Path(source.path),
            staging,
            batch_size=opts["batch_size"],
            seq_len=opts["seq_len"],
            progress=_scaled(ctx, 0, 60),
        )
        ctx.commit_staging(staging, onnx_dest)
        _ready(onnx, onnx_dest, note="Intermediate for ATC; not servable by vLLM.")
        om_dest = _destination(source, job, f"om-{opts['soc_version']}-{shape}")
        om = _building(source, job, fmt=Artifact.Format.OM, dtype=opts["precision_mode"], dest=om_dest, params=opts)
        staging = ctx.staging_dir(om_dest)
        ctx.progress(65, "running ATC")
        conversion.run_atc(
            onnx_dest / "model.onnx",
            staging / "model",
            soc_version=opts["soc_version"],
            precision_mode=opts["precision_mode"],
        )
        ctx.commit_staging(staging, om_dest)
        _ready(om, om_dest, note="Offline model for ACL/MindIE; not servable by vLLM.")
        return {"artifact_id": om.pk, "onnx_artifact_id": onnx.pk, "reproducibility": facts}
    except conversion.ConversionError as exc:
        raise JobFailed(str(exc)) from exc
