"""``ray start`` commands for the head and worker nodes of a multi-node (Ray) endpoint."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from endpoints.commands.checks import (
    CommandSpecError,
    _check_engine_python,
    _check_ip,
    _check_port,
    _is_int,
    _split_host_port,
    _strict_int,
)
from endpoints.commands.environment import _validate_interfaces, validate_env
from endpoints.commands.platforms import _ASCEND_DEFAULT_ENV, DEVICE_ENV, PLATFORMS, RAY_MODULE, _platform_env


def _ray_env(platform: str, devices, interfaces, env) -> dict[str, str]:
    if platform not in PLATFORMS:
        raise CommandSpecError(f"platform must be one of {', '.join(PLATFORMS)}, got {platform!r}")
    devices = list(devices or [])
    if not all(_is_int(x) and 0 <= x < 1024 for x in devices) or len(set(devices)) != len(devices):
        raise CommandSpecError(f"devices must be a list of distinct device ids, got {devices!r}")
    if platform == "cpu" and devices:
        raise CommandSpecError("devices must be empty on cpu")
    out = _platform_env(platform, devices) if devices else (dict(_ASCEND_DEFAULT_ENV) if platform == "ascend" else {})
    # No usage report from the cluster's nodes (vLLM sets the same for the Ray it starts: ray_utils.py).
    out["RAY_USAGE_STATS_ENABLED"] = "0"
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
        args.append(f'--resources={{"NPU": {n}}}')
    return args


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
    argv = [engine_python, "-m", RAY_MODULE, "start", "--head", f"--port={port}", f"--node-ip-address={node_ip}"]
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
    argv = [engine_python, "-m", RAY_MODULE, "start", f"--address={head_address}", f"--node-ip-address={node_ip}"]
    argv += _ray_resources(platform, num_gpus, num_npus)
    if block:
        argv.append("--block")
    return argv, run_env
