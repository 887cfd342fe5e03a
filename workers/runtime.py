"""What runs inside a worker for every job: claim the row, capture logging into it,
keep a heartbeat, report progress, honour cancel, and record the outcome.

Modelled on NetBox's job runner: the row is the truth, the RQ job only carries the id."""
import logging
import os
import shutil
import socket
import threading
import time
import traceback
from importlib import import_module
from pathlib import Path

from django.conf import settings
from django.db import close_old_connections, connection
from django.utils import timezone

from workers.models import Job

log = logging.getLogger("console.job")

# kind -> "module:function"; a handler takes (job, ctx) and returns a result dict.
HANDLERS = {
    "hash_artifact": "models_registry.jobs_impl:hash_artifact",
    "convert": "models_registry.jobs_impl:convert_artifact",
    "bench": "endpoints.bench.jobs_impl:run_benchmark",
    "quantize": "models_registry.quantize.jobs_impl:quantize_artifact",
}

# Seconds a job of each kind may run before RQ stops it.
TIMEOUTS = {"hash_artifact": 3600, "convert": 4 * 3600, "quantize": 6 * 3600, "bench": 3600}
QUEUES = {"hash_artifact": "default", "convert": "convert", "quantize": "quantize", "bench": "bench"}
LOG_LIMIT = 200_000  # characters of log kept on the row (the tail)


class JobCancelled(Exception):
    pass


class JobFailed(Exception):
    """A failure with a message meant for the operator (no traceback needed)."""


class _RowLogHandler(logging.Handler):
    """Collects the job's logging and writes it to the row at most once a second."""

    def __init__(self, job_id):
        super().__init__(logging.INFO)
        self.job_id = job_id
        self.lines: list[str] = []
        self.last_flush = 0.0
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))

    def emit(self, record):
        try:
            self.lines.append(self.format(record))
        except Exception:  # a bad log call must not break the job
            return
        if time.monotonic() - self.last_flush > 1:
            self.flush()

    def flush(self):
        self.last_flush = time.monotonic()
        text = "\n".join(self.lines)[-LOG_LIMIT:]
        Job.objects.filter(pk=self.job_id).update(log=text)


class JobContext:
    """Handed to every job handler: progress, staging directories and the job's logger."""

    def __init__(self, job: Job):
        self.job = job
        self.log = log

    def progress(self, pct: float, stage: str | None = None) -> None:
        """Record progress and stop here if the job was cancelled meanwhile."""
        fields = {"progress": max(0.0, min(100.0, float(pct)))}
        if stage is not None:
            fields["stage"] = stage[:200]
            log.info("%s (%.0f%%)", stage, fields["progress"])
        Job.objects.filter(pk=self.job.pk).update(**fields)
        self.check_cancelled()

    def check_cancelled(self) -> None:
        status = Job.objects.filter(pk=self.job.pk).values_list("status", flat=True).first()
        if status == Job.Status.CANCELLED:
            raise JobCancelled()

    def staging_dir(self, destination: Path) -> Path:
        """A temporary directory beside `destination` (same filesystem, so the final
        rename is atomic). Recorded on the row so a reaper can remove it if we die."""
        destination = Path(destination)
        destination.parent.mkdir(parents=True, exist_ok=True)
        staging = destination.parent / f".staging-job{self.job.pk}-{destination.name}"
        if staging.exists():
            shutil.rmtree(staging)
        staging.mkdir()
        Job.objects.filter(pk=self.job.pk).update(staging_path=str(staging))
        self.job.staging_path = str(staging)
        return staging

    def commit_staging(self, staging: Path, destination: Path) -> None:
        self.check_cancelled()
        os.replace(staging, destination)
        Job.objects.filter(pk=self.job.pk).update(staging_path="")
        self.job.staging_path = ""


def remove_staging(job: Job) -> bool:
    """Remove what a job left half-written. Idempotent; True if something was removed."""
    path = job.staging_path
    if not path:
        return False
    removed = False
    staging = Path(path)
    if staging.exists():
        shutil.rmtree(staging, ignore_errors=True)
        removed = not staging.exists()
    if not staging.exists():
        Job.objects.filter(pk=job.pk).update(staging_path="")
        job.staging_path = ""
    return removed


def _heartbeat(job_id: int, stop: threading.Event) -> None:
    try:
        while not stop.wait(settings.JOB_HEARTBEAT_SECONDS):
            Job.objects.filter(pk=job_id, status=Job.Status.RUNNING).update(heartbeat_at=timezone.now())
    finally:
        connection.close()


def _handler(kind: str):
    module_name, func = HANDLERS[kind].split(":")
    return getattr(import_module(module_name), func)


def _finish(job: Job, status: str, **fields) -> bool:
    """Write the outcome unless someone else (cancel, reaper) already ended the job."""
    now = timezone.now()
    updated = Job.objects.filter(pk=job.pk, status=Job.Status.RUNNING).update(
        status=status, finished_at=now, **fields
    )
    return bool(updated)


def run_job(job_id: int, worker_name: str = "") -> str:
    close_old_connections()
    now = timezone.now()
    # Race-safe claim: only a queued row becomes running, once.
    claimed = Job.objects.filter(pk=job_id, status=Job.Status.QUEUED).update(
        status=Job.Status.RUNNING, started_at=now, heartbeat_at=now, pid=os.getpid(),
        node=settings.NODE_NAME, worker_name=worker_name or socket.gethostname(), stage="starting",
    )
    if not claimed:
        return "skipped"  # cancelled while queued, or already run
    job = Job.objects.get(pk=job_id)
    handler = logging.getLogger("console.job")
    row_log = _RowLogHandler(job_id)
    handler.addHandler(row_log)
    handler.setLevel(logging.INFO)
    stop = threading.Event()
    beat = threading.Thread(target=_heartbeat, args=(job_id, stop), daemon=True)
    beat.start()
    ctx = JobContext(job)
    outcome = Job.Status.FAILED
    try:
        result = _handler(job.kind)(job, ctx) or {}
        ctx.check_cancelled()
        _finish(job, Job.Status.SUCCEEDED, progress=100, stage="done", result=result,
                result_artifact_id=result.get("artifact_id"))
        outcome = Job.Status.SUCCEEDED
    except JobCancelled:
        log.warning("Cancelled.")
        outcome = Job.Status.CANCELLED
    except JobFailed as exc:
        log.error("%s", exc)
        _finish(job, Job.Status.FAILED, error=str(exc))
    except Exception as exc:  # anything else: keep the traceback for Admins
        log.exception("Job failed")
        _finish(job, Job.Status.FAILED, error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
    finally:
        stop.set()
        beat.join(timeout=5)
        if outcome != Job.Status.SUCCEEDED:
            job.refresh_from_db()
            remove_staging(job)
            _on_job_ended(job)
        row_log.flush()
        handler.removeHandler(row_log)
    return outcome


def _on_job_ended(job: Job) -> None:
    """A job that did not succeed leaves its 'building' artifact marked failed."""
    from models_registry.models import Artifact

    Artifact.objects.filter(producing_job=job, status=Artifact.Status.BUILDING).update(
        status=Artifact.Status.FAILED, note=job.error or f"job {job.status}"
    )
