"""The allow-list of extra environment variables, and the interface variables of multi-node runs."""
from __future__ import annotations

import re
from typing import Any, Callable, Mapping

from endpoints.commands.checks import CommandSpecError, _check_ifname, _check_ip, _is_int

_MAX_ENV_VALUE_LEN = 4096
_MAX_ENV_KEY_LEN = 128


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

