"""Writes for jobs: enqueue (after commit), cancel, retry, reap. What differs per kind
(queue, timeout, what a retry submits, what a failure leaves behind) is asked of the kind's runner."""

import hashlib
import logging
import uuid
from datetime import timedelta

from django.conf import settings
from django.contrib.contenttypes.models import ContentType
from django.db import DatabaseError, transaction
from django.utils import timezone
from redis.exceptions import RedisError
from rq import Queue
from rq.command import send_stop_job_command
from rq.exceptions import InvalidJobOperation, NoSuchJobError
from rq.job import Job as RqJob

from console.audit import audit_log
from console.exceptions import Conflict
from workers.jobs import queues
from workers.jobs.context import gone, remove_staging
from workers.jobs.models import Job
from workers.jobs.registry import runner_class

log = logging.getLogger(__name__)


def _enqueue_now(job_id: int) -> None:
    job = Job.objects.get(pk=job_id)
    try:
        # rq.Queue, not django_rq.get_queue: another node's queue is not in this host's settings.
        Queue(job.queue, connection=queues.redis_connection()).enqueue(
            "workers.jobs.entrypoint.run",
            job.pk,
            job_id=job.rq_id,
            job_timeout=job.timeout_s,
            result_ttl=24 * 3600,
            failure_ttl=7 * 24 * 3600,
        )
    except RedisError as exc:
        error = f"Could not queue the job: Redis is unreachable ({exc})."
        with transaction.atomic():
            if Job.objects.filter(pk=job.pk, status=Job.Status.QUEUED).update(
                status=Job.Status.FAILED,
                finished_at=timezone.now(),
                cleanup_pending=True,
                error=error,
            ):
                audit_job_end(job=job, was=Job.Status.QUEUED, status=Job.Status.FAILED, error=error)
        cleanup_after_failure(Job.objects.get(pk=job.pk))


def _target_of(job: Job) -> dict | None:
    """The object a job works on, as the audit log names it (the row may be gone: type and id suffice)."""
    if job.target_type_id is None:
        return None
    return {"type": ContentType.objects.get_for_id(job.target_type_id).model, "id": job.target_id}


def audit_job_end(*, job: Job, was: str, status: str, error: str = "") -> None:
    """A job's outcome in the audit log, as the system. Called by whoever ended the job (its worker, the reaper,
    a failed enqueue) only when its conditional update took the row, so each job has one such entry; a Cancel is
    the user's own entry (job_cancel). Progress and heartbeats are not state changes and are never audited."""
    changes = {"status": [was, status], "kind": job.kind, "target": _target_of(job)}
    if error:
        changes["error"] = error[:1000]
    audit_log(action=f"job.{status}.{job.kind}", obj=job, changes=changes, via="system")


def cleanup_after_failure(job: Job, *, settled: bool = True) -> None:
    """Let the kind clean up after a job that failed, was cancelled or was reaped (its on_failure is
    idempotent: the worker's own end, a Cancel and the reaper may each run it). `settled`: no process of the
    job can write any more, so cleanup_pending is cleared; a Cancel of a running job is not (its process may
    write once more before RQ kills it), and the reaper cleans up again once its heartbeat has stopped."""
    runner = runner_class(job.kind)
    if runner is not None:
        runner().on_failure(job)
    if settled:
        Job.objects.filter(pk=job.pk).update(cleanup_pending=False)


def _fit_dedupe_key(key: str) -> str:
    """Keys name the work (kind, target, canonical options); long ones keep their readable start
    and end in a digest of the whole, to fit the column."""
    if len(key) <= 255:
        return key
    return f"{key[:180]}…{hashlib.sha256(key.encode()).hexdigest()}"


def active_duplicate(dedupe_key: str) -> Job | None:
    if not dedupe_key:
        return None
    return Job.objects.active().filter(dedupe_key=dedupe_key).order_by("created_at").first()


