"""Evaluations: lm-evaluation-harness runs against a served model (an endpoint, or an artifact launched for the
purpose), with their durable results; and the task files Operators upload.

The Job row (workers.Job) is the truth for queued/running/cancelled; the evaluation's own `status` records how
its work ended (see `state`), as a Profile's does."""

from django.conf import settings
from django.db import models
from django.urls import reverse
from django.utils import timezone

from console.models import TeamOwned
from endpoints.gateway.rollout import PROMOTE, STEP

__all__ = ["SERVED_BY_ENGINE", "Evaluation", "EvaluationStatus", "GateRun", "RolloutGate", "UploadedTask"]

# How an evaluation's figures were measured, as the pages and the API say it (the quantize job's perplexity is
# "simulated": models_registry/quantize).
SERVED_BY_ENGINE = "served by an engine"


class EvaluationStatus(models.TextChoices):
    QUEUED = "queued"
    LAUNCHING = "launching"  # an artifact's evaluation: its endpoint is starting
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


ENDED = (EvaluationStatus.SUCCEEDED, EvaluationStatus.FAILED)


class Evaluation(TeamOwned):
    TEAM_PARENTS = ("endpoint", "artifact")  # the team of what it scores

    class Purpose(models.TextChoices):
        MANUAL = "manual"
        QUANTIZE_GATE = "quantize-gate"
        ROLLOUT_GATE = "rollout-gate"

    endpoint = models.ForeignKey(
        "endpoints.Endpoint", null=True, blank=True, on_delete=models.SET_NULL, related_name="evaluations"
    )
    endpoint_name = models.CharField(max_length=63, blank=True)  # kept when the endpoint is deleted
    # The artifact scored: the endpoint's, or the one launched for the purpose (then `launched` is True and the
    # endpoint is removed when the evaluation ends).
    artifact = models.ForeignKey(
        "models_registry.Artifact", null=True, blank=True, on_delete=models.SET_NULL, related_name="evaluations"
    )
    artifact_label = models.CharField(max_length=300, blank=True)
    launched = models.BooleanField(default=False)
    job = models.ForeignKey("workers.Job", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    purpose = models.CharField(max_length=16, choices=Purpose.choices, default=Purpose.MANUAL)
    label = models.CharField(max_length=200, blank=True)

    tasks = models.JSONField(default=list)  # task names, as lm-eval knows them
    limit = models.PositiveIntegerField(null=True, blank=True)  # documents per task (None: all)
    seed = models.PositiveIntegerField(default=1234)
    api = models.CharField(max_length=16, default="completions")  # completions | chat (lm-eval's local-* model)

    status = models.CharField(
        max_length=16, choices=EvaluationStatus.choices, default=EvaluationStatus.QUEUED, db_index=True
    )
    error = models.TextField(blank=True)
    # [{"task", "metric", "value", "stderr", "n"}]: every metric lm-eval reported, with its standard error.
    results = models.JSONField(default=list, blank=True)
    versions = models.JSONField(default=dict, blank=True)  # lm_eval, each task's version, the console's
    engine = models.JSONField(default=dict, blank=True)  # the node's engine versions (vllm, torch, …)
    spec = models.JSONField(default=dict, blank=True)  # what served it: artifact, dtype, quantization, argv…
    samples_path = models.CharField(max_length=1024, blank=True)
    samples_bytes = models.BigIntegerField(default=0)
    gateway_key_prefix = models.CharField(max_length=16, blank=True)  # its own key, revoked when it ends

    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(default=timezone.now, db_index=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self):
        return f"Evaluation #{self.pk} {self.title}"

    def get_absolute_url(self):
        return reverse("evaluation_detail", args=[self.pk])

    @property
    def title(self) -> str:
        return self.label or self.artifact_label or self.endpoint_name or "?"

    @property
    def measured(self) -> str:
        return SERVED_BY_ENGINE

    @property
    def state(self) -> str:
        """queued | launching | running | succeeded | failed, the job's outcome applied (a job cancelled or reaped
        from the Jobs page ends its evaluation too)."""
        if self.status in ENDED:
            return self.status
        job = self.job
        if job is None or job.status in ("failed", "cancelled", "succeeded"):
            return EvaluationStatus.FAILED
        return self.status

    @property
    def display_error(self) -> str:
        if self.error:
            return self.error
        if self.state == EvaluationStatus.FAILED and self.job is not None:
            return self.job.error or f"The job ended {self.job.status}."
        return ""

    def figure(self, task: str, metric: str) -> dict | None:
        return next((r for r in self.results if r["task"] == task and r["metric"] == metric), None)


class UploadedTask(models.Model):
    """A task an Operator uploaded: JSONL documents plus lm-eval's template fields. The console writes the task
    YAML (evaluations/tasks.py) when a run uses it; the documents live under DATA_DIR/evaluations/tasks/."""

    class OutputType(models.TextChoices):
        MULTIPLE_CHOICE = "multiple_choice"
        GENERATE_UNTIL = "generate_until"

    name = models.CharField(max_length=64, unique=True)
    description = models.CharField(max_length=300, blank=True)
    output_type = models.CharField(max_length=20, choices=OutputType.choices)
    doc_to_text = models.TextField()
    doc_to_target = models.TextField()
    doc_to_choice = models.TextField(blank=True)  # multiple choice only
    until = models.JSONField(default=list, blank=True)  # generation only: stop strings
    path = models.CharField(max_length=1024)
    documents = models.PositiveIntegerField()
    size_bytes = models.BigIntegerField()
    sha256 = models.CharField(max_length=64)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["name"]

    def __str__(self):
        return self.name


class RolloutGate(models.Model):
    """A canary pair's accuracy gate: before the staged side is promoted (or, with `above_share`, before its share
    goes above that step of the plan), it and the live side are evaluated on the same tasks with the same seed; a
    drop beyond `max_drop_points` rolls back (evaluations/gates.py)."""

    gateway = models.OneToOneField("endpoints.GatewayEndpoint", on_delete=models.CASCADE, related_name="eval_gate")
    tasks = models.JSONField(default=list)
    limit = models.PositiveIntegerField(null=True, blank=True)
    max_drop_points = models.FloatField(null=True, blank=True)  # None: EVALUATION_GATE_POINTS
    # A step may require the evaluation: the staged share does not go above this percent (e.g. the plan's first
    # step) until the evaluation passed; None: only the promotion (the step to 100 %) waits for it.
    above_share = models.PositiveSmallIntegerField(null=True, blank=True)

    def __str__(self):
        return f"accuracy gate of {self.gateway}"

    def applies_to(self, *, action: str, share: int) -> bool:
        """Whether a rollout decision (a step to `share`, or the promotion) must wait for the evaluation."""
        if action == PROMOTE:
            return True
        return action == STEP and self.above_share is not None and share > self.above_share

    @property
    def threshold(self) -> float:
        return settings.EVALUATION_GATE_POINTS if self.max_drop_points is None else self.max_drop_points


class GateRun(models.Model):
    """One accuracy gate's pair of evaluations: the baseline (the source artifact; the live side) and the candidate
    (the quantized artifact; the staged side), and the verdict once both have ended."""

    class Kind(models.TextChoices):
        QUANTIZE = "quantize"
        ROLLOUT = "rollout"

    class Verdict(models.TextChoices):
        PENDING = "pending"
        PASSED = "passed"
        FAILED = "failed"
        ERROR = "error"  # an evaluation failed: no verdict on accuracy

    kind = models.CharField(max_length=16, choices=Kind.choices)
    baseline = models.ForeignKey(Evaluation, on_delete=models.CASCADE, related_name="+")
    candidate = models.ForeignKey(Evaluation, on_delete=models.CASCADE, related_name="+")
    artifact = models.ForeignKey(
        "models_registry.Artifact", null=True, blank=True, on_delete=models.CASCADE, related_name="+"
    )
    gateway = models.ForeignKey(
        "endpoints.GatewayEndpoint", null=True, blank=True, on_delete=models.CASCADE, related_name="+"
    )
    staged = models.ForeignKey("endpoints.Endpoint", null=True, blank=True, on_delete=models.CASCADE, related_name="+")
    max_drop_points = models.FloatField()
    verdict = models.CharField(max_length=16, choices=Verdict.choices, default=Verdict.PENDING, db_index=True)
    reason = models.TextField(blank=True)
    figures = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    settled_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self):
        return f"{self.kind} gate #{self.pk}"
