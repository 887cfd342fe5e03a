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
    def log_tail(self) -> str:
        """The last lines of the log, whole lines only (the page shows the end, not the start)."""
        return "\n".join(self.log.splitlines()[-30:])

    @property
    def duration(self):
        if not self.started_at:
            return None
        return (self.finished_at or timezone.now()) - self.started_at


class Node(models.Model):
    """An inference host, registered and kept fresh by its node agent."""

    class Platform(models.TextChoices):
        ASCEND = "ascend", "Ascend NPU"
        CUDA = "cuda", "NVIDIA GPU"
        CPU = "cpu", "CPU"

    name = models.CharField(max_length=100, unique=True)
    hostname = models.CharField(max_length=255, blank=True)
    address = models.CharField(max_length=255, blank=True)  # how the console reaches its endpoints
    platform = models.CharField(max_length=16, choices=Platform.choices, default=Platform.CPU)
    engine_python = models.CharField(max_length=1024, blank=True)
    engine = models.JSONField(default=dict, blank=True)  # vllm, vllm_ascend, torch, torch_npu, cann versions
    compat_warnings = models.JSONField(default=list, blank=True)
    host = models.JSONField(default=dict, blank=True)  # cpu count, memory, latest host stats
    settings = models.JSONField(default=dict, blank=True)  # e.g. HCCL/GLOO interface names for multi-node
    agent_pid = models.IntegerField(null=True, blank=True)
    agent_started_at = models.DateTimeField(null=True, blank=True)
    last_heartbeat = models.DateTimeField(null=True, blank=True)
    telemetry_error = models.TextField(blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["name"]

    def __str__(self):
        return self.name

    def get_absolute_url(self):
        return reverse("node_detail", args=[self.pk])

    @property
    def online(self) -> bool:
        if self.last_heartbeat is None:
            return False
        return (timezone.now() - self.last_heartbeat).total_seconds() <= settings.NODE_OFFLINE_SECONDS


class Device(models.Model):
    """An accelerator (NPU chip, GPU) on a node, as the agent last saw it."""

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="devices")
    index = models.IntegerField()  # the id vLLM sees (ASCEND_RT_VISIBLE_DEVICES / CUDA_VISIBLE_DEVICES)
    kind = models.CharField(max_length=8)  # npu | gpu
    name = models.CharField(max_length=100, blank=True)  # e.g. 910B4
    memory_total_bytes = models.BigIntegerField(null=True, blank=True)
    health = models.CharField(max_length=32, blank=True)
    bus_id = models.CharField(max_length=64, blank=True)
    latest = models.JSONField(default=dict, blank=True)
    updated_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["node_id", "index"]
        constraints = [models.UniqueConstraint(fields=["node", "index"], name="unique_device_per_node")]

    def __str__(self):
        return f"{self.node.name}:{self.kind}{self.index} {self.name}"
from workers.telemetry.models import *  # noqa: E402,F401,F403
