import hashlib
import hmac

from django.conf import settings
from django.core.validators import RegexValidator
from django.db import models
from django.urls import reverse
from django.utils import timezone

from console.models import TeamOwned

ENDPOINT_NAME_PATTERN = r"[a-z0-9][a-z0-9-]{0,62}"  # also an endpoint's directories on its nodes (node_files)
ENDPOINT_NAME = RegexValidator(
    rf"^{ENDPOINT_NAME_PATTERN}$", "Use lower-case letters, digits and '-' (URL-safe, up to 63)."
)


class Endpoint(TeamOwned):
    """The desired state of one served model. Node agents make their replicas match it."""

    TEAM_PARENTS = ("artifact",)

    class Desired(models.TextChoices):
        RUNNING = "running"
        STOPPED = "stopped"

    class State(models.TextChoices):
        PENDING = "pending"
        STARTING = "starting"
        READY = "ready"
        DEGRADED = "degraded"
        STOPPING = "stopping"
        STOPPED = "stopped"
        CRASHED = "crashed"
        RESTARTING = "restarting"
        FAILED = "failed"

    class Distributed(models.TextChoices):
        """How one replica spans nodes: its head node runs the API server, member nodes the rest."""

        NONE = "", "one node"
        RAY = "ray", "Ray cluster (tensor/pipeline parallel across nodes)"
        DP = "dp", "data parallel across nodes (headless ranks)"

    class Routing(models.TextChoices):
        """How the gateway picks one of the endpoint's ready replicas (endpoints/gateway/routing.py)."""

        LEAST_OUTSTANDING = "least-outstanding", "least outstanding requests"
        PREFIX = "prefix", "prefix-aware (requests that start alike go to the same replica)"

    name = models.CharField(max_length=63, unique=True, validators=[ENDPOINT_NAME])
    artifact = models.ForeignKey("models_registry.Artifact", on_delete=models.PROTECT, related_name="endpoints")
    node = models.ForeignKey("workers.Node", on_delete=models.PROTECT, related_name="endpoints")
    devices = models.JSONField(default=list, blank=True)
    replicas = models.PositiveIntegerField(default=1)
    tensor_parallel_size = models.PositiveIntegerField(default=1)
    pipeline_parallel_size = models.PositiveIntegerField(default=1)
    max_num_seqs = models.PositiveIntegerField(null=True, blank=True)
    max_model_len = models.PositiveIntegerField(null=True, blank=True)
    gpu_memory_utilization = models.FloatField(null=True, blank=True)
    dtype = models.CharField(max_length=16, blank=True)
    quantization = models.CharField(max_length=32, blank=True)
    enforce_eager = models.BooleanField(default=False)
    # vLLM's profiler configured at launch (--profiler-config), so a profile can be recorded on demand;
    # a change restarts running replicas one at a time (ReplicaWorkload.maybe_scheduled_restart).
    profiling = models.BooleanField(default=False)
    served_model_name = models.CharField(max_length=100)
    env = models.JSONField(default=dict, blank=True)
    extra_args = models.JSONField(default=dict, blank=True)
    share_devices = models.BooleanField(default=False)
    distributed = models.CharField(max_length=8, choices=Distributed.choices, blank=True)
    data_parallel_size = models.PositiveIntegerField(default=1)  # dp: ranks over all nodes (an equal share each)
    trust_remote_code = models.BooleanField(default=False)
    # vLLM's JSON-valued options by the launch spec's names (endpoints.commands.ENGINE_CONFIG_FLAGS):
    # speculative, compilation, ascend (vllm-ascend's additional config), hf_overrides, kv_transfer.
    engine_configs = models.JSONField(default=dict, blank=True)
    # The speculative config's draft model or EAGLE head: an artifact of the registry, never a path.
    draft_artifact = models.ForeignKey(
        "models_registry.Artifact", null=True, blank=True, on_delete=models.PROTECT, related_name="drafting_endpoints"
    )
    async_scheduling = models.BooleanField(null=True, blank=True)  # null: vLLM's default
    # LoRA (endpoints.lora): on when max_lora_rank is set. `adapters` are the registry's LoRA artifacts of the
    # served model that every replica loads at start (--lora-modules); a run-time load or unload changes them.
    adapters = models.ManyToManyField("models_registry.Artifact", blank=True, related_name="adapter_endpoints")
    max_loras = models.PositiveIntegerField(null=True, blank=True)
    max_lora_rank = models.PositiveIntegerField(null=True, blank=True)
    max_cpu_loras = models.PositiveIntegerField(null=True, blank=True)
    # The gateway may load a registered adapter of the served model that no replica holds when a request names it
    # (endpoints.gateway.asgi: held until every ready replica has it, then routed; recorded and audited as a load).
    adapters_on_demand = models.BooleanField(default=False)
    distributed_executor_backend = models.CharField(max_length=8, blank=True)
    # The recipe the launch started from, as name@version (endpoints.recipes), for people.
    recipe = models.CharField(max_length=100, blank=True)
    capacity_override = models.TextField(blank=True)  # an Admin's reason to launch past the estimate
    restart_every_hours = models.PositiveIntegerField(null=True, blank=True)
    routing = models.CharField(max_length=24, choices=Routing.choices, default=Routing.LEAST_OUTSTANDING)
    restart_daily_at = models.TimeField(null=True, blank=True)  # UTC; replicas restart one at a time
    # Prefill/decode disaggregation (endpoints.roles): {"prefill": {"replicas", "node", "devices"}, "decode": {...}},
    # the replicas of each role (Replica.role) started with that role's --kv-transfer-config; `replicas` is their sum
    # and `node` the prefill role's. Null: one kind of replica, the gateway sends each request to one of them.
    roles = models.JSONField(null=True, blank=True)
    # Autoscaling settings (endpoints.autoscale.parse_settings reads them; null is off) and when the
    # controller last changed `replicas` (its cooldown, and the claim two controllers race on).
    autoscale = models.JSONField(null=True, blank=True)
    scaled_at = models.DateTimeField(null=True, blank=True)
    # The count the autoscaler wants but cannot place yet (no free devices): shown as the reason.
    autoscale_wanted = models.PositiveIntegerField(null=True, blank=True)
    # Advisory mode: the autoscaler and the rollout controller record what they would decide (events with their
    # figures) and change nothing (endpoints/gateway/controller.py).
    advisory = models.BooleanField(default=False)
    # When launch settings last changed on a running endpoint (a tuning applied): replicas started before it
    # restart one at a time (endpoints.replica_state.settings_restart_due).
    settings_changed_at = models.DateTimeField(null=True, blank=True)
    desired_state = models.CharField(max_length=16, choices=Desired.choices, default=Desired.RUNNING)
    state = models.CharField(max_length=16, choices=State.choices, default=State.PENDING)
    state_reason = models.CharField(max_length=500, blank=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]

    def __str__(self):
        return self.name

    def get_absolute_url(self):
        return reverse("endpoint_detail", args=[self.pk])

    @property
    def lora_enabled(self) -> bool:
        return self.max_lora_rank is not None

    @property
    def disaggregated(self) -> bool:
        """Prefill and decode run on replicas of their own (roles), the gateway relaying between them."""
        return bool(self.roles)


