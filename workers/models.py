from django.conf import settings
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

    target_model = models.ForeignKey("models_registry.Model", null=True, blank=True, on_delete=models.SET_NULL, related_name="jobs")
    target_artifact = models.ForeignKey("models_registry.Artifact", null=True, blank=True, on_delete=models.SET_NULL, related_name="jobs")
    result_artifact = models.ForeignKey("models_registry.Artifact", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    retry_of = models.ForeignKey("self", null=True, blank=True, on_delete=models.SET_NULL, related_name="retries")

    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
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

    objects = JobQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self):
        return f"Job #{self.pk} {self.kind}"

    def get_absolute_url(self):
        return reverse("job_detail", args=[self.pk])

    @property
    def is_active(self):
        return self.status in self.ACTIVE

    @property
    def duration(self):
        if not self.started_at:
            return None
        return (self.finished_at or timezone.now()) - self.started_at
