"""The whole launch of one replica: the LaunchSpec from the endpoint, replica and node, the argv
(endpoints.commands.build_command), the child's environment and its log file. The agent's
supervisor gets the finished ProcessSpec and runs it. On a node whose engine runtime is Docker or
Podman the same vLLM argv runs inside vllm-ascend's image (build_container_command). A multi-node
replica's members (Ray nodes, headless data-parallel ranks) are built here too, each for the node
that runs it, as processes of that node's engine venv."""

import hashlib
import os
import re
from pathlib import Path

from django.conf import settings

from console.env import child_environment
from endpoints.commands import (
    GUARD_DIR,
    GUARD_MODULE_FILE,
    PROFILER_FLAG,
    CommandSpecError,
    ContainerSpec,
    LaunchSpec,
    build_command,
    build_container_command,
    container_name,
    env_unknown_to,
    flags_unknown_to,
    guarded_argv,
    ray_head_command,
    ray_worker_command,
    validate_extra_args,
)
from endpoints.commands.pd import role_launch
from endpoints.lora import launch_lora
from endpoints.models import Endpoint, Replica, ReplicaMember
from endpoints.profiling.paths import replica_profile_dir
from endpoints.replica_state import ENGINE_REFUSED
from models_registry.paths import PathRefused, check_tree
from workers.agent.supervisor import ProcessSpec
from workers.host_stats import cpu_list_text, parse_cpu_list
from workers.models import Node


def node_interfaces(node: Node) -> dict[str, str]:
    """The interface variables the node's agent recorded (NODE_INTERFACES): checked by the command builder."""
    return node.interfaces


def node_count(replica: Replica) -> int:
    """How many nodes the replica spans: the head and one per member of a higher rank."""
    return 1 + sum(1 for m in replica.members.all() if m.rank > 0)