class Replica(models.Model):
    """One vLLM process of an endpoint: its own node, devices and port."""

    class Role(models.TextChoices):
        """Its part in a disaggregated endpoint (Endpoint.roles); blank: it serves whole requests."""

        NONE = "", "whole requests"
        PREFILL = "prefill", "prefill"
        DECODE = "decode", "decode"

    endpoint = models.ForeignKey(Endpoint, on_delete=models.CASCADE, related_name="replica_set")
    index = models.PositiveIntegerField()
    role = models.CharField(max_length=8, choices=Role.choices, blank=True, default="")
    node = models.ForeignKey("workers.Node", on_delete=models.PROTECT, related_name="replicas")
    devices = models.JSONField(default=list, blank=True)
    state = models.CharField(max_length=16, choices=Endpoint.State.choices, default=Endpoint.State.PENDING)
    state_reason = models.CharField(max_length=500, blank=True)
    port = models.PositiveIntegerField(null=True, blank=True)
    # The host the port is reserved on: agents on one host claim ports through this row.
    port_host = models.CharField(max_length=255, blank=True)
    # A multi-node replica's rendezvous on its head node (the Ray head's GCS port, or the DP group's RPC
    # port), claimed like `port` (on the same port_host) before any of its members starts.
    cluster_port = models.PositiveIntegerField(null=True, blank=True)
    pid = models.IntegerField(null=True, blank=True)
    pid_create_time = models.FloatField(null=True, blank=True)  # with pid and argv: identifies our process
    # What runs it: "process", or a container runtime ("docker", "podman"), where the container's name
    # and id identify it (pid is then its main process on the host, for telemetry).
    runtime = models.CharField(max_length=16, default="process")
    container_name = models.CharField(max_length=128, blank=True)
    container_id = models.CharField(max_length=128, blank=True)
    argv = models.JSONField(default=list, blank=True)
    env = models.JSONField(default=dict, blank=True)  # what the console set (not the whole environment)
    log_path = models.CharField(max_length=1024, blank=True)
    restarts = models.PositiveIntegerField(default=0)
    crashes_in_a_row = models.PositiveIntegerField(default=0)
    health_failures = models.PositiveIntegerField(default=0)
    last_exit_code = models.IntegerField(null=True, blank=True)
    last_log = models.TextField(blank=True)  # the last lines before a crash
    started_at = models.DateTimeField(null=True, blank=True)
    ready_at = models.DateTimeField(null=True, blank=True)
    last_health_at = models.DateTimeField(null=True, blank=True)
    next_start_at = models.DateTimeField(null=True, blank=True)  # backoff after a crash
    stop_requested_at = models.DateTimeField(null=True, blank=True)
    restart_requested = models.BooleanField(default=False)

    class Meta:
        ordering = ["endpoint_id", "index"]
        constraints = [
            models.UniqueConstraint(fields=["endpoint", "index"], name="unique_replica_index"),
            models.UniqueConstraint(
                fields=["port_host", "port"], condition=models.Q(port__isnull=False), name="unique_port_per_host"
            ),
            models.UniqueConstraint(
                fields=["port_host", "cluster_port"],
                condition=models.Q(cluster_port__isnull=False),
                name="unique_cluster_port_per_host",
            ),
        ]

    def __str__(self):
        return f"{self.endpoint.name}#{self.index}"

    @property
    def cpu_binding(self) -> str:
        """The VLLM_CPU_OMP_THREADS_BIND it was started with: "auto" (vLLM's own, also when unset), "nobind" or
        a CPU list."""
        return (self.env or {}).get("VLLM_CPU_OMP_THREADS_BIND") or "auto"

    @property
    def cpu_threads(self) -> str:
        """How a running replica's engine threads were placed on a CPU node, from what it was started with."""
        if not self.launched:
            return ""
        if self.cpu_binding == "auto":
            return "vLLM's auto binding"
        if self.cpu_binding == "nobind":
            return f"unpinned, {(self.env or {}).get('OMP_NUM_THREADS', 'default')} threads"
        return f"cores {self.cpu_binding}"

    @property
    def launched(self) -> bool:
        """An agent started it and has not seen it end: a PID or a container id is recorded."""
        return bool(self.pid or self.container_id)

    @property
    def wanted(self) -> bool:
        """Its endpoint should be running and counts it: desired running, and within the replica count."""
        return self.endpoint.desired_state == Endpoint.Desired.RUNNING and self.index < self.endpoint.replicas

    @property
    def held_failed(self) -> bool:
        """Given up after crashes, or refused a start: not running, and left so (with its members on other
        nodes) until an operator's Start or Restart."""
        return self.state == Endpoint.State.FAILED and not self.restart_requested and not self.launched

    @property
    def url(self) -> str | None:
        if not self.port:
            return None
        return f"http://{self.node.address or '127.0.0.1'}:{self.port}"

    @property
    def api_key(self) -> str:
        """The key this replica's vLLM demands (given as VLLM_API_KEY so that it shows in no argv; vLLM's
        own check covers /v1, the console's guard every other path but /health, /metrics and the
        tokenizer): derived from SECRET_KEY and the replica's id, so only the console, its agents and its
        gateway hold it, and nothing is stored."""
        digest = hmac.new(settings.SECRET_KEY.encode(), f"replica-api-key:{self.pk}".encode(), hashlib.sha256)
        return "rk_" + digest.hexdigest()

    @property
    def auth_header(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}


