"""A launch's commands without launching: the launch spec goes through the same service (endpoints.services
.endpoint_create: every check, the recipe, the defaults) and the same builders the agent runs at a start
(endpoints.launch: replica_process, member_command), inside a transaction that is then rolled back, so nothing is
stored, audited or nudged. What it shows is what a node's agent would start now; only the ports differ where another
replica takes them first (the agent claims them at the start)."""

from django.db import transaction

from endpoints.commands import CommandSpecError, build_command, format_for_shell, guarded_argv, spec_warnings
from endpoints.endpoint_spec import EndpointSpec
from endpoints.launch import (
    check_model_files,
    check_node_parser,
    launch_spec,
    member_command,
    replica_process,
)
from endpoints.models import Endpoint, Replica, ReplicaMember
from endpoints.ports import claim_port
from endpoints.services import capacity_check, endpoint_create

SECRET_MARK = "***"


class _RolledBack(Exception):
    """Raised inside the preview's transaction to undo the endpoint it made."""


def masked(env: dict[str, str]) -> dict[str, str]:
    """Variables whose names look secret (KEY, TOKEN, ...) with their values masked, as the shell line shows them."""
    shown = format_for_shell([], env)  # one rule for what counts as secret
    return {key: (SECRET_MARK if f"{key}={SECRET_MARK}" in shown.split() else value) for key, value in env.items()}


def _check(name: str, run) -> dict:
    try:
        note = run()
    except CommandSpecError as exc:
        return {"name": name, "ok": False, "level": "error", "message": str(exc)}
    return {"name": name, "ok": True, "level": "ok", "message": note or "ok"}


def _parser_note(node) -> str:
    cli = node.engine_cli or {}
    if not cli.get("options"):
        return f"node {node.name} has not reported its vLLM's parser yet: the console's allow-lists alone were checked"
    configs = "and config classes " if cli.get("configs") else ""
    return f"every flag and VLLM_* variable is known to vLLM {cli.get('vllm')} {configs}on node {node.name}"


def _replica_entry(endpoint: Endpoint, replica: Replica) -> dict:
    node = replica.node
    port = claim_port(node, replica)
    launch = launch_spec(endpoint=endpoint, replica=replica, node=node, port=port)
    entry = {
        "node": node.name,
        "role": replica.role or "server",  # a disaggregated endpoint's: prefill / decode
        "replica": replica.index,
        "argv": [],
        "env": {},
        "container_argv": None,
        "command": "",
    }
    checks = [_check("model files", lambda: check_model_files(endpoint=endpoint, node=node))]
    try:
        argv, env = build_command(launch)
        argv = guarded_argv(argv)
        # As the agent records it (endpoints.launch.as_applied): the console's variables as the child gets them.
        process, applied = replica_process(replica=replica, node=node, port=port)
    except CommandSpecError as exc:
        if not checks[0]["ok"]:  # the model files' refusal, said once
            return {**entry, "checks": checks}
        return {**entry, "checks": [*checks, {"name": "command", "ok": False, "level": "error", "message": str(exc)}]}
    checks.append(
        _check(
            "engine parser",
            lambda: check_node_parser(node=node, argv=argv, env_keys=endpoint.env) or _parser_note(node),
        )
    )
    estimate = capacity_check(
        artifact=endpoint.artifact,
        node=node,
        devices=list(replica.devices),
        tp=endpoint.tensor_parallel_size * endpoint.pipeline_parallel_size * launch.data_parallel_size,
        max_model_len=endpoint.max_model_len,
        util=endpoint.gpu_memory_utilization or 0.9,
    )
    if estimate is not None:
        checks.append(
            {
                "name": "capacity",
                "ok": bool(estimate["fits"]),
                "level": "ok" if estimate["fits"] else "error",
                "message": estimate["summary"],
            }
        )
    checks += [{"name": "advice", "ok": True, "level": "warning", "message": w} for w in spec_warnings(launch)]
    container_argv = process.argv if node.containerised else None
    env = env if node.containerised else applied  # a container's travel as -e flags in its argv
    return {
        **entry,
        "argv": argv,
        "env": masked(env),
        "container_argv": container_argv,
        "command": format_for_shell(container_argv or argv, {} if container_argv else env),
        "checks": checks,
    }


