"""Benchmark runs against the console's own endpoints, measured with vLLM's benchmark client.

A BenchmarkRun is one `vllm bench serve` invocation; a BenchmarkSweep groups the runs of a
concurrency sweep (1, 2, 4, … N). The Job row (workers.Job) is the truth for queued/running/
cancelled; a run's own `status` records how its part ended (see `state`)."""

from django.conf import settings
from django.db import models
from django.urls import reverse
from django.utils import timezone

from console.models import TeamOwned

__all__ = ["BENCH_ENDED", "BenchStatus", "BenchmarkRun", "BenchmarkSweep"]


class BenchStatus(models.TextChoices):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


BENCH_ENDED = (BenchStatus.SUCCEEDED, BenchStatus.FAILED, BenchStatus.CANCELLED)


class BenchmarkSweep(TeamOwned):
    """A concurrency sweep: one job runs one BenchmarkRun per concurrency level, in order."""

    TEAM_PARENTS = ("endpoint",)

    endpoint = models.ForeignKey(
        "endpoints.Endpoint", null=True, blank=True, on_delete=models.SET_NULL, related_name="benchmark_sweeps"
    )
    endpoint_name = models.CharField(max_length=63)  # kept when the endpoint is deleted
    job = models.ForeignKey("workers.Job", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    label = models.CharField(max_length=200, blank=True)
    concurrencies = models.JSONField(default=list)
    params = models.JSONField(default=dict, blank=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(default=timezone.now, db_index=True)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self):
        return f"Sweep #{self.pk} {self.endpoint_name}"

    def get_absolute_url(self):
        return reverse("bench_sweep_detail", args=[self.pk])

    @property
    def state(self) -> str:
        states = [r.state for r in self.runs.all()]
        if not states:
            return _job_state(self.job, BenchStatus.QUEUED)
        for s in (BenchStatus.RUNNING, BenchStatus.QUEUED):
            if s in states:
                return s
        if BenchStatus.FAILED in states:
            return BenchStatus.FAILED
        if BenchStatus.CANCELLED in states:
            return BenchStatus.CANCELLED
        return BenchStatus.SUCCEEDED


def _job_state(job, own: str) -> str:
    if own in BENCH_ENDED:
        return own
    if job is None:
        return BenchStatus.FAILED  # the job row was removed: it can never run
    if job.status in (BenchStatus.FAILED, BenchStatus.CANCELLED):
        return job.status
    if job.status == BenchStatus.SUCCEEDED:
        return BenchStatus.FAILED  # the job ended without finishing this run
    if job.status == BenchStatus.QUEUED:
        return BenchStatus.QUEUED
    return own  # the job runs: this run is queued behind another or running


class BenchmarkRunManager(models.Manager):
    """Leaves the per-request detail and telemetry unloaded until used (lists, the endpoint
    page and related managers never need them; the run page loads them on access)."""

    def get_queryset(self):
        return super().get_queryset().defer("detail", "telemetry")


class BenchmarkRun(TeamOwned):
    TEAM_PARENTS = ("sweep", "endpoint")
    endpoint = models.ForeignKey(
        "endpoints.Endpoint", null=True, blank=True, on_delete=models.SET_NULL, related_name="benchmarks"
    )
    endpoint_name = models.CharField(max_length=63)
    job = models.ForeignKey("workers.Job", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    sweep = models.ForeignKey(BenchmarkSweep, null=True, blank=True, on_delete=models.CASCADE, related_name="runs")
    sweep_index = models.PositiveIntegerField(default=0)
    label = models.CharField(max_length=200, blank=True)  # the "set-up" column of the compare table

    # Workload, as validated (also in `params`, which is what a retry reuses).
    dataset = models.CharField(max_length=16, default="random")  # random | file
    prompt_file_name = models.CharField(max_length=255, blank=True)
    num_prompts = models.PositiveIntegerField()
    input_len = models.PositiveIntegerField(null=True, blank=True)
    output_len = models.PositiveIntegerField(null=True, blank=True)
    max_concurrency = models.PositiveIntegerField(null=True, blank=True)
    request_rate = models.FloatField(null=True, blank=True)  # req/s (Poisson); None = all at once
    num_warmups = models.PositiveIntegerField(default=0)
    timeout_s = models.PositiveIntegerField(default=1800)
    params = models.JSONField(default=dict, blank=True)

    status = models.CharField(max_length=16, choices=BenchStatus.choices, default=BenchStatus.QUEUED, db_index=True)
    error = models.TextField(blank=True)
    replica_index = models.IntegerField(null=True, blank=True)
    target_url = models.CharField(max_length=300, blank=True)  # the replica it measured (set by the job)
    command = models.JSONField(default=list, blank=True)  # the client's argv, for running it by hand
    # vLLM's saved result without the per-request arrays, under vLLM's own field names.
    result = models.JSONField(default=dict, blank=True)
    # Per-request values and series derived from them (for the charts).
    detail = models.JSONField(default=dict, blank=True)
    config = models.JSONField(default=dict, blank=True)  # what was measured: artifact, devices, TP, versions…
    telemetry = models.JSONField(default=dict, blank=True)  # device readings at start, during and at the end
    result_path = models.CharField(max_length=1024, blank=True)  # vLLM's saved JSON, as written

    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(default=timezone.now, db_index=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    objects = BenchmarkRunManager()

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self):
        return f"Benchmark #{self.pk} {self.endpoint_name}"

    def get_absolute_url(self):
        return reverse("bench_detail", args=[self.pk])

    @property
    def state(self) -> str:
        """queued | running | succeeded | failed | cancelled, with the job's outcome applied
        (a job cancelled or reaped from the Jobs page ends its runs here too)."""
        return _job_state(self.job, self.status)

    @property
    def is_active(self) -> bool:
        return self.state in (BenchStatus.QUEUED, BenchStatus.RUNNING)

    @property
    def display_error(self) -> str:
        if self.error:
            return self.error
        if self.state in (BenchStatus.FAILED, BenchStatus.CANCELLED) and self.job is not None:
            return self.job.error
        return ""

    @property
    def setup(self) -> str:
        return self.label or self.config.get("setup") or self.endpoint_name