class ReplicaMember(models.Model):
    """One node's process in a multi-node replica, run by that node's agent beside the replica's vLLM
    server (which runs on the head node): `ray start --head` (rank 0, on the head node) and
    `ray start --address` (ranks 1..), or a headless data-parallel rank (1..; rank 0 is the server)."""

    class Role(models.TextChoices):
        RAY_HEAD = "ray-head"
        RAY_WORKER = "ray-worker"
        DP_HEADLESS = "dp-headless"

    replica = models.ForeignKey(Replica, on_delete=models.CASCADE, related_name="members")
    rank = models.PositiveIntegerField()  # the node's rank in the replica: 0 is the head node
    node = models.ForeignKey("workers.Node", on_delete=models.PROTECT, related_name="replica_members")
    role = models.CharField(max_length=16, choices=Role.choices)
    devices = models.JSONField(default=list, blank=True)
    state = models.CharField(max_length=16, choices=Endpoint.State.choices, default=Endpoint.State.PENDING)
    state_reason = models.CharField(max_length=500, blank=True)
    pid = models.IntegerField(null=True, blank=True)
    pid_create_time = models.FloatField(null=True, blank=True)
    argv = models.JSONField(default=list, blank=True)
    env = models.JSONField(default=dict, blank=True)
    log_path = models.CharField(max_length=1024, blank=True)
    restarts = models.PositiveIntegerField(default=0)
    crashes_in_a_row = models.PositiveIntegerField(default=0)
    last_exit_code = models.IntegerField(null=True, blank=True)
    last_log = models.TextField(blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    ready_at = models.DateTimeField(null=True, blank=True)
    next_start_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["replica_id", "rank"]
        constraints = [models.UniqueConstraint(fields=["replica", "rank"], name="unique_member_rank")]

    def __str__(self):
        return f"{self.replica}/{self.role}@{self.node.name}"


class EndpointEvent(models.Model):
    endpoint = models.ForeignKey(Endpoint, on_delete=models.CASCADE, related_name="events")
    replica_index = models.IntegerField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now, db_index=True)
    level = models.CharField(max_length=8, default="info")  # info | warning | error
    kind = models.CharField(max_length=32)
    message = models.TextField()

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self):
        return f"{self.kind} ({self.level}): {self.message[:80]}"


from endpoints.bench.models import *  # noqa: E402,F401,F403
from endpoints.gateway.models import *  # noqa: E402,F401,F403
from endpoints.profiling.models import *  # noqa: E402,F401,F403
from endpoints.tuning.models import *  # noqa: E402,F401,F403


class Recipe(models.Model):
    """A launch template an operator saved (from a running endpoint): a partial launch spec under a name, one row
    per version. The shipped recipes are files (endpoints/recipe_files/); endpoints.recipes lists both."""

    name = models.CharField(max_length=63, validators=[ENDPOINT_NAME])
    version = models.PositiveIntegerField(default=1)
    title = models.CharField(max_length=200, blank=True)
    platform = models.CharField(max_length=8)
    hardware = models.CharField(max_length=200, blank=True)
    nodes = models.PositiveIntegerField(default=1)
    spec = models.JSONField(default=dict)
    source = models.CharField(max_length=300, blank=True)  # where it came from, for people
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["name", "-version"]
        constraints = [models.UniqueConstraint(fields=["name", "version"], name="unique_recipe_version")]

    def __str__(self):
        return f"{self.name}@{self.version}"