def _member_entry(endpoint: Endpoint, member: ReplicaMember) -> dict:
    node = member.node
    try:
        argv, env = member_command(member)
    except CommandSpecError as exc:
        return {
            "node": node.name,
            "role": member.role,
            "replica": member.replica.index,
            "argv": [],
            "env": {},
            "container_argv": None,
            "command": "",
            "checks": [{"name": "command", "ok": False, "level": "error", "message": str(exc)}],
        }
    checks = [
        _check("model files", lambda: check_model_files(endpoint=endpoint, node=node)),
        {"name": "engine parser", "ok": True, "level": "ok", "message": _parser_note(node)},
    ]
    if not node.interfaces:
        checks.append(
            {
                "name": "interfaces",
                "ok": True,
                "level": "warning",
                "message": (
                    f"node {node.name} has recorded no interface variables (NODE_INTERFACES: HCCL_IF_IP, "
                    "GLOO_SOCKET_IFNAME, TP_SOCKET_IFNAME, ...): a multi-node group may pick the wrong network "
                    "and hang at its first collective"
                ),
            }
        )
    return {
        "node": node.name,
        "role": member.role,
        "replica": member.replica.index,
        "argv": argv,
        "env": masked(env),
        "container_argv": None,
        "command": format_for_shell(argv, env),
        "checks": checks,
    }


def _roles_of(endpoint: Endpoint) -> dict | None:
    """A disaggregated endpoint's roles: {"prefill": {"replicas", "nodes": [{"node", "replicas": [index, ...],
    "devices": [[...], ...]}], "connector"}, "decode": {...}}; None for one kind of replica."""
    if not endpoint.roles:
        return None
    out: dict = {}
    for replica in endpoint.replica_set.select_related("node").order_by("index"):
        role = out.setdefault(
            replica.role,
            {
                "replicas": 0,
                "nodes": [],
                "connector": (endpoint.engine_configs or {}).get("kv_transfer", {}).get("kv_connector"),
            },
        )
        role["replicas"] += 1
        on = next((n for n in role["nodes"] if n["node"] == replica.node.name), None)
        if on is None:
            on = {"node": replica.node.name, "replicas": [], "devices": []}
            role["nodes"].append(on)
        on["replicas"].append(replica.index)
        on["devices"].append(list(replica.devices))
    return out


def endpoint_preview(*, spec: EndpointSpec, user) -> dict:
    """{"endpoint": the name, "recipe", "replicas", "nodes": [{"node", "role", "replica", "argv", "env" (secrets
    masked), "container_argv", "command" (one shell line, for reading and copying), "checks": [{"name", "ok",
    "level", "message"}]}], "roles": each role's nodes (endpoint_preview's _roles_of; None without roles)}: replica 0's
    processes, the server first, then its members by rank; with roles, replica 0 (prefill) and the first decode
    replica, each "role" saying which. A spec the launch
    would refuse raises the same ValidationError, naming the field."""
    if not spec.name:
        spec = spec.model_copy(update={"name": "preview"})
    result: dict = {}
    try:
        with transaction.atomic():
            endpoint = endpoint_create(spec=spec, user=user)
            replica = endpoint.replica_set.select_related("node").order_by("index").first()
            if endpoint.distributed:  # the group's rendezvous on its head node, as the agent claims it first
                replica.cluster_port = claim_port(replica.node, replica, field="cluster_port")
            nodes = [_replica_entry(endpoint, replica)]
            if endpoint.roles:  # and the decode role's first replica: both roles' commands
                first_decode = endpoint.replica_set.select_related("node").filter(role=Replica.Role.DECODE).first()
                nodes.append(_replica_entry(endpoint, first_decode))
            nodes += [
                _member_entry(endpoint, m)
                for m in ReplicaMember.objects.filter(replica=replica)
                .select_related("node", "replica", "replica__node", "replica__endpoint")
                .order_by("rank")
            ]
            result = {
                "endpoint": endpoint.name,
                "recipe": endpoint.recipe or None,
                "replicas": endpoint.replicas,
                "roles": _roles_of(endpoint),
                "nodes": nodes,
            }
            raise _RolledBack
    except _RolledBack:
        pass
    return result
