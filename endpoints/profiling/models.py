"""A Profile: one recording of one replica with vLLM's own profiler, and what its trace says.

The Job row (workers.Job) is the truth for queued/running/cancelled; the profile's own `status`
records how far its work went (recording, analysing) and how it ended (see `state`)."""

from django.conf import settings
from django.db import models
from django.urls import reverse
from django.utils import timezone

from console.models import TeamOwned

__all__ = ["PROFILE_ACTIVE", "PROFILE_ENDED", "Profile", "ProfileStatus"]


class ProfileStatus(models.TextChoices):
    QUEUED = "queued"
    RECORDING = "recording"
    ANALYSING = "analysing"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


PROFILE_ENDED = (ProfileStatus.SUCCEEDED, ProfileStatus.FAILED)
PROFILE_ACTIVE = (ProfileStatus.QUEUED, ProfileStatus.RECORDING, ProfileStatus.ANALYSING)


class Profile(TeamOwned):
    TEAM_PARENTS = ("endpoint",)
    endpoint = models.ForeignKey(
        "endpoints.Endpoint", null=True, blank=True, on_delete=models.SET_NULL, related_name="profiles"
    )
    endpoint_name = models.CharField(max_length=63)  # kept when the endpoint is deleted
    replica_index = models.PositiveIntegerField()
    job = models.ForeignKey("workers.Job", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    label = models.CharField(max_length=200, blank=True)
    duration_s = models.PositiveIntegerField()
    # The console's own load during the recording (the benchmark form's settings), {} for none.
    load = models.JSONField(default=dict, blank=True)
    load_result = models.JSONField(default=dict, blank=True)  # what the load client measured, when it finished

    status = models.CharField(max_length=16, choices=ProfileStatus.choices, default=ProfileStatus.QUEUED, db_index=True)
    error = models.TextField(blank=True)
    config = models.JSONField(default=dict, blank=True)  # what was profiled: artifact, dtype, quantization, TP…
    files = models.JSONField(default=list, blank=True)  # [{"name", "bytes"}] under the profile's directory
    total_bytes = models.BigIntegerField(default=0)
    traced_seconds = models.FloatField(null=True, blank=True)
    breakdown = models.JSONField(default=list, blank=True)  # [{"category", "seconds", "share"}]
    top_ops = models.JSONField(default=list, blank=True)  # [{"name", "category", "self_seconds", "calls", "share"}]
    advice = models.JSONField(default=list, blank=True)  # [{"rule", "figure", "text"}]
    window = models.JSONField(default=dict, blank=True)  # the replica's own gauges, read during the recording
    telemetry = models.JSONField(default=dict, blank=True)  # the stored telemetry of the same window

    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(default=timezone.now, db_index=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self):
        return f"Profile #{self.pk} {self.endpoint_name}#{self.replica_index}"

    def get_absolute_url(self):
        return reverse("profile_detail", args=[self.pk])

    @property
    def state(self) -> str:
        """queued | recording | analysing | succeeded | failed, with the job's outcome applied
        (a job cancelled, failed or reaped from the Jobs page ends its profile too)."""
        if self.status in PROFILE_ENDED:
            return self.status
        job = self.job
        if job is None or job.status in ("failed", "cancelled", "succeeded"):
            return ProfileStatus.FAILED
        return self.status

    @property
    def is_active(self) -> bool:
        return self.state in PROFILE_ACTIVE

    @property
    def display_error(self) -> str:
        if self.error:
            return self.error
        if self.state == ProfileStatus.FAILED and self.job is not None:
            return self.job.error or f"The job ended {self.job.status}."
        return ""

    @property
    def setup(self) -> str:
        return self.label or self.config.get("setup") or f"{self.endpoint_name}#{self.replica_index}"

    @property
    def title(self) -> str:
        """For a comparison, where profiles of several endpoints meet: its number, setup and endpoint."""
        where = "" if self.endpoint_name in self.setup else f" ({self.endpoint_name})"
        return f"#{self.pk} {self.setup}{where}"
