"""The LaunchSpec, its validation, and the argv/env that start the vLLM server."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from endpoints.commands.cache import CPU_AOT_PLUGIN_ENV, check_cache_dir, engine_cache_env
from endpoints.commands.checks import (
    CommandSpecError,
    _as_float,
    _check_engine_python,
    _check_host,
    _check_port,
    _check_text,
    _is_int,
    _split_host_port,
    _strict_int,
)
from endpoints.commands.environment import _validate_interfaces, validate_env
from endpoints.commands.flags import DP_PLACEMENT_FLAGS, EXTRA_ARG_RULES, validate_extra_args
from endpoints.commands.lora import LORA_FLAGS, lora_args
from endpoints.commands.pd import pd_connector_env
from endpoints.commands.platforms import (
    _CPU_DEFAULT_KVCACHE_GIB,
    CLI_MODULE,
    DEVICE_ENV,
    DTYPES,
    PLATFORMS,
    QUANTIZATION_METHODS,
    SERVER_MODULE,
    _platform_env,
)
from endpoints.commands.profiler import PROFILER_FLAG, check_profiler_dir, profiler_args


@dataclass(kw_only=True)
class LaunchSpec:
    platform: str  # "ascend" | "cuda" | "cpu"
    engine_python: str  # absolute path of the engine venv's python
    model_path: str  # local directory or hub id
    served_model_name: str
    host: str = "127.0.0.1"
    port: int  # ignored (may be None) on a headless data-parallel rank
    devices: list[int] = field(default_factory=list)  # NPU / GPU ids (per node)
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    max_num_seqs: int | None = None
    max_model_len: int | None = None
    gpu_memory_utilization: float | None = None  # ignored on cpu
    dtype: str | None = None  # "auto" | "float16" | "bfloat16" | "float32"
    quantization: str | None = None  # "ascend" (ModelSlim), "compressed-tensors", ...
    enforce_eager: bool = False
    chip_name: str | None = None  # npu-smi chip name, e.g. "910B4", "310P3" (ascend only)
    extra_args: dict = field(default_factory=dict)
    env: dict = field(default_factory=dict)
    cpu_kvcache_gib: int | None = None  # cpu only (VLLM_CPU_KVCACHE_SPACE, default 1)
    cpu_threads_bind: str | None = None  # cpu only (VLLM_CPU_OMP_THREADS_BIND)
    distributed: dict | None = None  # {"backend": "ray", "head_address", "nnodes", "node_rank", "interfaces"}
    trust_remote_code: bool = False
    # vLLM's profiler on (--profiler-config), writing here; driven by POST /start_profile and
    # /stop_profile. endpoints.commands.profiler says what each platform writes.
    profiler_dir: str | None = None
    # The node's persistent engine cache (vLLM's cache root, inductor's and Triton's caches): a restart
    # of the same artifact with the same settings loads what an earlier start compiled
    # (endpoints.commands.cache).
    engine_cache_dir: str | None = None
    # One node's data parallelism: this many API-server-less engine ranks of TP x PP each on `devices`
    # (--data-parallel-size; vllm-ascend's DeepSeek-R1 single-node tutorial runs DP4 x TP4 on 16 NPUs).
    # A multi-node group's sizes come from `distributed` instead.
    data_parallel_size: int = 1
    # vLLM's JSON-valued options, by the spec's field name (ENGINE_CONFIG_FLAGS): {"speculative": {...},
    # "compilation": {...}, "ascend": {...} (vllm-ascend's --additional-config), "hf_overrides": {...},
    # "kv_transfer": {...}}; checked against the node's own config classes by the service.
    engine_configs: dict = field(default_factory=dict)
    async_scheduling: bool | None = None  # None: vLLM's default
    distributed_executor_backend: str | None = None  # "mp" | "uni" | "ray"; a Ray cluster sets "ray" itself
    # The draft model or EAGLE head of `speculative`: an artifact's path, resolved by the console (never an
    # operator's text); rendered as the config's "model".
    draft_model_path: str | None = None
    # One node's interface variables (HCCL_IF_IP, GLOO_SOCKET_IFNAME, ...: NODE_INTERFACES), set on ascend and cuda
    # as vllm-ascend's single-node tutorials export them (DeepSeek-R1.md 5.1); a multi-node spec's come with
    # `distributed`.
    interfaces: dict = field(default_factory=dict)
    # LoRA on: {"max_loras", "max_lora_rank", "max_cpu_loras", "modules": [{"name", "path"}]} (the endpoint's
    # registry adapters, loaded at start; endpoints.commands.lora). None: no LoRA.
    lora: dict | None = None
    # A replica of a disaggregated endpoint: {"role": "prefill" | "decode", "kv_transfer": its KVTransferConfig,
    # "env": its connector's variables}, built by the console (endpoints.commands.pd.role_launch); the role's
    # config replaces the endpoint's shared kv_transfer.
    pd: dict | None = None


_SERVED_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}")
_CHIP_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9 _.()-]{0,63}")
_THREADS_BIND_RE = re.compile(r"[0-9]+(-[0-9]+)?(,[0-9]+(-[0-9]+)?)*")


#: The spec's JSON-valued fields and the vLLM option each renders (vllm/engine/arg_utils.py at 0.32.0 parses
#: them as JSON into SpeculativeConfig, CompilationConfig, KVTransferConfig, a dict for --hf-overrides and
#: --additional-config, the platform's own settings: vllm_ascend/ascend_config.py reads them on Ascend).
ENGINE_CONFIG_FLAGS = {
    "speculative": "--speculative-config",
    "compilation": "--compilation-config",
    "kv_transfer": "--kv-transfer-config",
    "hf_overrides": "--hf-overrides",
    "ascend": "--additional-config",
}
#: Keys that name a path or a module to load: never from an operator (a draft model comes from the registry,
#: as the service's draft_artifact; caches and dumps go where the console puts them).
_CONFIG_KEYS_REFUSED = {
    "speculative": {
        "model": "name the draft model or head as draft_artifact (an artifact of the registry), never a path",
        "tokenizer": "the draft uses its artifact's own tokenizer",
        "draft_model_path": "name the draft model as draft_artifact",
    },
    "compilation": {
        "cache_dir": "the console sets the engine cache (its folder per node)",
        "debug_dump_path": "a dump path writes files where the console does not manage them",
        "local_cache_dir": "the console sets the engine cache (its folder per node)",
    },
    "kv_transfer": {"kv_connector_module_path": "a module path loads code: use a connector vLLM registers"},
    "hf_overrides": {"auto_map": "auto_map names code to load"},
}
_CONFIG_MAX_BYTES = 16384
EXECUTOR_BACKENDS = ("mp", "uni", "ray")


def engine_config_json(name: str, value: Any, *, platform: str, draft_model_path: str | None = None) -> str:
    """One config as the JSON text its flag takes: a JSON object with text keys, no path keys, at most 16 KiB;
    ``ascend`` on Ascend nodes only. Its keys and values are vLLM's to judge (the service checks them against the
    node's config classes). The speculative draft's path, resolved from the registry, goes in as "model"."""
    if name not in ENGINE_CONFIG_FLAGS:
        raise CommandSpecError(f"{name!r} is not an engine config; allowed: {', '.join(ENGINE_CONFIG_FLAGS)}")
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise CommandSpecError(f"{name} must be a JSON object (text keys), got {type(value).__name__}")
    if name == "ascend" and platform != "ascend":
        raise CommandSpecError(f"ascend (vllm-ascend's --additional-config) applies to ascend nodes, not {platform}")
    for key, why in _CONFIG_KEYS_REFUSED.get(name, {}).items():
        if key in value:
            raise CommandSpecError(f"{name}.{key} is not accepted: {why}")
    if name == "speculative" and draft_model_path is not None:
        value = {**value, "model": _check_text(draft_model_path, "draft_model_path")}
    try:
        text = json.dumps(value, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise CommandSpecError(f"{name} is not plain JSON: {exc}") from None
    if len(text) > _CONFIG_MAX_BYTES:
        raise CommandSpecError(f"{name} is longer than {_CONFIG_MAX_BYTES} bytes as JSON")
    return text


def _check_engine_configs(spec: LaunchSpec) -> dict[str, str]:
    configs = spec.engine_configs or {}
    if not isinstance(configs, Mapping):
        raise CommandSpecError("engine_configs must be a mapping of config name to JSON object")
    return {
        name: engine_config_json(name, value, platform=spec.platform, draft_model_path=spec.draft_model_path)
        for name, value in configs.items()
        if value is not None
    }


def _chip(spec: LaunchSpec) -> str:
    """npu-smi chip name, upper-case, without an "Ascend" prefix ("Ascend310P3" -> "310P3")."""
    return re.sub(r"^ASCEND[\s_-]*", "", (spec.chip_name or "").strip().upper())


def _is_310p(spec: LaunchSpec) -> bool:
    return spec.platform == "ascend" and _chip(spec).startswith("310P")


@dataclass(frozen=True)
class _Distributed:
    backend: str  # "ray" | "dp"
    head_host: str
    head_port: int  # the Ray head's GCS port, or the DP group's RPC port
    nnodes: int
    node_rank: int
    interfaces: dict[str, str]
    size: int = 1  # dp: --data-parallel-size (every node)
    size_local: int = 1  # dp: --data-parallel-size-local (ranks on each node)

    @property
    def headless(self) -> bool:
        return self.backend == "dp" and self.node_rank > 0


_DIST_KEYS = {"backend", "head_address", "nnodes", "node_rank", "interfaces", "size", "size_local"}


def _validate_distributed(d: Any, platform: str) -> _Distributed | None:
    if d is None:
        return None
    if not isinstance(d, Mapping):
        raise CommandSpecError("distributed must be a mapping")
    unknown = set(d) - _DIST_KEYS
    if unknown:
        raise CommandSpecError(f"distributed has unknown keys: {', '.join(sorted(map(str, unknown)))}")
    backend = d.get("backend", "ray")
    if backend not in ("ray", "dp"):
        raise CommandSpecError(f"distributed.backend must be 'ray' or 'dp', got {backend!r}")
    if backend == "dp" and platform == "cpu":
        raise CommandSpecError(
            "multi-node data parallelism starts the other nodes with `vllm serve --headless`, which vllm-cpu "
            "cannot run (its `vllm` CLI stops at PackageNotFoundError: No package metadata was found for vllm)"
        )
    head_host, head_port = _split_host_port(d.get("head_address"), "distributed.head_address")
    nnodes = _strict_int(d.get("nnodes"), "distributed.nnodes", 1, 1024)
    node_rank = d.get("node_rank", 0)
    if not _is_int(node_rank) or not 0 <= node_rank < nnodes:
        raise CommandSpecError(f"distributed.node_rank must be an integer in 0..{nnodes - 1}, got {node_rank!r}")
    if backend == "ray" and node_rank != 0:
        raise CommandSpecError(
            "with the ray backend vLLM runs on the head node only (node_rank 0); "
            "start the other nodes with ray_worker_command()"
        )
    if backend == "ray" and ({"size", "size_local"} & set(d)):
        raise CommandSpecError("distributed.size and size_local are for the dp backend")
    size = size_local = 1
    if backend == "dp":
        size = _strict_int(d.get("size"), "distributed.size", 1, 1024)
        size_local = _strict_int(d.get("size_local"), "distributed.size_local", 1, 1024)
        if size != size_local * nnodes:
            raise CommandSpecError(
                f"distributed.size ({size}) must be size_local ({size_local}) x nnodes ({nnodes}) "
                f"= {size_local * nnodes}"
            )
    return _Distributed(
        backend,
        head_host,
        head_port,
        nnodes,
        node_rank,
        _validate_interfaces(d.get("interfaces"), platform),
        size,
        size_local,
    )


def _validate_spec(spec: LaunchSpec) -> _Distributed | None:
    if spec.platform not in PLATFORMS:
        raise CommandSpecError(f"platform must be one of {', '.join(PLATFORMS)}, got {spec.platform!r}")
    _check_engine_python(spec.engine_python)
    _check_text(spec.model_path, "model_path")
    if not isinstance(spec.served_model_name, str) or not _SERVED_NAME_RE.fullmatch(spec.served_model_name):
        raise CommandSpecError(
            "served_model_name must be 1-128 characters of letters, digits and . _ - : / @ +, "
            f"starting with a letter or digit; got {spec.served_model_name!r}"
        )
    _check_host(spec.host, "host")
    for what in ("tensor_parallel_size", "pipeline_parallel_size"):
        value = getattr(spec, what)
        if not _is_int(value) or not 1 <= value <= 1024:
            raise CommandSpecError(f"{what} must be an integer between 1 and 1024, got {value!r}")
    if not isinstance(spec.devices, (list, tuple)) or not all(_is_int(x) and 0 <= x < 1024 for x in spec.devices):
        raise CommandSpecError(f"devices must be a list of device ids (0..1023), got {spec.devices!r}")
    if len(set(spec.devices)) != len(spec.devices):
        raise CommandSpecError(f"devices contains duplicates: {list(spec.devices)!r}")
    if spec.max_num_seqs is not None:
        _strict_int(spec.max_num_seqs, "max_num_seqs", 1, 1_000_000)
    if spec.max_model_len is not None:
        _strict_int(spec.max_model_len, "max_model_len", 1, 1 << 30)
    if spec.gpu_memory_utilization is not None and spec.platform != "cpu":  # ignored on cpu
        _as_float(spec.gpu_memory_utilization, "gpu_memory_utilization", 0.0, 1.0, lo_open=True)
    if spec.dtype is not None and spec.dtype not in DTYPES:
        raise CommandSpecError(f"dtype must be one of {', '.join(DTYPES)}, got {spec.dtype!r}")
    if spec.quantization is not None:
        platforms = QUANTIZATION_METHODS.get(spec.quantization)
        if platforms is None:
            raise CommandSpecError(
                f"quantization must be one of {', '.join(sorted(QUANTIZATION_METHODS))}, got {spec.quantization!r}"
            )
        if spec.platform not in platforms:
            raise CommandSpecError(f"quantization {spec.quantization!r} is not available on {spec.platform}")
    for what in ("enforce_eager", "trust_remote_code"):
        if not isinstance(getattr(spec, what), bool):
            raise CommandSpecError(f"{what} must be true or false")
    if spec.chip_name is not None and (not isinstance(spec.chip_name, str) or not _CHIP_RE.fullmatch(spec.chip_name)):
        raise CommandSpecError(f"chip_name must be a device name like '910B4' or '310P3', got {spec.chip_name!r}")
    if spec.profiler_dir is not None:
        check_profiler_dir(spec.profiler_dir)
    if spec.engine_cache_dir is not None:
        check_cache_dir(spec.engine_cache_dir)
    if _is_310p(spec) and spec.dtype not in (None, "auto", "float16"):
        raise CommandSpecError(f"{spec.chip_name} (Atlas 300I) only supports dtype float16, got {spec.dtype!r}")

    if spec.platform == "cpu":
        if spec.devices:
            raise CommandSpecError("devices must be empty on cpu")
        if spec.cpu_kvcache_gib is not None:
            _strict_int(spec.cpu_kvcache_gib, "cpu_kvcache_gib (GiB)", 1, 65536)
        bind = spec.cpu_threads_bind
        if bind is not None:
            if not isinstance(bind, str) or not (
                bind in ("auto", "nobind") or all(_THREADS_BIND_RE.fullmatch(part) for part in bind.split("|"))
            ):
                raise CommandSpecError(
                    "cpu_threads_bind must be 'auto', 'nobind' or core lists like '0-31' "
                    f"('|' between ranks, e.g. '0-31|32-63'); got {bind!r}"
                )
            ranks = spec.tensor_parallel_size * spec.pipeline_parallel_size
            if bind not in ("auto", "nobind") and len(bind.split("|")) != ranks:
                raise CommandSpecError(
                    f"cpu_threads_bind lists {len(bind.split('|'))} core set(s) but tensor_parallel_size x "
                    f"pipeline_parallel_size = {ranks}; give one set per rank, separated by '|'"
                )
    # cpu_kvcache_gib / cpu_threads_bind are ignored on ascend and cuda.

    dist = _validate_distributed(spec.distributed, spec.platform)
    if spec.data_parallel_size != 1:
        _strict_int(spec.data_parallel_size, "data_parallel_size", 1, 1024)
        if dist is not None:
            raise CommandSpecError("data_parallel_size is for one node; a multi-node group's comes from distributed")
        if spec.platform == "cpu":
            raise CommandSpecError("data_parallel_size above 1 is for ascend and cuda nodes; on cpu use replicas")
    if dist is None or not dist.headless:  # a headless rank serves no HTTP
        _check_port(spec.port)
    if spec.platform in ("ascend", "cuda"):
        kind = "NPU" if spec.platform == "ascend" else "GPU"
        world = spec.tensor_parallel_size * spec.pipeline_parallel_size
        if not spec.devices:
            raise CommandSpecError(f"devices must list at least one {kind} id on {spec.platform}")
        if dist is not None and dist.backend == "dp":  # each node runs size_local whole TP x PP groups
            if world * dist.size_local != len(spec.devices):
                raise CommandSpecError(
                    f"distributed.size_local ({dist.size_local}) x tensor_parallel_size ({spec.tensor_parallel_size}) "
                    f"x pipeline_parallel_size ({spec.pipeline_parallel_size}) = {world * dist.size_local} must "
                    f"equal this node's {kind}s: {len(spec.devices)} device(s) {list(spec.devices)}"
                )
            return dist
        nnodes = dist.nnodes if dist else 1
        world *= 1 if dist else spec.data_parallel_size
        if world != len(spec.devices) * nnodes:
            per_node = f" x {nnodes} nodes" if dist else ""
            raise CommandSpecError(
                f"tensor_parallel_size ({spec.tensor_parallel_size}) x pipeline_parallel_size "
                f"({spec.pipeline_parallel_size})"
                + (f" x data_parallel_size ({spec.data_parallel_size})" if spec.data_parallel_size > 1 else "")
                + f" = {world} must equal the number of {kind}s: "
                f"{len(spec.devices)} device(s) {list(spec.devices)}{per_node} = {len(spec.devices) * nnodes}"
            )
    return dist


def build_command(spec: LaunchSpec) -> tuple[list[str], dict[str, str]]:
    """Return ``(argv, env_additions)`` that start the vLLM server described by ``spec``.

    ``env_additions`` are to be laid over the supervisor's base environment. Raises
    :class:`CommandSpecError` with a readable message for any invalid field.
    """
    dist = _validate_spec(spec)
    extra = validate_extra_args(spec.extra_args)
    user_env = validate_env(spec.env)
    configs = _check_engine_configs(spec)
    pd_env = {}
    if spec.pd is not None:
        configs["kv_transfer"] = engine_config_json("kv_transfer", spec.pd["kv_transfer"], platform=spec.platform)
        pd_env = pd_connector_env(spec.pd.get("env") or {})
    lora_argv, lora_env = lora_args(spec.lora)
    if spec.draft_model_path is not None and "speculative" not in configs:
        raise CommandSpecError("draft_model_path is the speculative config's draft: give a speculative config")
    backend = spec.distributed_executor_backend
    if backend is not None and backend not in EXECUTOR_BACKENDS:
        raise CommandSpecError(
            f"distributed_executor_backend must be one of {', '.join(EXECUTOR_BACKENDS)}, got {backend!r}"
        )
    if dist is not None and dist.backend == "ray":
        if backend not in (None, "ray"):
            raise CommandSpecError(f"a Ray cluster runs the ray executor, not {backend!r}")
        backend = "ray"
    if spec.async_scheduling is not None and not isinstance(spec.async_scheduling, bool):
        raise CommandSpecError(f"async_scheduling must be true, false or unset, got {spec.async_scheduling!r}")
    if spec.async_scheduling is not None and ("--async-scheduling" in extra or "--no-async-scheduling" in extra):
        raise CommandSpecError("--async-scheduling is set by the async_scheduling field; leave it out of extra_args")
    given = [flag for flag in DP_PLACEMENT_FLAGS if flag in extra]
    if dist is not None and given:
        raise CommandSpecError(f"{', '.join(given)} come from distributed (set per node); leave them out of extra_args")
    # Only `vllm serve` has a headless mode (no API server, engines only); the API server module has none.
    headless = (dist is not None and dist.headless) or "--headless" in extra

    dtype = spec.dtype
    enforce_eager = spec.enforce_eager
    if _is_310p(spec):
        # Atlas 300I runs float16 only. Its graph mode runs as vllm-ascend's 300I DUO tutorials run it, with a
        # compilation config that bounds the capture sizes (Qwen3-30B-A3B.md, Qwen3-Dense.md at v0.23.0:
        # {"cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": [1, 32]}); without one, eager.
        dtype = "float16"
        enforce_eager = enforce_eager or "compilation" not in configs

    argv = [spec.engine_python, "-m", CLI_MODULE, "serve"] if headless else [spec.engine_python, "-m", SERVER_MODULE]
    argv += ["--model", spec.model_path, "--served-model-name", spec.served_model_name]
    if not headless:
        argv += ["--host", spec.host, "--port", str(spec.port)]
    argv += ["--tensor-parallel-size", str(spec.tensor_parallel_size)]
    if spec.pipeline_parallel_size > 1:
        argv += ["--pipeline-parallel-size", str(spec.pipeline_parallel_size)]
    if backend is not None:
        argv += ["--distributed-executor-backend", backend]
    if dist is not None and dist.backend == "dp":
        argv += _dp_flags(dist)
    elif spec.data_parallel_size > 1:
        argv += ["--data-parallel-size", str(spec.data_parallel_size)]
    if spec.max_num_seqs is not None:
        argv += ["--max-num-seqs", str(spec.max_num_seqs)]
    if spec.max_model_len is not None:
        argv += ["--max-model-len", str(spec.max_model_len)]
    if spec.gpu_memory_utilization is not None and spec.platform != "cpu":
        argv += ["--gpu-memory-utilization", repr(float(spec.gpu_memory_utilization))]
    if dtype is not None:
        argv += ["--dtype", dtype]
    if spec.quantization is not None:
        argv += ["--quantization", spec.quantization]
    if enforce_eager:
        argv.append("--enforce-eager")
    if spec.trust_remote_code:
        argv.append("--trust-remote-code")
    if spec.async_scheduling is not None:
        argv.append("--async-scheduling" if spec.async_scheduling else "--no-async-scheduling")
    for name, text in configs.items():
        argv += [ENGINE_CONFIG_FLAGS[name], text]
    argv += profiler_args(spec.profiler_dir)
    argv += lora_argv
    argv += extra

    env = _platform_env(spec.platform, spec.devices)
    env.update(engine_cache_env(spec.engine_cache_dir))
    if spec.platform == "cpu":
        env.update(CPU_AOT_PLUGIN_ENV)  # before the host's own, in its list (console.env.child_environment)
        kv = spec.cpu_kvcache_gib if spec.cpu_kvcache_gib is not None else _CPU_DEFAULT_KVCACHE_GIB
        env["VLLM_CPU_KVCACHE_SPACE"] = str(kv)
        if spec.cpu_threads_bind is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = spec.cpu_threads_bind
    if dist is None and spec.platform != "cpu":
        env.update(_validate_interfaces(spec.interfaces, spec.platform))
    if dist is not None:
        if spec.platform == "ascend" and dist.backend == "ray":
            env["RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES"] = "1"
        if dist.backend == "ray":  # vLLM's ray.init() joins the cluster named here, not one it finds
            env["RAY_ADDRESS"] = f"{dist.head_host}:{dist.head_port}"
        env.update(dist.interfaces)
    env.update(user_env)
    env.update(lora_env)  # the console's, after the operator's (who may not set it: environment.ENV_DENYLIST)
    env.update(pd_env)  # the role's connector variables, the console's too
    if spec.platform in DEVICE_ENV:  # the device variable always comes from devices
        env[DEVICE_ENV[spec.platform]] = ",".join(map(str, spec.devices))
    return argv, env


def _dp_flags(dist: _Distributed) -> list[str]:
    """The flags of vllm-ascend's multi-node DP tutorial (DeepSeek-R1.md at v0.23.0): every node names the
    whole group, its own share and the head's address and RPC port; the others run headless from
    their first rank (node_rank x size_local)."""
    argv = ["--headless"] if dist.headless else []
    argv += ["--data-parallel-size", str(dist.size), "--data-parallel-size-local", str(dist.size_local)]
    if dist.headless:
        argv += ["--data-parallel-start-rank", str(dist.node_rank * dist.size_local)]
    return argv + ["--data-parallel-address", dist.head_host, "--data-parallel-rpc-port", str(dist.head_port)]


def spec_warnings(spec: LaunchSpec) -> list[str]:
    """Advice that does not block a launch (call after build_command succeeded)."""
    out = []
    if spec.platform == "ascend" and spec.chip_name:
        chip = _chip(spec)
        if _is_310p(spec) and spec.max_model_len is None:
            out.append(
                f"{spec.chip_name}: set max_model_len explicitly (e.g. 16384); vllm-ascend builds a "
                "max_model_len x max_model_len float16 mask on Atlas 300I and can run out of memory"
            )
        if chip.startswith("310") and not chip.startswith("310P"):
            out.append(f"{spec.chip_name}: vllm-ascend supports Atlas 300I (310P) but not the 310")
    if spec.platform == "cpu" and spec.distributed and spec.distributed.get("backend", "ray") == "ray":
        out.append(
            "vllm-cpu has no Ray executor: the Ray cluster starts, then vLLM stops with \"ValueError: "
            "current platform cpu does not support ray.\" (vllm/v1/executor/ray_utils.py, vLLM 0.32)"
        )
    return out


def emittable_flags() -> set[str]:
    """Every vLLM option string build_command can put in argv (for parser checks)."""
    flags = {
        "--model",
        "--served-model-name",
        "--host",
        "--port",
        "--tensor-parallel-size",
        "--pipeline-parallel-size",
        "--distributed-executor-backend",
        "--max-num-seqs",
        "--max-model-len",
        "--gpu-memory-utilization",
        "--dtype",
        "--quantization",
        "--enforce-eager",
        "--trust-remote-code",
        "--headless",
        "--data-parallel-size",
        "--data-parallel-size-local",
        "--data-parallel-start-rank",
        "--data-parallel-address",
        "--data-parallel-rpc-port",
        "--async-scheduling",
        "--no-async-scheduling",
        *ENGINE_CONFIG_FLAGS.values(),
        *LORA_FLAGS,
        PROFILER_FLAG,
    }
    for flag, rule in EXTRA_ARG_RULES.items():
        flags.add(flag)
        if rule.emits_negation:
            flags.add("--no-" + flag[2:])
    return flags
