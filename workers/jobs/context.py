"""What a running job is handed: progress, cancel checks, staging directories; and the two ways it ends early."""

import logging
import os
import shutil
from datetime import timedelta
from pathlib import Path

from django.conf import settings
from django.db.models import Q
from django.utils import timezone

from workers.jobs.models import Job

log = logging.getLogger("console.job")


class JobCancelled(Exception):
    pass


class JobFailed(Exception):
    """A failure with a message meant for the operator (no traceback needed)."""


class JobContext:
    """Handed to every runner's run(): progress, staging directories and the job's logger."""

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
        """Stops the job here once its row no longer says running: cancelled, or ended by the reaper (no
        heartbeat for JOB_STALE_SECONDS), which has already removed its staging and failed its outputs, so
        nothing may be committed after it."""
        status = Job.objects.filter(pk=self.job.pk).values_list("status", flat=True).first()
        if status != Job.Status.RUNNING:
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


def free_bytes(path: Path) -> int:
    """Free space on the filesystem that holds `path`, or will hold it once made (its nearest existing parent)."""
    probe = Path(path)
    while not probe.exists():
        probe = probe.parent
    return shutil.disk_usage(probe).free


def remove_staging(job: Job) -> bool:
    """Remove what a job left half-written. Idempotent; True if something was removed. A path missing here
    that belongs to another host's job (a benchmark on its endpoint's node) stays recorded: that host's
    worker removes it (JobWorker.run_maintenance_tasks)."""
    path = job.staging_path
    if not path:
        return False
    removed = False
    staging = Path(path)
    existed = staging.exists()
    if existed:
        shutil.rmtree(staging, ignore_errors=True)
        removed = not staging.exists()
    if not staging.exists() and (existed or not job.node or job.node == settings.NODE_NAME):
        Job.objects.filter(pk=job.pk).update(staging_path="")
        job.staging_path = ""
    return removed


def gone(jobs, *, stale_before):
    """The jobs among `jobs` whose process has stopped beating (it beats whatever the row says: a cancelled job
    may still be writing into its staging)."""
    return jobs.filter(Q(heartbeat_at__isnull=True) | Q(heartbeat_at__lt=stale_before))


def remove_this_hosts_staging() -> int:
    """The staging directories of this host's ended jobs (their worker was killed: a Cancel, a timeout, a
    crash); the reaper runs on the console's host and cannot reach them. Returns how many were removed."""
    stale_before = timezone.now() - timedelta(seconds=settings.JOB_STALE_SECONDS)
    ended = Job.objects.filter(status__in=Job.FINISHED, node=settings.NODE_NAME).exclude(staging_path="")
    return sum(remove_staging(job) for job in gone(ended, stale_before=stale_before))
