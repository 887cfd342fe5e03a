"""A Tuning: a search of an endpoint's launch settings for the most throughput that keeps an SLO, and its trials.

Each trial is a row (durable: a worker that dies leaves them, and a Retry of the job replays the finished ones into
a fresh study and goes on). The Job row (workers.Job) is the truth for queued/running/cancelled; the tuning's own
`status` records how its work ended."""

from django.conf import settings
from django.db import models
from django.urls import reverse
from django.utils import timezone

from console.models import TeamOwned

__all__ = ["TRIAL_ENDED", "TrialKind", "TrialState", "Tuning", "TuningStatus", "TuningTrial"]


class TuningStatus(models.TextChoices):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


class Tuning(TeamOwned):
    TEAM_PARENTS = ("endpoint", "artifact")

    endpoint = models.ForeignKey(
        "endpoints.Endpoint", null=True, blank=True, on_delete=models.SET_NULL, related_name="tunings"
    )
    endpoint_name = models.CharField(max_length=63)  # kept when the endpoint is deleted ("" for an artifact's)
    # A tuning of an artifact on a node (no endpoint): the launch spec its trials start from, as a launch of the
    # artifact there would be (endpoint_create's defaults filled in, checked when the tuning was asked for).
    artifact = models.ForeignKey(
        "models_registry.Artifact", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    node = models.ForeignKey("workers.Node", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    base_spec = models.JSONField(default=dict, blank=True)  # endpoints.endpoint_spec.EndpointSpec, dumped
    job = models.ForeignKey("workers.Job", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    # The benchmark form's settings as endpoints.bench.workload.clean_workload returned them.
    workload = models.JSONField(default=dict)
    slo = models.JSONField(default=dict)  # endpoints.tuning.search.Slo
    space = models.JSONField(default=dict)  # endpoints.tuning.search.Space
    search = models.CharField(max_length=8, default="tpe")  # "tpe" (Optuna) or "grid" (with early stopping)
    trials_wanted = models.PositiveIntegerField(default=6)
    seed = models.PositiveIntegerField(default=0)
    status = models.CharField(max_length=16, choices=TuningStatus.choices, default=TuningStatus.QUEUED)
    error = models.TextField(blank=True)
    # {"number", "params", "metrics"} of the best trial meeting the SLO; {} while none does.
    best = models.JSONField(default=dict, blank=True)
    confidence = models.JSONField(default=dict, blank=True)  # endpoints.tuning.search.confidence
    applied_at = models.DateTimeField(null=True, blank=True)
    applied_params = models.JSONField(default=dict, blank=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(default=timezone.now, db_index=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self):
        return f"Tuning #{self.pk} {self.subject}"

    def get_absolute_url(self):
        return reverse("tuning_detail", args=[self.pk])

    @property
    def for_artifact(self) -> bool:
        """Tuned from an artifact and a node, not an endpoint: nothing to apply to; the best is a launch spec."""
        return bool(self.base_spec)

    @property
    def subject(self) -> str:
        """What was tuned: the endpoint's name, or the artifact on its node."""
        if not self.for_artifact:
            return self.endpoint_name
        artifact = str(self.artifact) if self.artifact_id else f"artifact #{self.base_spec.get('artifact')}"
        return f"{artifact} on {self.node.name if self.node_id else self.base_spec.get('node')}"

    @property
    def state(self) -> str:
        """The tuning's own end, else its job's: a job cancelled or reaped ends the tuning too."""
        if self.status in (TuningStatus.SUCCEEDED, TuningStatus.FAILED, TuningStatus.CANCELLED):
            return self.status
        if self.job is None:
            return TuningStatus.FAILED
        if self.job.status in (TuningStatus.FAILED, TuningStatus.CANCELLED):
            return self.job.status
        return TuningStatus.RUNNING if self.job.status == "running" else TuningStatus.QUEUED

    @property
    def is_active(self) -> bool:
        return self.state in (TuningStatus.QUEUED, TuningStatus.RUNNING)


class TrialKind(models.TextChoices):
    BASELINE = "baseline"  # the endpoint's own settings
    SEARCH = "search"
    REPEAT = "repeat"  # a second measurement of one of the best two


class TrialState(models.TextChoices):
    RUNNING = "running"
    COMPLETE = "complete"
    FAILED = "failed"


TRIAL_ENDED = (TrialState.COMPLETE, TrialState.FAILED)


class TuningTrial(models.Model):
    tuning = models.ForeignKey(Tuning, on_delete=models.CASCADE, related_name="trials")
    number = models.PositiveIntegerField()  # order within the tuning; a repeat has its own number
    kind = models.CharField(max_length=8, choices=TrialKind.choices, default=TrialKind.SEARCH)
    repeat_of = models.PositiveIntegerField(null=True, blank=True)  # the trial number a repeat measures again
    params = models.JSONField(default=dict, blank=True)  # knob -> value ({} for the baseline)
    state = models.CharField(max_length=8, choices=TrialState.choices, default=TrialState.RUNNING)
    metrics = models.JSONField(default=dict, blank=True)  # endpoints.tuning.search.METRICS, vLLM's names
    meets_slo = models.BooleanField(null=True, blank=True)
    error = models.TextField(blank=True)
    replica_endpoint = models.CharField(max_length=63, blank=True)  # the trial replica's endpoint name
    benchmark = models.ForeignKey(
        "endpoints.BenchmarkRun", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    started_at = models.DateTimeField(default=timezone.now)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["number"]
        constraints = [models.UniqueConstraint(fields=["tuning", "number"], name="unique_tuning_trial_number")]

    def __str__(self):
        return f"Tuning #{self.tuning_id} trial {self.number}"
