"""Job kinds and what runs inside a worker for every job: claim the row, capture logging into it,
keep a heartbeat, report progress, honour cancel, and record the outcome.

Modelled on NetBox's JobRunner: one class per kind, registered by defining it; the row is the
truth, the RQ job only carries the id."""

import logging
import os
import socket
import threading
import time
import traceback

from django.conf import settings
from django.db import DatabaseError, close_old_connections, connection, transaction
from django.utils import timezone

from workers.jobs.context import JobCancelled, JobContext, JobFailed, remove_staging
from workers.jobs.models import Job
from workers.jobs.registry import JobKind, register_runner, runner_class
from workers.jobs.services import audit_job_end, cleanup_after_failure, job_enqueue

log = logging.getLogger("console.job")
LOG_LIMIT = 200_000  # characters of log kept on the row (the tail)

__all__ = ["JobCancelled", "JobContext", "JobFailed", "JobRunner", "run_job"]


class JobRunner(JobKind):
    """One kind of job (its name, queue and timeout: JobKind's). A subclass with a `name` registers itself; the
    app that owns the work imports its jobs module from AppConfig.ready()."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.name:
            register_runner(cls)

    def run(self, job: Job, ctx: JobContext) -> dict:
        """Do the work; return the result (stored on the row). Raise JobFailed for an operator-facing error."""
        raise NotImplementedError

    def resubmit(self, *, job: Job, user, request=None) -> Job:
        """What Retry submits: by default a new job with the same parameters and target."""
        return job_enqueue(
            kind=job.kind,
            params=job.params,
            user=user,
            target=job.target,
            dedupe_key=job.dedupe_key,
            request=request,
            retry_of=job,
        )


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


def _heartbeat(job_id: int, stop: threading.Event) -> None:
    """Beats until the job ends. A database error (a PostgreSQL restart, SQLite's lock timeout) skips one
    beat, not the rest: a thread that died on it left a running job to be reaped as stopped, its staging
    removed under it."""
    try:
        while not stop.wait(settings.JOB_HEARTBEAT_SECONDS):
            try:
                # Whatever the row's status: after a Cancel or a reap it still says this process lives, so the
                # reaper leaves the job's cleanup to it until it has gone (services.reap_jobs).
                Job.objects.filter(pk=job_id).update(heartbeat_at=timezone.now())
            except DatabaseError as exc:
                log.warning("job %s: heartbeat not written (%s); trying again", job_id, exc)
                connection.close()  # the next beat connects afresh
    finally:
        connection.close()


def _finish(job: Job, status: str, **fields) -> bool:
    """Write the outcome, and audit it, unless someone else (cancel, reaper) already ended the job (and audited
    that): the conditional update decides who writes the one entry."""
    now = timezone.now()
    if status != Job.Status.SUCCEEDED:
        fields["cleanup_pending"] = True
    with transaction.atomic():  # the outcome and its audit entry commit together
        updated = Job.objects.filter(pk=job.pk, status=Job.Status.RUNNING).update(
            status=status, finished_at=now, **fields
        )
        if updated:
            audit_job_end(job=job, was=Job.Status.RUNNING, status=status, error=fields.get("error", ""))
    return bool(updated)


def run_job(job_id: int, worker_name: str = "") -> str:
    close_old_connections()
    now = timezone.now()
    # Race-safe claim: only a queued row becomes running, once.
    claimed = Job.objects.filter(pk=job_id, status=Job.Status.QUEUED).update(
        status=Job.Status.RUNNING,
        started_at=now,
        heartbeat_at=now,
        pid=os.getpid(),
        node=settings.NODE_NAME,
        worker_name=worker_name or socket.gethostname(),
        stage="starting",
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
        runner = runner_class(job.kind)
        if runner is None:
            raise JobFailed(f"No job runner is registered for kind {job.kind!r} in this worker.")
        result = runner().run(job, ctx) or {}
        ctx.check_cancelled()
        _finish(job, Job.Status.SUCCEEDED, progress=100, stage="done", result=result)
        outcome = Job.Status.SUCCEEDED
    except JobCancelled:
        ended = Job.objects.filter(pk=job_id).values_list("status", flat=True).first()
        log.warning(
            "Cancelled." if ended == Job.Status.CANCELLED else f"Stopped: the job was ended meanwhile ({ended})."
        )
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
            cleanup_after_failure(job)
        row_log.flush()
        handler.removeHandler(row_log)
    return outcome
