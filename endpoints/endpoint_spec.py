"""The launch spec: everything an endpoint is launched with, as one typed object. The API takes it as its body,
the launch form builds it from the page's text, a recipe is a stored partial one (endpoints.recipes), and the
service (endpoints.services.endpoint_create) checks it against the artifact, the nodes and their vLLM, then stores
it on the Endpoint, from which endpoints.launch builds each process's LaunchSpec.

Blank numbers stay None: the service fills the defaults, which depend on the model and node."""

import datetime
from typing import Any

from django.core.exceptions import ValidationError
from pydantic import BaseModel, ConfigDict, StrictBool, field_validator

TIME_OF_DAY_MESSAGE = "A time of day as HH:MM (UTC)."

#: The spec's JSON-valued engine configs (each a field below; endpoints.commands.ENGINE_CONFIG_FLAGS names
#: the vLLM option each renders).
CONFIG_FIELDS = ("speculative", "compilation", "ascend", "hf_overrides", "kv_transfer")


def time_of_day(value: Any) -> datetime.time | None:
    """'03:30' as a time; blank gives None. A bad one is Django's ValidationError naming the field, which pydantic
    lets through, so the API answers 400 naming it, as for every other field the service refuses."""
    if value in (None, ""):
        return None
    if isinstance(value, datetime.time):
        return value
    try:
        return datetime.time.fromisoformat(str(value))
    except ValueError:
        raise ValidationError({"restart_daily_at": TIME_OF_DAY_MESSAGE}) from None


class RoleSpec(BaseModel):
    """One role of a disaggregated endpoint: how many replicas, on which node, on which of its devices (TP x PP
    each, in order; none on a CPU node)."""

    model_config = ConfigDict(extra="forbid")

    replicas: int | None = None
    node: str | int | None = None
    devices: list[int] = []


class Roles(BaseModel):
    """Prefill/decode disaggregation (endpoints.roles): both roles, each with its replicas. The connector is the
    spec's kv_transfer (its kv_connector and settings; blank: the platform's, endpoints.commands.pd)."""

    model_config = ConfigDict(extra="forbid")

    prefill: RoleSpec
    decode: RoleSpec


class EndpointSpec(BaseModel):
    """One launch. Field names are the API's; a misspelt one is refused, not dropped."""

    model_config = ConfigDict(extra="forbid")

    name: str = ""
    # A recipe (endpoints.recipes: "name" or "name@version") fills every field not given beside it.
    recipe: str = ""
    artifact: int | None = None
    # The team the endpoint goes to (one where the caller is an Operator); none: the artifact's team.
    team: int | None = None
    node: str | int | None = None
    devices: list[int] = []
    replicas: int | None = None
    tensor_parallel_size: int | None = None
    pipeline_parallel_size: int | None = None
    # One node: data-parallel ranks of TP x PP each on its devices; with distributed "dp": ranks over all nodes.
    data_parallel_size: int | None = None
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    gpu_memory_utilization: float | None = None
    dtype: str = ""
    quantization: str = ""
    enforce_eager: bool = False
    trust_remote_code: bool = False
    profiling: StrictBool = False  # vLLM's profiler configured, so profiles can be recorded (some overhead)
    served_model_name: str = ""
    env: dict[str, Any] = {}
    extra_args: dict[str, Any] = {}
    # vLLM's SpeculativeConfig; its draft model or EAGLE head as "draft_artifact": <artifact id>, never "model".
    speculative: dict[str, Any] | None = None
    compilation: dict[str, Any] | None = None  # vLLM's CompilationConfig
    ascend: dict[str, Any] | None = None  # vllm-ascend's --additional-config (vllm_ascend/ascend_config.py)
    hf_overrides: dict[str, Any] | None = None  # laid over the model's config.json (e.g. YaRN rope scaling)
    kv_transfer: dict[str, Any] | None = None  # vLLM's KVTransferConfig; with roles, the connector both share
    # Prefill/decode disaggregation: replicas per role (then `node`, `devices` and `replicas` are the roles').
    roles: Roles | None = None
    async_scheduling: bool | None = None  # None: vLLM's default
    distributed_executor_backend: str = ""  # "mp", "uni" or "ray" ("" : vLLM's choice)
    # LoRA: adapter artifacts (registry ids) of the served model, loaded at start and servable by their names;
    # LoRA is on with any adapter or a max_lora_rank (then adapters may be loaded at run time). Blank limits get
    # defaults from the adapters (endpoints.lora).
    adapters: list[int] = []
    max_loras: int | None = None
    max_lora_rank: int | None = None
    max_cpu_loras: int | None = None
    # The gateway loads a registered adapter of the model that no replica holds when a request names it.
    adapters_on_demand: bool = False
    share_devices: bool = False
    capacity_override: str = ""
    restart_every_hours: int | None = None
    restart_daily_at: datetime.time | None = None  # HH:MM, UTC
    distributed: str = ""  # "" (one node), "ray" or "dp": one replica on `node` and `worker_nodes`
    worker_nodes: list[str | int] = []
    # Blue-green: the endpoint (by name) this launch is the standby of. It may repeat that endpoint's served model
    # name (no other endpoint's) and is staged beside it at once (endpoints.gateway.services.endpoint_launch).
    stage_beside: str = ""
    routing: str = ""  # the gateway's policy: "least-outstanding" (default) or "prefix"
    # {"min_replicas", "max_replicas", "target_waiting", ...} (endpoints/autoscale.py); null is off
    autoscale: dict[str, Any] | None = None

    @field_validator("restart_daily_at", mode="before")
    @classmethod
    def _time_of_day(cls, value):
        return time_of_day(value)

    @field_validator(
        "name", "served_model_name", "capacity_override", "recipe", "distributed_executor_backend", "stage_beside"
    )
    @classmethod
    def _trimmed(cls, value: str) -> str:
        return value.strip()

    def engine_configs(self) -> dict[str, dict]:
        """The configs given, by name (the speculative one still with its draft_artifact)."""
        return {name: getattr(self, name) for name in CONFIG_FIELDS if getattr(self, name) is not None}

    def given(self) -> dict[str, Any]:
        """The fields set explicitly (by the API body, the form, or the recipe merged under them)."""
        return self.model_dump(exclude_unset=True)
