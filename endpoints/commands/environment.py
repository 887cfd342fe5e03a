"""The allow-list of extra environment variables, and the interface variables of multi-node runs."""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Mapping
from typing import Any

from endpoints.commands.checks import CommandSpecError, _as_int, _check_ifname, _check_ip, _is_int

_MAX_ENV_VALUE_LEN = 4096
_MAX_ENV_KEY_LEN = 128


def _int_in(lo: int, hi: int) -> Callable[[str, str], str]:
    def check(value: str, key: str) -> str:
        return str(_as_int(value, key, lo, hi))

    return check


def _one_of(*choices: str) -> Callable[[str, str], str]:
    def check(value: str, key: str) -> str:
        if value not in choices:
            raise CommandSpecError(f"{key} must be one of {', '.join(choices)}, got {value!r}")
        return value

    return check


def _pattern(regex: str, what: str) -> Callable[[str, str], str]:
    compiled = re.compile(regex)

    def check(value: str, key: str) -> str:
        if not compiled.fullmatch(value):
            raise CommandSpecError(f"{key} must be {what}, got {value!r}")
        return value

    return check


_flag = _one_of("0", "1", "true", "false", "True", "False")
_device_list = _pattern(r"\d{1,3}(,\d{1,3})*", "a list of device numbers like 0,1")
# An allocator or affinity setting: options separated by , : = and |, no paths or shell.
_options = _pattern(r"[A-Za-z0-9_.,:=|\- ]{1,256}", "a list of options like expandable_segments:True")
_cpu_range_text = _pattern(
    r"(auto|nobind|all|\d{1,4}(-\d{1,4})?([,|]\d{1,4}(-\d{1,4})?)*)", "CPU ranges like 0-7 or auto"
)


def _cpu_ranges(value: str, key: str) -> str:
    """vLLM's CPU lists (vllm/utils/cpu_resource_utils.py parse_id_list reads "a-b" as range(a, b + 1)): a
    range that runs backwards names no CPU, so it is refused rather than bound to nothing."""
    _cpu_range_text(value, key)
    for low, high in re.findall(r"(\d+)-(\d+)", value):
        if int(low) > int(high):
            raise CommandSpecError(f"{key} has the range {low}-{high}, which runs backwards; got {value!r}")
    return value