def job_enqueue(
    *,
    kind: str,
    params: dict,
    user=None,
    target=None,
    dedupe_key: str = "",
    queue: str | None = None,
    timeout_s: int | None = None,
    retry_of: Job | None = None,
    request=None,
    team_id: int | None = None,
) -> Job:
    """Create the Job row and queue it once the surrounding transaction commits,
    so a worker never picks up a row it can't see yet. `queue` and `timeout_s` default to the kind's. `team_id`:
    the team whose members see the job (console.teams); by default the target's team, else the retried job's."""
    runner = runner_class(kind)
    if runner is None:
        raise ValueError(f"No job runner is registered for kind {kind!r}.")
    queues.redis_check()
    dedupe_key = _fit_dedupe_key(dedupe_key)
    duplicate = active_duplicate(dedupe_key)
    if duplicate is not None:
        raise Conflict(
            f"The same work is already {duplicate.status} as job #{duplicate.pk}.",
            link=duplicate.get_absolute_url(),
            object_id=duplicate.pk,
        )
    job = Job.objects.create(
        kind=kind,
        queue=queue or runner.queue,
        params=params,
        dedupe_key=dedupe_key,
        created_by=user if user is not None and user.pk else None,
        target=target,
        timeout_s=timeout_s or runner.timeout,
        rq_id=f"job-{uuid.uuid4().hex}",
        retry_of=retry_of,
        team_id=team_id
        if team_id is not None
        else getattr(target, "team_id", None) or (retry_of.team_id if retry_of is not None else None),
    )
    transaction.on_commit(lambda: _enqueue_now(job.pk))
    # Audited whoever queued it: a job the console queues itself (a checksum after a conversion) as the system.
    audit_log(
        actor=user,
        action=f"job.enqueue.{kind}",
        obj=job,
        changes={"params": params},
        request=request,
        via="" if user is not None or request is not None else "system",
    )
    return job


def job_cancel(*, job: Job, user, request=None) -> Job:
    now = timezone.now()
    for _ in range(2):  # conditional on the status read: a queued job that started meanwhile is cancelled running
        if not job.is_active:
            raise Conflict(f"Job #{job.pk} has already ended ({job.status}).", link=job.get_absolute_url())
        was = job.status
        # The outcome's one entry commits with it (as a job that ended by itself has the system's): the Redis
        # call and the cleanup below may fail or outlast the request.
        with transaction.atomic():
            if Job.objects.filter(pk=job.pk, status=was).update(
                status=Job.Status.CANCELLED,
                finished_at=now,
                cleanup_pending=True,
                error=f"Cancelled by {user.username}.",
            ):
                audit_log(
                    actor=user,
                    action="job.cancel",
                    obj=job,
                    request=request,
                    changes={"status": [was, Job.Status.CANCELLED], "kind": job.kind, "target": _target_of(job)},
                )
                break
        job.refresh_from_db()
    else:
        raise Conflict(
            f"Job #{job.pk} changed while it was being cancelled ({job.status}): try again.",
            link=job.get_absolute_url(),
        )
    try:
        conn = queues.redis_connection()
        if was == Job.Status.QUEUED:
            try:
                RqJob.fetch(job.rq_id, connection=conn).cancel()
            except (NoSuchJobError, InvalidJobOperation):
                pass
        else:
            # The job also notices the cancel at its next progress report; this stops
            # it even when it is deep inside a library call.
            try:
                send_stop_job_command(conn, job.rq_id)
            except (NoSuchJobError, InvalidJobOperation):
                pass
    except RedisError as exc:
        log.warning("Cancel of %s: Redis unreachable (%s); the job stops at its next progress report", job, exc)
    job.refresh_from_db()
    cleanup_after_failure(job, settled=was == Job.Status.QUEUED)
    return job


def job_retry(*, job: Job, user, request=None) -> Job:
    if job.is_active:
        raise Conflict(f"Job #{job.pk} is still {job.status}.", link=job.get_absolute_url())
    runner = runner_class(job.kind)
    if runner is None:
        raise Conflict(f"Jobs of kind {job.kind!r} cannot be retried.")
    new = runner().resubmit(job=job, user=user, request=request)
    audit_log(actor=user, action="job.retry", obj=job, changes={"new_job": new.pk}, request=request)
    return new


