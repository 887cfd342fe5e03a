import os
import uuid
from collections.abc import Callable

from django.conf import settings
from django.db import models
from django.urls import reverse
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from workers import engine_images
from workers.engine_info import engine_labels
from workers.host_stats import cpu_list_text


class Node(models.Model):
    """An inference host, registered and kept fresh by its node agent."""

    class Platform(models.TextChoices):
        ASCEND = "ascend", "Ascend NPU"
        CUDA = "cuda", "NVIDIA GPU"
        CPU = "cpu", "CPU"

    class Runtime(models.TextChoices):
        """How the agent runs this node's replicas: as processes of the engine venv, or in vllm-ascend's
        official image under Docker or Podman (Ascend nodes; set on the node's page)."""

        PROCESS = "process", "process (the engine venv)"
        DOCKER = "docker", "Docker (vllm-ascend's image)"
        PODMAN = "podman", "Podman (vllm-ascend's image)"

    name = models.CharField(max_length=100, unique=True)
    hostname = models.CharField(max_length=255, blank=True)
    address = models.CharField(max_length=255, blank=True)  # how the console reaches its endpoints
    platform = models.CharField(max_length=16, choices=Platform.choices, default=Platform.CPU)
    engine_python = models.CharField(max_length=1024, blank=True)
    engine = models.JSONField(default=dict, blank=True)  # vllm, vllm_ascend, torch, torch_npu, cann versions
    # The engine's own vLLM parser: {"vllm", "options", "env", "fingerprint", "probed_at"} or {"error"};
    # {} until the agent has probed it (engine_info.engine_cli). Apart from `engine`: 15 kB that the
    # node API, benchmark snapshots and engine labels don't want.
    engine_cli = models.JSONField(default=dict, blank=True)
    compat_warnings = models.JSONField(default=list, blank=True)
    host = models.JSONField(default=dict, blank=True)  # cpu count, memory, latest host stats
    settings = models.JSONField(default=dict, blank=True)  # e.g. HCCL/GLOO interface names for multi-node
    agent_pid = models.IntegerField(null=True, blank=True)
    agent_started_at = models.DateTimeField(null=True, blank=True)
    # The running agent's lease (workers.agent.loop.NodeAgent.claim): one agent per node. Its instance, and
    # the boot and PID namespace it runs in (workers.agent.loop.host_boot_id); cleared when it exits.
    agent_instance = models.UUIDField(null=True, blank=True)
    agent_boot_id = models.CharField(max_length=64, blank=True)
    last_heartbeat = models.DateTimeField(null=True, blank=True)
    telemetry_error = models.TextField(blank=True)
    doctor = models.JSONField(default=dict, blank=True)  # the agent's last workers.doctor.host_report()
    engine_runtime = models.CharField(max_length=16, choices=Runtime.choices, default=Runtime.PROCESS)
    # Which of the release's images (workers.engine_images.VARIANTS), or "auto": by the node's chips.
    engine_image_variant = models.CharField(max_length=32, default=engine_images.AUTO)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["name"]

    def __str__(self):
        return self.name

    def get_absolute_url(self):
        return reverse("node_detail", args=[self.pk])

    @property
    def doctor_checked_at(self):
        return parse_datetime(self.doctor["checked_at"]) if self.doctor.get("checked_at") else None

    @property
    def engine_labels(self) -> list[str]:
        return engine_labels(self.engine)

    @property
    def interfaces(self) -> dict[str, str]:
        """The interface variables for multi-node collectives its agent recorded from NODE_INTERFACES."""
        return dict((self.settings or {}).get("interfaces") or {})

    @property
    def cpu_layout(self) -> str:
        """Its cores as its agent found them (one per physical core) and, where recorded, by NUMA node."""
        host = self.host or {}
        cores = host.get("cpu_cores")
        if not cores:
            return ""
        text = f"{len(cores)} cores ({cpu_list_text(cores)})"
        numa = host.get("numa_cores") or []
        if len(numa) > 1:
            text += " · by NUMA node: " + " | ".join(cpu_list_text(group) for group in numa)
        return text

    @property
    def containerised(self) -> bool:
        return self.engine_runtime != self.Runtime.PROCESS

    def engine_image(self, chip_name: str | None = None) -> str:
        """The image its replicas run in under Docker/Podman (the first chip's name when none given)."""
        if chip_name is None:
            chip_name = self.devices.values_list("name", flat=True).first()
        return engine_images.ascend_image(self.engine_image_variant, chip_name)

    @property
    def online(self) -> bool:
        if self.last_heartbeat is None:
            return False
        return (timezone.now() - self.last_heartbeat).total_seconds() <= settings.NODE_OFFLINE_SECONDS

    def held_by_another_agent(self, *, instance: uuid.UUID, boot_id: str, pid_alive: Callable[[int], bool]) -> bool:
        """Another agent runs this node: a lease not `instance`'s, with a heartbeat fresh enough for the node
        to be online, unless it was taken on this very boot of this host by a process that is gone (an agent
        restarted after a crash takes over at once, as does a new agent of the same process; elsewhere the lease
        runs out first)."""
        if self.agent_instance == instance or not self.online:
            return False
        # No lease named: released (release() clears the pid too), or never taken, unless a pid beats there:
        # an agent of a release before the lease (migration 0011), which writes its pid and heartbeat only.
        if self.agent_instance is None and self.agent_pid is None:
            return False
        same_boot = bool(boot_id) and self.agent_boot_id == boot_id
        gone = self.agent_pid is None or self.agent_pid == os.getpid() or not pid_alive(self.agent_pid)
        return not (same_boot and gone)


