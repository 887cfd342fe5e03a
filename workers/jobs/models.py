"""The durable record of background work. App label `workers`: workers.models imports it."""

from django.conf import settings
from django.contrib.contenttypes.fields import GenericForeignKey
from django.contrib.contenttypes.models import ContentType
from django.db import models
from django.urls import reverse
from django.utils import timezone


class JobQuerySet(models.QuerySet):
    def active(self):
        return self.filter(status__in=Job.ACTIVE)


class Job(models.Model):
    """The durable record of one background task. Redis results expire; this row is the truth."""

    class Status(models.TextChoices):
        QUEUED = "queued"
        RUNNING = "running"
        SUCCEEDED = "succeeded"
        FAILED = "failed"
        CANCELLED = "cancelled"

    ACTIVE = (Status.QUEUED, Status.RUNNING)
    FINISHED = (Status.SUCCEEDED, Status.FAILED, Status.CANCELLED)

    kind = models.CharField(max_length=32, db_index=True)
    queue = models.CharField(max_length=64)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.QUEUED, db_index=True)
    stage = models.CharField(max_length=200, blank=True)
    progress = models.FloatField(default=0)
    params = models.JSONField(default=dict, blank=True)
    # Equal keys mean the same work: a second one is refused while the first is active.
    dedupe_key = models.CharField(max_length=255, blank=True, db_index=True)
    log = models.TextField(blank=True)
    error = models.TextField(blank=True)  # for everyone
    traceback = models.TextField(blank=True)  # for Admins
    result = models.JSONField(default=dict, blank=True)
    timeout_s = models.PositiveIntegerField(default=3600)

    # What the job works on, whatever app it belongs to (the runtime knows no domain). What it made
    # is named in `result` (e.g. {"artifact_id": 7}); the kind's runner turns that into a link.
    target_type = models.ForeignKey(ContentType, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    target_id = models.PositiveBigIntegerField(null=True, blank=True)
    target = GenericForeignKey("target_type", "target_id")
    # The team of what the job works on (console.teams): its members (and the console Admin) see the job; a job
    # about no team's object (none) is everyone's, as before teams.
    team = models.ForeignKey("console.Team", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    retry_of = models.ForeignKey("self", null=True, blank=True, on_delete=models.SET_NULL, related_name="retries")

    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(default=timezone.now, db_index=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    heartbeat_at = models.DateTimeField(null=True, blank=True)

    rq_id = models.CharField(max_length=64, unique=True)
    node = models.CharField(max_length=100, blank=True)
    worker_name = models.CharField(max_length=200, blank=True)
    pid = models.IntegerField(null=True, blank=True)
    # The temporary directory the job writes into; removed on failure or cancel.
    staging_path = models.CharField(max_length=1024, blank=True)
    # Set in the same UPDATE that fails or cancels the job, cleared once its kind's on_failure has run: a
    # process that dies between the two leaves it set, and the reaper runs the cleanup (services.reap_jobs).
    cleanup_pending = models.BooleanField(default=False)

    objects = JobQuerySet.as_manager()

    class Meta:
        app_label = "workers"
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["target_type", "target_id"], name="job_target")]

    def __str__(self):
        return f"Job #{self.pk} {self.kind}"

    def get_absolute_url(self):
        return reverse("job_detail", args=[self.pk])

    @property
    def is_active(self):
        return self.status in self.ACTIVE

    @property
    def log_tail(self) -> str:
        """The last lines of the log, whole lines only (the page shows the end, not the start)."""
        return "\n".join(self.log.splitlines()[-30:])

    @property
    def duration(self):
        if not self.started_at:
            return None
        return (self.finished_at or timezone.now()) - self.started_at