# RQ's statuses of a job that will not run again (rq 2.12 rq/job.py JobStatus).
RQ_ENDED = frozenset({"finished", "failed", "stopped", "canceled"})


def reap_jobs(*, now=None) -> list[int]:
    """Mark jobs whose worker died as failed, fail queued jobs Redis lost, and remove
    staging directories of ended jobs. Safe to run from several processes."""
    now = now or timezone.now()
    reaped = []
    stale_before = now - timedelta(seconds=settings.JOB_STALE_SECONDS)
    for job in Job.objects.filter(status=Job.Status.RUNNING, heartbeat_at__lt=stale_before):
        message = (
            f"The worker running this job stopped (killed, out of memory or host restart): "
            f"no heartbeat from {job.worker_name or 'it'} on {job.node or 'its node'} since "
            f"{job.heartbeat_at:%Y-%m-%d %H:%M:%S} UTC."
        )
        with transaction.atomic():  # the outcome and its audit entry commit together
            took = Job.objects.filter(pk=job.pk, status=Job.Status.RUNNING, heartbeat_at__lt=stale_before).update(
                status=Job.Status.FAILED, finished_at=now, cleanup_pending=True, error=message
            )
            if took:
                audit_job_end(job=job, was=Job.Status.RUNNING, status=Job.Status.FAILED, error=message)
        if took:
            reaped.append(job.pk)
            job.refresh_from_db()
            # A worker that is only slow writes on: its staging goes, and its cleanup runs again, once it has gone.
            cleanup_after_failure(job, settled=False)
            log.warning("Reaped %s: %s", job, message)
    # Queued rows whose RQ job is gone (Redis restarted without persistence), or ended without ever claiming
    # the row (its work horse died first: RQ moved it to the failed registry, kept there 7 days).
    try:
        conn = queues.redis_connection()
        grace = now - timedelta(seconds=60)
        for job in Job.objects.filter(status=Job.Status.QUEUED, created_at__lt=grace):
            rq_status = conn.hget(f"rq:job:{job.rq_id}", "status")
            rq_status = rq_status.decode(errors="replace") if isinstance(rq_status, bytes) else rq_status
            if rq_status is None:
                error = "The job was lost from the queue (Redis restarted or was flushed). Retry it."
            elif rq_status in RQ_ENDED:
                error = (
                    f"The worker took the job but it never started (RQ: {rq_status}; its process died first). Retry it."
                )
            else:
                continue
            with transaction.atomic():
                took = Job.objects.filter(pk=job.pk, status=Job.Status.QUEUED).update(
                    status=Job.Status.FAILED,
                    finished_at=now,
                    cleanup_pending=True,
                    error=error,
                )
                if took:
                    audit_job_end(job=job, was=Job.Status.QUEUED, status=Job.Status.FAILED, error=error)
            if took:
                reaped.append(job.pk)
                cleanup_after_failure(Job.objects.get(pk=job.pk))
    except RedisError as exc:
        log.warning("Reaper: Redis unreachable (%s); queued jobs not checked", exc)
    for job in gone(Job.objects.filter(status__in=Job.FINISHED).exclude(staging_path=""), stale_before=stale_before):
        remove_staging(job)
    # A job failed or cancelled whose process died before its kind's cleanup ran (a 'building' artifact, a
    # profile left recording), or ran on after a Cancel: run it now, once the process's heartbeat (written
    # whatever the row says) has stopped.
    for job in gone(
        Job.objects.filter(cleanup_pending=True, status__in=Job.FINISHED, finished_at__lt=stale_before),
        stale_before=stale_before,
    ):
        try:
            cleanup_after_failure(job)
            log.warning("Cleaned up after %s (%s): its process ended before it did", job, job.status)
        except DatabaseError:
            raise
        except Exception:
            log.exception("Cleanup after %s failed; the reaper tries again at its next pass", job)
    return reaped