def distributed_spec(*, replica: Replica, node_rank: int, node: Node) -> dict | None:
    """LaunchSpec.distributed for the node of this rank; the rendezvous is on the replica's head node."""
    endpoint = replica.endpoint
    if not endpoint.distributed:
        return None
    nnodes = node_count(replica)
    spec = {
        "backend": endpoint.distributed,
        "head_address": f"{replica.node.address}:{replica.cluster_port}",
        "nnodes": nnodes,
        "node_rank": node_rank,
        "interfaces": node_interfaces(node),
    }
    if endpoint.distributed == Endpoint.Distributed.DP:
        spec.update(size=endpoint.data_parallel_size, size_local=endpoint.data_parallel_size // nnodes)
    return spec


def launch_spec(
    *,
    endpoint: Endpoint,
    replica: Replica,
    node: Node,
    port: int | None,
    devices: list[int] | None = None,
    node_rank: int = 0,
) -> LaunchSpec:
    devices = list(replica.devices if devices is None else devices)
    chip = node.devices.filter(index__in=devices).values_list("name", flat=True).first()
    return LaunchSpec(
        platform=node.platform,
        engine_python=node.engine_python or settings.ENGINE_PYTHON,
        model_path=endpoint.artifact.path,
        served_model_name=endpoint.served_model_name,
        host=settings.ENDPOINT_BIND_HOST,
        port=port,
        devices=devices,
        tensor_parallel_size=endpoint.tensor_parallel_size,
        pipeline_parallel_size=endpoint.pipeline_parallel_size,
        max_num_seqs=endpoint.max_num_seqs,
        max_model_len=endpoint.max_model_len,
        gpu_memory_utilization=endpoint.gpu_memory_utilization,
        dtype=endpoint.dtype or None,
        quantization=endpoint.quantization or None,
        enforce_eager=endpoint.enforce_eager,
        chip_name=chip,
        extra_args=dict(endpoint.extra_args),
        cpu_kvcache_gib=settings.VLLM_CPU_KVCACHE_GIB,
        env={**cpu_threads_env(endpoint=endpoint, replica=replica, node=node), **endpoint.env},
        distributed=distributed_spec(replica=replica, node_rank=node_rank, node=node),
        interfaces=node_interfaces(node) if not endpoint.distributed else {},
        trust_remote_code=endpoint.trust_remote_code,
        data_parallel_size=endpoint.data_parallel_size if not endpoint.distributed else 1,
        engine_configs={
            k: v for k, v in (endpoint.engine_configs or {}).items() if not (replica.role and k == "kv_transfer")
        },
        pd=role_launch_of(endpoint=endpoint, replica=replica, node=node),
        draft_model_path=endpoint.draft_artifact.path if endpoint.draft_artifact_id else None,
        async_scheduling=endpoint.async_scheduling,
        distributed_executor_backend=endpoint.distributed_executor_backend or None,
        profiler_dir=str(replica_profile_dir(replica)) if endpoint.profiling else None,
        lora=launch_lora(endpoint),
        # Not for a Ray replica: vLLM copies the server's VLLM_* variables to its Ray workers on every node
        # (vllm/v1/executor/ray_executor.py get_env_vars_to_copy), so they would all compile into the head
        # node's folder; unset, each host keeps vLLM's own default cache (~/.cache/vllm), which is its own.
        engine_cache_dir=None if endpoint.distributed == Endpoint.Distributed.RAY else str(engine_cache_dir(node)),
    )


def endpoint_kv_dir(endpoint: Endpoint) -> Path:
    """A disaggregated CPU endpoint's KV folder on its node (ExampleConnector's shared_storage_path): its prefill
    replicas write each prompt's KV there and its decode replicas read it. Under the endpoint's work folder, so it
    goes with the endpoint's files."""
    return endpoint_work_root() / endpoint.name / "kv"


def role_launch_of(*, endpoint: Endpoint, replica: Replica, node: Node) -> dict | None:
    """The role's connector config and variables of a disaggregated endpoint's replica (endpoints.commands.pd);
    None for a replica with no role."""
    if not replica.role or not endpoint.roles:
        return None
    sizes = {"dp_size": endpoint.data_parallel_size or 1, "tp_size": endpoint.tensor_parallel_size}
    return role_launch(
        platform=node.platform,
        role=replica.role,
        connector=(endpoint.engine_configs or {}).get("kv_transfer") or {},
        replica_index=replica.index,
        parallel={"prefill": sizes, "decode": sizes},
        storage_dir=str(endpoint_kv_dir(endpoint)),
        host=node.address or None,
    )


def cpu_threads_env(*, endpoint: Endpoint, replica: Replica, node: Node) -> dict[str, str]:
    """The threads of one replica on a CPU node, as environment variables; {} leaves vLLM's own choice
    ("auto"). vllm-cpu's auto binding takes the same cores for every process (NUMA node 0's, one logical
    CPU per physical core, less one it reserves for the engine's busy-polling scheduler process:
    vllm/utils/ompmultiprocessing.py `_parse_omp_threads_bind_env`, `_get_autobind_cpu_ids`), so two
    replicas on one node, of one endpoint or of two, would share one set and the second would add no
    compute.

    So the node's cores (the ones its agent found, Node.host["cpu_cores"]) are handed out across every
    endpoint on it, as devices are: a replica alone on its node, of an endpoint that never runs more than
    one, keeps vLLM's auto binding; otherwise the node's demand is this endpoint's replica slots (its count,
    or its autoscale maximum: held for its largest size, as devices are) plus those of every other endpoint
    that runs a replica there or wants one to run, and the replica gets a run of len(cores) // demand cores
    that no running replica holds (:func:`held_cores`, read from what each was started with, Replica.env,
    and for one on vLLM's auto binding the NUMA node's cores the agent recorded, Node.host["numa_cores"];
    the longest free run when none is that long), pinned less the run's last core, left to its scheduler
    and API server as vLLM's auto binding leaves one:
    VLLM_CPU_OMP_THREADS_BIND. Under two cores a share, or with nothing free (shares handed out before the
    demand grew, or a neighbour on vLLM's auto binding over the whole node, until they restart:
    :func:`cpu_share_note` says so on the endpoint page), a share cannot be pinned:
    pinned to one core each, a starting replica took 320 s to be ready beside a busy one (its core was
    left all the floating processes, the busy engine's spinning scheduler included; 2 cores); unpinned with
    vLLM's default threads (one per core each), one replica's answers slowed to 0.2 tokens/s beside a busy
    one (most likely their OpenMP threads spinning against each other). There the replica runs unpinned
    ("nobind") with a thread per share's worth of cores (OMP_NUM_THREADS), and the OS spreads them. The
    endpoint's own env wins (it is laid over this), and multi-rank replicas (TP or PP above 1, one core set
    per rank) keep auto. One agent starts its node's replicas one after another, each start recording its
    env before the next share is chosen, so two starts never take the same share."""
    return _cpu_share(endpoint=endpoint, replica=replica, node=node)[0]


def cpu_share_note(*, replica: Replica, node: Node) -> str:
    """For the endpoint page, when the replica runs unpinned although the node has a share of two cores or
    more for it: which running replicas hold the cores, and the restarts that share them out; else ""."""
    holders = _cpu_share(endpoint=replica.endpoint, replica=replica, node=node)[1]
    if not holders:
        return ""
    one = len(holders) == 1
    # Another team's replica by what it is, not its name: the node is shared, the endpoint is not (issue 37).
    names = ", ".join(
        sorted(
            f"{r.endpoint.name} (replica {r.index})"
            if r.endpoint.team_id == replica.endpoint.team_id
            else "another team's replica"
            for r in holders
        )
    )
    return (
        f"runs unpinned: the cores a share of its own needs on {node.name} are held by {names}, started "
        f"before this replica was wanted there; restart {'it' if one else 'them'}, then this endpoint, to "
        "give each its own cores"
    )


def _cpu_share(*, endpoint: Endpoint, replica: Replica, node: Node) -> tuple[dict[str, str], list[Replica]]:
    """(cpu_threads_env's variables, the running replicas that hold the cores a pinned share would need:
    non-empty only when the replica is left unpinned for want of free cores)."""
    if node.platform != Node.Platform.CPU or not _shares_cores(endpoint):
        return {}, []
    groups = _core_groups(node.host or {})
    cores = [core for group in groups for core in group]
    placed = list(Replica.objects.filter(node=node).exclude(pk=replica.pk).select_related("endpoint"))
    running = [r for r in placed if r.launched]
    members = ReplicaMember.objects.filter(node=node).exclude(pid=None).count()  # auto-bound ranks, Ray nodes
    # Every other endpoint that runs a replica here or wants one to (started together, or after a reboot,
    # the first to start is not alone: it takes its share, not the node).
    others = {
        r.endpoint_id: r.endpoint
        for r in placed
        if r.endpoint_id != endpoint.pk and (r.launched or (r.wanted and not r.held_failed))
    }
    demand = _replica_slots(endpoint, replica.index) + sum(_replica_slots(e) for e in others.values()) + members
    if demand < 2 and not running and not members:
        return {}, []
    size = len(cores) // demand
    held = held_cores(running, cores, numa_cores=(node.host or {}).get("numa_cores"))
    share = _free_share(groups, held, size=size) if held is not None and not members else []
    if len(share) >= 2:
        return {"VLLM_CPU_OMP_THREADS_BIND": cpu_list_text(share[:-1])}, []
    # Named only where a restart changes something: a replica this rule pins when it starts again.
    holders = [r for r in running if r.cpu_binding != "nobind" and _shares_cores(r.endpoint)]
    return {
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": str(max(1, size)),
    }, holders if size >= 2 and not members else []


def _shares_cores(endpoint: Endpoint) -> bool:
    """The rule applies to the endpoint's replicas: no binding of the operator's, one rank, one node."""
    return (
        "VLLM_CPU_OMP_THREADS_BIND" not in endpoint.env
        and not endpoint.distributed
        and endpoint.tensor_parallel_size * endpoint.pipeline_parallel_size == 1
    )


def _core_groups(host: dict) -> list[list[int]]:
    """The node's cores (Node.host["cpu_cores"], else as many as its CPUs), one list per NUMA node where the
    agent recorded them (Node.host["numa_cores"]; the rest in one more), in the agent's order within each:
    a share is a run within one, never across NUMA nodes (whose ids may interleave: node 0 the even ones)."""
    cores = list(host.get("cpu_cores") or range(host.get("cpus") or 0))
    numa = [[core for core in group if core in cores] for group in host.get("numa_cores") or []]
    grouped = {core for group in numa for core in group}
    return [group for group in [*numa, [core for core in cores if core not in grouped]] if group]


def _replica_slots(endpoint: Endpoint, index: int = 0) -> int:
    """How many replicas the endpoint may run at once: its count, or its autoscale maximum."""
    return max(endpoint.replicas, (endpoint.autoscale or {}).get("max_replicas") or 0, index + 1)


def held_cores(
    running: list[Replica], cores: list[int], *, numa_cores: list[list[int]] | None = None
) -> set[int] | None:
    """The cores the running replicas were pinned to, each with the core after its set (its share's last,
    left to its scheduler); a replica on vLLM's auto binding holds the cores of the first NUMA nodes it may
    take memory from, one per rank (``numa_cores``, as the agent recorded them: Node.host["numa_cores"];
    ``cores`` is in the order of :func:`_core_groups`). None when one of them holds cores that cannot be
    known (auto binding without that record, an operator's several sets per rank)."""
    held: set[int] = set()
    for other in running:
        binding = other.cpu_binding
        if binding == "nobind":
            continue
        if binding == "auto":
            ranks = other.endpoint.tensor_parallel_size * other.endpoint.pipeline_parallel_size
            if not numa_cores or len(numa_cores) < ranks:
                return None
            held.update(core for node_cores in numa_cores[:ranks] for core in node_cores)
            continue
        pinned = parse_cpu_list(binding)
        if not pinned:  # None: cores that cannot be named; empty: nothing a start of ours records
            return None
        held |= pinned
        if max(pinned) in cores[:-1]:  # its share's last core, in the order shares are cut
            held.add(cores[cores.index(max(pinned)) + 1])
    return held


def _free_share(groups: list[list[int]], held: set[int], *, size: int) -> list[int]:
    """`size` cores in a row of one group (:func:`_core_groups`) none of which is held: the first such run,
    else the longest run of free cores there is (a share is a run, so :func:`held_cores` finds its last
    core again)."""
    if size < 1:
        return []
    runs: list[list[int]] = []
    for group in groups:
        runs.append([])
        for core in group:
            if core in held:
                runs.append([])
            else:
                runs[-1].append(core)
    fitting = [run for run in runs if len(run) >= size]
    return fitting[0][:size] if fitting else max(runs, key=len, default=[])


def engine_cache_dir(node: Node) -> Path:
    """The node's persistent engine cache, the same path on every start: a folder of its own under
    ENDPOINT_ENGINE_CACHE_ROOT. Of its own because the root may be shared storage (DATA_DIR is, on Kubernetes)
    and what is compiled there is for that host's chips: vLLM's key has no CPU instruction set in it (an
    AVX-512 kernel loaded on an AVX2 host dies of SIGILL) and torch checks only its own and Python's versions
    on load (torch/_dynamo/package.py SystemInfo.check_compatibility)."""
    root, name = Path(settings.ENDPOINT_ENGINE_CACHE_ROOT), re.sub(r"[^A-Za-z0-9._-]", "_", node.name)
    if name == node.name and name.strip("."):
        return root / name
    # A name changed to fit ("rack 7" and "rack_7" would share a folder) or only dots: its digest keeps it apart.
    return root / f"{name.strip('.') or 'node'}-{hashlib.sha256(node.name.encode()).hexdigest()[:12]}"


def make_engine_cache_dir(node: Node) -> Path:
    """The engine cache, made 0700 before a start on the node that runs it (a container's bind mount needs
    it to exist). Engines load compiled code from it (pickled graphs, shared objects): a directory other
    users could write would let them run code in every replica, so one left open is tightened (the root too)."""
    path = engine_cache_dir(node)
    for folder in (path.parent, path):
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = folder.stat()
        if st.st_uid == os.getuid() and st.st_mode & 0o077:
            folder.chmod(0o700)
    return path


def make_profile_dir(replica: Replica) -> None:
    """The replica's profile directory, made before its start on the node that runs it (beside the log
    directory the supervisor makes): a container's bind mount needs it to exist, and made here it belongs
    to the agent's user rather than to the container's root."""
    if replica.endpoint.profiling:
        replica_profile_dir(replica).mkdir(parents=True, exist_ok=True)


def endpoint_log_root() -> Path:
    """A directory per endpoint (its name) holds its replicas' logs on each node (endpoints.node_files)."""
    return Path(settings.DATA_DIR) / "logs" / "endpoints"


def recorded_log(path: str) -> str:
    """A log path read back from a replica's or member's row, only inside this node's endpoint log folder (where
    replica_log_path puts every one), else '' (read as no log). Rows are the agent's own writes, but an edited
    row must not make the agent or the web read, rotate or append to any other file; a link out is refused too."""
    if not path:
        return ""
    try:
        inside = Path(path).resolve().is_relative_to(endpoint_log_root().resolve())
    except (OSError, RuntimeError, ValueError):
        return ""
    return path if inside else ""


def endpoint_work_root() -> Path:
    """A directory per endpoint (its name) holds its engine processes' working directories on each node."""
    return Path(settings.DATA_DIR) / "work" / "endpoints"


def replica_log_path(replica: Replica) -> Path:
    return endpoint_log_root() / replica.endpoint.name / f"replica-{replica.index}.log"


def replica_work_dir(replica: Replica) -> Path:
    """The replica server's working directory (the same on every start), under DATA_DIR: see make_work_dir."""
    return endpoint_work_root() / replica.endpoint.name / f"replica-{replica.index}"


def member_work_dir(member: ReplicaMember) -> Path:
    return replica_work_dir(member.replica).with_name(f"replica-{member.replica.index}-{member.role}-{member.rank}")


def make_work_dir(path: Path) -> Path:
    """An engine process's working directory, made (0700) before its start on the node that runs it, with
    the replica key guard's module in it, where ``python -m`` finds what ``--middleware`` names (a copy,
    replaced whole when the console's differs). Writable and the process's own: CANN writes files into
    the working directory unless told otherwise (the fusion engine's fusion_result.json,
    FusionStatisticWriter::GetFusionResultFilePath, and GE's dumps: "./" when ASCEND_WORK_PATH is unset),
    which in the console's code directory would litter the source tree, or fail where it is read-only
    (ProtectSystem=strict: deploy/systemd), and in one directory shared by every replica would mix their
    files."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    source = Path(GUARD_DIR) / GUARD_MODULE_FILE
    target = path / GUARD_MODULE_FILE
    code = source.read_bytes()
    try:
        same = target.read_bytes() == code
    except OSError:
        same = False
    if not same:
        spare = path / f".{GUARD_MODULE_FILE}.{os.getpid()}"
        spare.write_bytes(code)
        spare.replace(target)
    return path


def _refuse_multi_node_container(endpoint: Endpoint, node: Node) -> None:
    """A multi-node replica's members run as processes of each node's engine venv (`ray start`, headless
    `vllm serve`): a server in vllm-ascend's image would bring another Ray and vLLM than the ones it joins."""
    if endpoint.distributed:
        raise CommandSpecError(
            f"{endpoint.name} spans nodes ({endpoint.distributed}), whose parts run as processes "
            f"of each node's engine venv; {node.name} runs replicas under {node.engine_runtime}: "
            "set its engine runtime to process"
        )


def member_log_path(member: ReplicaMember) -> Path:
    return replica_log_path(member.replica).with_name(f"replica-{member.replica.index}-{member.role}-{member.rank}.log")


class EngineRefused(CommandSpecError):
    """The vLLM command a start is about to run has flags or VLLM_* variables that its node's vLLM, as the
    node's agent last probed it (Node.engine_cli), does not know: its engine changed since the launch."""


class ModelFilesRefused(EngineRefused):
    """The model's files on the node that would serve it lead out of that node's model roots: refused as a
    start its parser refuses (state FAILED, "not started", until an operator's Start)."""


def check_model_files(*, endpoint: Endpoint, node: Node) -> None:
    """vLLM reads the model's files itself (weights, tokenizer, chat template): on this node the model lies
    inside the configured roots (MODEL_ROOTS, ARTIFACT_STORE) and no link below it leads out, checked on
    every start, as the registry checks before transformers reads a model (models_registry.paths.check_tree).
    A link planted after registration would otherwise have the engine read any file the agent's user can."""
    try:
        check_tree(endpoint.artifact.path)
        for adapter in endpoint.adapters.alive():  # loaded at start by path too (--lora-modules)
            check_tree(adapter.path)
    except PathRefused as exc:
        raise ModelFilesRefused(
            f"{ENGINE_REFUSED}: the model's files on node {node.name}: {exc} Remove the link, "
            "or register the model from inside the roots (this node's MODEL_ROOTS and "
            "ARTIFACT_STORE), then start it again"
        ) from exc
    except OSError as exc:  # a folder below it made unreadable after registration
        raise ModelFilesRefused(
            f"{ENGINE_REFUSED}: the model's files on node {node.name} cannot be read: "
            f"{exc.strerror or exc}: {exc.filename or endpoint.artifact.path}"
        ) from exc


def check_node_parser(*, node: Node, argv: list[str], env_keys) -> None:
    """The launch's rule (services.checked_engine_options) again at each start, against the node's parser
    now: the agent re-probes when the engine under it changes. No parser reported: the allow-list holds."""
    cli = node.engine_cli or {}
    if not cli.get("options"):
        return
    flags = flags_unknown_to(argv, cli["options"])
    env = env_unknown_to(list(env_keys), cli["env"], cli.get("ascend_env")) if "env" in cli else []
    if not flags and not env:
        return
    what = []
    if flags:
        what.append(f"{', '.join(flags)} {'is not a flag' if len(flags) == 1 else 'are not flags'}")
    if env:
        what.append(f"{', '.join(env)} {'is not a variable' if len(env) == 1 else 'are not variables'}")
    raise EngineRefused(
        f"{ENGINE_REFUSED}: {' and '.join(what)} of vLLM {cli.get('vllm') or '(version unknown)'} "
        f"on node {node.name} (its engine changed since the launch); change the endpoint's "
        "options or the node's engine, then start it again"
    )


def as_applied(env_added: dict[str, str], env: dict[str, str]) -> dict[str, str]:
    """The console's variables as the child got them (shown on the endpoint page, as it ran): a search path
    before the host's, an allow-list joined to the host's or left out (console.env.child_environment)."""
    return {key: env[key] for key in env_added if key in env}


def replica_process(*, replica: Replica, node: Node, port: int) -> tuple[ProcessSpec, dict[str, str]]:
    """(what the supervisor runs, the variables the console set: shown on the endpoint page)."""
    check_model_files(endpoint=replica.endpoint, node=node)
    launch = launch_spec(endpoint=replica.endpoint, replica=replica, node=node, port=port)
    argv, env_added = build_command(launch)
    # vLLM's --api-key guards /v1 only; the console's middleware wants the same key on every other path.
    argv = guarded_argv(argv)
    check_node_parser(node=node, argv=argv, env_keys=replica.endpoint.env)
    # The replica's key goes in the child's environment only: env_added is shown on the endpoint page.
    secret = {"VLLM_API_KEY": replica.api_key}
    if not node.containerised:
        env = child_environment({**env_added, **secret})
        spec = ProcessSpec(
            argv=argv,
            env=env,
            cwd=str(replica_work_dir(replica)),
            log_path=replica_log_path(replica),
            log_keep=settings.ENDPOINT_LOG_KEEP,
        )
        return spec, as_applied(env_added, env)
    _refuse_multi_node_container(replica.endpoint, node)
    if node.platform != Node.Platform.ASCEND:
        raise CommandSpecError(
            f"{node.name} runs replicas under {node.engine_runtime}, which serves vllm-ascend's "
            f"image: Ascend nodes only, and this is a {node.get_platform_display()} node"
        )
    container = ContainerSpec(
        runtime=node.engine_runtime,
        image=node.engine_image(launch.chip_name),
        name=container_name(replica.endpoint.name, replica.index),
        devices=list(replica.devices),
        secret_env=tuple(secret),
        work_dir=str(replica_work_dir(replica)),
        # The runtime's own copy of the output, bounded like the agent's (ENDPOINT_LOG_*).
        log_max_bytes=settings.ENDPOINT_LOG_MAX_BYTES,
        log_files=settings.ENDPOINT_LOG_KEEP,
    )
    # The engine variables travel as `-e` flags in the argv (shown there); the key by name only, its value
    # from the CLI's own environment.
    spec = ProcessSpec(
        argv=build_container_command(container, argv, env_added),
        env=child_environment(secret),
        log_path=replica_log_path(replica),
        log_keep=settings.ENDPOINT_LOG_KEEP,
        runtime=node.engine_runtime,
        container_name=container.name,
    )
    return spec, {}


def member_command(member: ReplicaMember) -> tuple[list[str], dict[str, str]]:
    """The member's argv and added environment: `ray start` (vllm-ascend's Ray tutorial: the interface
    variables and devices set before it, on every node) or the headless `vllm serve` of a DP rank."""
    replica, node, endpoint = member.replica, member.node, member.replica.endpoint
    if member.role == ReplicaMember.Role.DP_HEADLESS:
        argv, env_added = build_command(
            launch_spec(
                endpoint=endpoint, replica=replica, node=node, port=None, devices=member.devices, node_rank=member.rank
            )
        )
        check_node_parser(node=node, argv=argv, env_keys=endpoint.env)
        return argv, env_added
    if member.role == ReplicaMember.Role.RAY_WORKER:
        # `ray start` itself has no vLLM flags; the server's Ray workers on this node run this node's vLLM
        # with the spec's options (the head's own flags are checked on the head's node).
        spec_flags = validate_extra_args(endpoint.extra_args) + ([PROFILER_FLAG] if endpoint.profiling else [])
        check_node_parser(node=node, argv=spec_flags, env_keys=endpoint.env)
    common = {
        "node_ip": node.address,
        "platform": node.platform,
        "devices": list(member.devices),
        "interfaces": node_interfaces(node),
        "env": dict(endpoint.env),
    }
    engine_python = node.engine_python or settings.ENGINE_PYTHON
    if member.role == ReplicaMember.Role.RAY_HEAD:
        return ray_head_command(engine_python, port=replica.cluster_port, **common)
    return ray_worker_command(engine_python, head_address=f"{replica.node.address}:{replica.cluster_port}", **common)


def member_process(member: ReplicaMember) -> tuple[ProcessSpec, dict[str, str]]:
    if member.node.containerised:
        _refuse_multi_node_container(member.replica.endpoint, member.node)
    check_model_files(endpoint=member.replica.endpoint, node=member.node)  # its engine reads them on this node
    argv, env_added = member_command(member)
    env = child_environment(env_added)
    # runtime "process" (ProcessSpec's default): `ray start` and headless ranks run on the host's engine venv.
    return ProcessSpec(
        argv=argv,
        env=env,
        log_path=member_log_path(member),
        log_keep=settings.ENDPOINT_LOG_KEEP,
        cwd=str(member_work_dir(member)),
    ), as_applied(env_added, env)
