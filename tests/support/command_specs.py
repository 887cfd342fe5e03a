"""Helpers shared by the command-builder tests: a LaunchSpec with the quick start's values."""

from endpoints.commands import LaunchSpec

PY = "/opt/engines/vllm-ascend/bin/python"
ASCEND_DEFAULTS = {
    "PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True",
    "OMP_NUM_THREADS": "1",
    "HCCL_BUFFSIZE": "1024",
}

#: A two-node Ray deployment (the head's side), as vllm-ascend's Ray tutorial sets it up.
DIST = {
    "backend": "ray",
    "head_address": "10.0.0.1:6379",
    "nnodes": 2,
    "node_rank": 0,
    "interfaces": {
        "HCCL_IF_IP": "10.0.0.1",
        "HCCL_SOCKET_IFNAME": "enp189s0f0",
        "GLOO_SOCKET_IFNAME": "enp189s0f0",
        "TP_SOCKET_IFNAME": "enp189s0f0",
    },
}


#: The head's side of vllm-ascend's two-node data-parallel deployment (DeepSeek-R1.md at v0.23.0: DP 4,
#: 2 ranks per node, TP 4, RPC port 13389; tests/fixtures/ascend/multi_node_dp_deepseek_r1.md).
DP = {
    "backend": "dp",
    "head_address": "10.0.0.1:13389",
    "nnodes": 2,
    "node_rank": 0,
    "size": 4,
    "size_local": 2,
    "interfaces": {
        "HCCL_IF_IP": "10.0.0.1",
        "GLOO_SOCKET_IFNAME": "enp189s0f0",
        "TP_SOCKET_IFNAME": "enp189s0f0",
        "HCCL_SOCKET_IFNAME": "enp189s0f0",
    },
}


def spec(**kw):
    base = {
        "platform": "ascend",
        "engine_python": PY,
        "model_path": "Qwen/Qwen2.5-7B-Instruct",
        "served_model_name": "Qwen/Qwen2.5-7B-Instruct",
        "port": 8000,
        "devices": [0],
    }
    base.update(kw)
    return LaunchSpec(**base)


def head(argv):
    return [argv[0], argv[1], argv[2]]


def flag_value(argv, flag):
    i = argv.index(flag)
    return argv[i + 1]