_log_level = _one_of("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

#: Every variable an operator may set, each with its validator (value text -> accepted text).
#: An explicit list (issue 19, finding 6): a prefix rule let paths, URLs and tracing hooks of
#: vLLM and CANN through (VLLM_TUNED_CONFIG_FOLDER, VLLM_USAGE_STATS_SERVER, VLLM_TRACE_FUNCTION).
ENV_VARIABLES: dict[str, Callable[[str, str], str]] = {
    # vLLM
    "VLLM_CPU_KVCACHE_SPACE": _int_in(0, 4096),  # GiB; the console sets it on CPU nodes
    "VLLM_CPU_OMP_THREADS_BIND": _cpu_ranges,
    "VLLM_CPU_NUM_OF_RESERVED_CPU": _int_in(0, 1024),
    "VLLM_LOGGING_LEVEL": _log_level,
    "VLLM_USE_MODELSCOPE": _flag,
    "VLLM_HOST_IP": _check_ip,
    "VLLM_WORKER_MULTIPROC_METHOD": _one_of("spawn", "fork"),
    "VLLM_ENGINE_ITERATION_TIMEOUT_S": _int_in(1, 86400),
    "VLLM_RPC_TIMEOUT": _int_in(1, 86_400_000),
    "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": _int_in(1, 3600),
    "VLLM_LOG_STATS_INTERVAL": _int_in(1, 3600),
    "VLLM_ALLOW_LONG_MAX_MODEL_LEN": _flag,
    "VLLM_NO_USAGE_STATS": _flag,
    "VLLM_DO_NOT_TRACK": _flag,
    "VLLM_USE_V1": _flag,
    "VLLM_ENABLE_V1_MULTIPROCESSING": _flag,
    # vllm-ascend's own (vllm_ascend/envs.py at v0.23.0, read with bool(int(...)) or int(...); the tutorials
    # export the first two, which envs.py marks deprecated in favour of --additional-config keys)
    "VLLM_ASCEND_BALANCE_SCHEDULING": _one_of("0", "1"),
    "VLLM_ASCEND_ENABLE_FLASHCOMM1": _one_of("0", "1"),
    "VLLM_ASCEND_ENABLE_MLAPO": _one_of("0", "1"),
    "VLLM_ASCEND_ENABLE_MATMUL_ALLREDUCE": _one_of("0", "1"),
    "VLLM_ASCEND_ENABLE_BATCH_MEMCPY": _one_of("0", "1"),
    "VLLM_ASCEND_ENABLE_FUSED_MC2": _int_in(0, 2),
    "VLLM_ASCEND_ENABLE_NZ": _int_in(0, 2),
    "VLLM_ASCEND_FLASHCOMM2_PARALLEL_SIZE": _int_in(0, 1024),
    # CANN, HCCL (vllm-ascend's documentation)
    "ASCEND_RT_VISIBLE_DEVICES": _device_list,  # accepted, but always replaced by LaunchSpec.devices
    "ASCEND_LAUNCH_BLOCKING": _flag,
    "ASCEND_GLOBAL_LOG_LEVEL": _int_in(0, 4),
    "ASCEND_SLOG_PRINT_TO_STDOUT": _flag,
    "HCCL_BUFFSIZE": _int_in(1, 65536),  # MB; the console sets 1024 on Ascend nodes
    "HCCL_CONNECT_TIMEOUT": _int_in(1, 7200),
    "HCCL_EXEC_TIMEOUT": _int_in(0, 17340),
    "HCCL_OP_EXPANSION_MODE": _one_of("AI_CPU", "AIV", "HOST"),
    "HCCL_INTRA_PCIE_ENABLE": _flag,
    "HCCL_INTRA_ROCE_ENABLE": _flag,
    "HCCL_DETERMINISTIC": _flag,
    "HCCL_IF_IP": _check_ip,
    "HCCL_SOCKET_IFNAME": _check_ifname,
    "PYTORCH_NPU_ALLOC_CONF": _options,
    "TASK_QUEUE_ENABLE": _int_in(0, 2),
    "CPU_AFFINITY_CONF": _options,
    "USING_LCCL_COM": _flag,
    # CPU threads, CUDA, NCCL, Ray, Hugging Face
    "OMP_NUM_THREADS": _int_in(1, 4096),
    "OMP_PROC_BIND": _one_of("false", "true", "close", "spread", "master", "primary"),
    "PYTORCH_CUDA_ALLOC_CONF": _options,
    "GLOO_SOCKET_IFNAME": _check_ifname,
    "TP_SOCKET_IFNAME": _check_ifname,
    "NCCL_SOCKET_IFNAME": _check_ifname,
    "NCCL_DEBUG": _one_of("VERSION", "WARN", "INFO", "TRACE"),
    "NCCL_IB_DISABLE": _flag,
    "NCCL_P2P_DISABLE": _flag,
    "CUDA_DEVICE_MAX_CONNECTIONS": _int_in(1, 32),
    "CUDA_VISIBLE_DEVICES": _device_list,  # likewise replaced by LaunchSpec.devices
    "RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES": _flag,
    "RAY_DEDUP_LOGS": _flag,
    "TOKENIZERS_PARALLELISM": _flag,
    "HF_HUB_OFFLINE": _flag,
    "TRANSFORMERS_OFFLINE": _flag,
}
#: The names alone.
ENV_ALLOWLIST = frozenset(ENV_VARIABLES)
#: Names refused with a reason: they load code or configuration from a path, switch off safety
#: checks, or open development endpoints (every other unlisted name is refused too).
ENV_DENYLIST = frozenset(
    {
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
        "VLLM_TUNED_CONFIG_FOLDER",
        "VLLM_USAGE_STATS_SERVER",
        "VLLM_TRACE_FUNCTION",
        "ASCEND_CUSTOM_OPP_PATH",
        "ASCEND_OPP_PATH",
        "ASCEND_AICPU_PATH",
        "ASCEND_HOME_PATH",
        "ASCEND_TOOLKIT_HOME",
        "ASCEND_PROCESS_LOG_PATH",
        "ASCEND_CACHE_PATH",
        "ASCEND_WORK_PATH",
        # The engine cache's (endpoints.commands.cache): the console sets them, to the node's own directory.
        "TORCHINDUCTOR_CACHE_DIR",
        "TRITON_CACHE_DIR",
    }
)
_ENV_KEY_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _env_key_refusal(key: str) -> str | None:
    if key in ENV_VARIABLES:
        return None
    if key in ENV_DENYLIST:
        return f"{key} is not an allowed environment variable (it can load code, read paths or open unsafe features)"
    return f"{key} is not an allowed environment variable; allowed: {', '.join(sorted(ENV_VARIABLES))}"


def validate_env(d: Mapping[str, Any] | None) -> dict[str, str]:
    """Validate user environment additions; return them as ``{str: str}``.

    Keys must be in :data:`ENV_VARIABLES`, whose validator then checks the value. Values: str,
    int or float; printable, no NUL or newline, at most 4096 characters.
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
        out[key] = ENV_VARIABLES[key](value, key)
    return out


#: The variables vLLM itself reads (vllm/envs.py: environment_variables) start with this; only these
#: can be checked against a node's vLLM. CANN, HCCL, NCCL, Ray and Hugging Face ones are not vLLM's.
VLLM_ENV_PREFIX = "VLLM_"


#: vllm-ascend's own variables (vllm_ascend/envs.py), not vLLM's: checked against the plugin's names where a node's
#: probe reported them (Node.engine_cli["ascend_env"]), never against vllm/envs.py.
VLLM_ASCEND_ENV_PREFIX = "VLLM_ASCEND_"


def env_unknown_to(
    keys: Collection[str], known: Collection[str], ascend_known: Collection[str] | None = None
) -> list[str]:
    """The ``VLLM_*`` names among ``keys`` that a vLLM, given by its envs.py names, does not read; ``VLLM_ASCEND_*``
    names against vllm-ascend's envs.py names where those are known (``ascend_known``)."""
    known = set(known)
    ascend = set(ascend_known) if ascend_known is not None else None
    unknown = []
    for key in keys:
        if key.startswith(VLLM_ASCEND_ENV_PREFIX):
            if ascend is not None and key not in ascend:
                unknown.append(key)
        elif key.startswith(VLLM_ENV_PREFIX) and key not in known:
            unknown.append(key)
    return unknown


#: Interface variables a multi-node spec may set, with their checks and platforms.
INTERFACE_ENV_KEYS: dict[str, tuple[Callable[[Any, str], str], tuple[str, ...]]] = {
    "HCCL_IF_IP": (_check_ip, ("ascend",)),
    "HCCL_SOCKET_IFNAME": (_check_ifname, ("ascend",)),
    "GLOO_SOCKET_IFNAME": (_check_ifname, ("ascend", "cuda", "cpu")),  # gloo carries CPU collectives too
    "TP_SOCKET_IFNAME": (_check_ifname, ("ascend", "cuda", "cpu")),
    "NCCL_SOCKET_IFNAME": (_check_ifname, ("cuda",)),
    "VLLM_HOST_IP": (_check_ip, ("ascend", "cuda", "cpu")),
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
                f"{key!r} is not an allowed interface variable; allowed: {', '.join(INTERFACE_ENV_KEYS)}"
            )
        check, platforms = entry
        if platform not in platforms:
            raise CommandSpecError(f"{key} does not apply to platform {platform!r}")
        out[key] = check(value, key)
    return out