class DeviceQuerySet(models.QuerySet):
    def unhealthy(self):
        """Devices whose last health is anything but OK (Warning, Alarm, Critical, an error code,
        or Missing: gone from npu-smi). A device never sampled (blank health) counts as healthy."""
        return self.exclude(health="").exclude(health__iexact=Device.HEALTH_OK)


class Device(models.Model):
    """An accelerator (NPU chip, GPU) on a node, as the agent last saw it."""

    HEALTH_OK = "OK"
    HEALTH_MISSING = "Missing"  # listed before, absent from the tool's latest complete answer

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="devices")
    index = models.IntegerField()  # the id vLLM sees (ASCEND_RT_VISIBLE_DEVICES / CUDA_VISIBLE_DEVICES)
    kind = models.CharField(max_length=8)  # npu | gpu
    name = models.CharField(max_length=100, blank=True)  # e.g. 910B4
    memory_total_bytes = models.BigIntegerField(null=True, blank=True)
    health = models.CharField(max_length=32, blank=True)
    bus_id = models.CharField(max_length=64, blank=True)
    latest = models.JSONField(default=dict, blank=True)
    updated_at = models.DateTimeField(default=timezone.now)

    objects = DeviceQuerySet.as_manager()

    class Meta:
        ordering = ["node_id", "index"]
        constraints = [models.UniqueConstraint(fields=["node", "index"], name="unique_device_per_node")]

    def __str__(self):
        return f"{self.node.name}:{self.kind}{self.index} {self.name}"

    @property
    def healthy(self) -> bool:
        return not self.health or self.health.upper() == self.HEALTH_OK

    @property
    def fault(self) -> str:
        """Why nothing should run on this device, in words; "" while it is healthy."""
        if self.healthy:
            return ""
        what = f"{(self.kind or 'device').upper()} {self.index}"
        if self.health == self.HEALTH_MISSING:
            return f"{what} is missing from {'npu-smi' if self.kind == 'npu' else 'the device list'}"
        return f"{what} health is {self.health}"


from workers.jobs.models import Job, JobQuerySet  # noqa: E402,F401  (Django finds the job runtime's model here)
from workers.telemetry.models import *  # noqa: E402,F401,F403
