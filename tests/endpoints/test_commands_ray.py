"""Tests for endpoints.commands' multi-node (Ray) commands and the shell rendering.

Plain pytest, no database. The Ray commands follow vllm-ascend's tutorial
(docs/source/tutorials/features/ray.md): env before ``ray start --head`` /
``ray start --address='{head_node_ip}:6379' --node-ip-address={local_ip}``, then
``vllm serve ... --distributed-executor-backend ray --pipeline-parallel-size 2 --tensor-parallel-size 8``.
"""

import json
import shlex

import pytest

from endpoints.commands import CommandSpecError, build_command, format_for_shell, ray_head_command, ray_worker_command
from tests.support.command_specs import ASCEND_DEFAULTS, DIST, PY, flag_value, spec

# ------------------------------------------------------------------ multi-node (ray)


def test_distributed_ascend_ray_serve_command():
    argv, env = build_command(
        spec(
            model_path="Qwen/Qwen3-235B-A22B",
            served_model_name="qwen",
            devices=list(range(8)),
            tensor_parallel_size=8,
            pipeline_parallel_size=2,
            max_model_len=8192,
            max_num_seqs=25,
            gpu_memory_utilization=0.9,
            trust_remote_code=True,
            distributed=DIST,
            extra_args={"--enable-expert-parallel": True, "--seed": 1024},
        )
    )
    assert argv[3:] == [
        "--model",
        "Qwen/Qwen3-235B-A22B",
        "--served-model-name",
        "qwen",
        "--host",
        "127.0.0.1",
        "--port",
        "8000",
        "--tensor-parallel-size",
        "8",
        "--pipeline-parallel-size",
        "2",
        "--distributed-executor-backend",
        "ray",
        "--max-num-seqs",
        "25",
        "--max-model-len",
        "8192",
        "--gpu-memory-utilization",
        "0.9",
        "--trust-remote-code",
        "--enable-expert-parallel",
        "--seed",
        "1024",
    ]
    assert env == {
        "ASCEND_RT_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7",
        **ASCEND_DEFAULTS,
        "RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES": "1",
        "RAY_ADDRESS": "10.0.0.1:6379",
        "HCCL_IF_IP": "10.0.0.1",
        "HCCL_SOCKET_IFNAME": "enp189s0f0",
        "GLOO_SOCKET_IFNAME": "enp189s0f0",
        "TP_SOCKET_IFNAME": "enp189s0f0",
    }
    # pure tensor parallelism over both nodes works too
    argv, _ = build_command(spec(devices=list(range(8)), tensor_parallel_size=16, distributed=DIST))
    assert flag_value(argv, "--tensor-parallel-size") == "16"


def test_distributed_refusals():
    with pytest.raises(CommandSpecError, match=r"8 device\(s\).* x 2 nodes = 16"):
        build_command(spec(devices=list(range(8)), tensor_parallel_size=8, distributed=DIST))
    with pytest.raises(CommandSpecError, match="head node only"):
        build_command(spec(devices=[0], tensor_parallel_size=2, distributed={**DIST, "node_rank": 1}))
    with pytest.raises(CommandSpecError, match="node_rank must be an integer in 0..1"):
        build_command(spec(devices=[0], tensor_parallel_size=2, distributed={**DIST, "node_rank": 2}))
    with pytest.raises(CommandSpecError, match="backend must be 'ray' or 'dp'"):
        build_command(spec(devices=[0], tensor_parallel_size=2, distributed={**DIST, "backend": "mp"}))
    with pytest.raises(CommandSpecError, match="head_address must be 'host:port'"):
        build_command(spec(devices=[0], tensor_parallel_size=2, distributed={**DIST, "head_address": "10.0.0.1"}))
    with pytest.raises(CommandSpecError, match="not an allowed interface variable"):
        build_command(
            spec(devices=[0], tensor_parallel_size=2, distributed={**DIST, "interfaces": {"LD_PRELOAD": "x"}})
        )
    with pytest.raises(CommandSpecError, match="HCCL_IF_IP must be an IP address"):
        build_command(
            spec(devices=[0], tensor_parallel_size=2, distributed={**DIST, "interfaces": {"HCCL_IF_IP": "eth0"}})
        )
    with pytest.raises(CommandSpecError, match="network interface name"):
        build_command(
            spec(
                devices=[0],
                tensor_parallel_size=2,
                distributed={**DIST, "interfaces": {"GLOO_SOCKET_IFNAME": "eth0; reboot"}},
            )
        )
    with pytest.raises(CommandSpecError, match="does not apply to platform 'cuda'"):
        build_command(spec(platform="cuda", devices=[0], tensor_parallel_size=2, distributed=DIST))
    with pytest.raises(CommandSpecError, match="HCCL_IF_IP does not apply to platform 'cpu'"):
        build_command(spec(platform="cpu", devices=[], distributed=DIST))
    with pytest.raises(CommandSpecError, match="unknown keys"):
        build_command(spec(devices=[0], tensor_parallel_size=2, distributed={**DIST, "extra": 1}))


def test_distributed_cuda():
    dist = {
        "backend": "ray",
        "head_address": "gpu-head.internal:6379",
        "nnodes": 2,
        "interfaces": {"NCCL_SOCKET_IFNAME": "ib0", "GLOO_SOCKET_IFNAME": "ib0"},
    }
    argv, env = build_command(
        spec(platform="cuda", devices=[0, 1], tensor_parallel_size=2, pipeline_parallel_size=2, distributed=dist)
    )
    assert flag_value(argv, "--distributed-executor-backend") == "ray"
    assert env == {
        "CUDA_VISIBLE_DEVICES": "0,1",
        "RAY_ADDRESS": "gpu-head.internal:6379",
        "NCCL_SOCKET_IFNAME": "ib0",
        "GLOO_SOCKET_IFNAME": "ib0",
    }


def test_ray_head_command_ascend():
    argv, env = ray_head_command(
        PY,
        node_ip="10.0.0.1",
        devices=list(range(8)),
        interfaces={"HCCL_IF_IP": "10.0.0.1", "GLOO_SOCKET_IFNAME": "enp189s0f0", "TP_SOCKET_IFNAME": "enp189s0f0"},
    )
    assert argv == [
        PY,
        "-m",
        "ray.scripts.scripts",
        "start",
        "--head",
        "--port=6379",
        "--node-ip-address=10.0.0.1",
        "--block",
    ]
    assert env == {
        "ASCEND_RT_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7",
        **ASCEND_DEFAULTS,
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES": "1",
        "HCCL_IF_IP": "10.0.0.1",
        "GLOO_SOCKET_IFNAME": "enp189s0f0",
        "TP_SOCKET_IFNAME": "enp189s0f0",
    }
    argv, _ = ray_head_command(PY, node_ip="10.0.0.1", port=6380, num_npus=8, block=False)
    assert argv[4:] == ["--head", "--port=6380", "--node-ip-address=10.0.0.1", '--resources={"NPU": 8}']
    assert json.loads(argv[-1].split("=", 1)[1]) == {"NPU": 8}


def test_ray_worker_command():
    argv, env = ray_worker_command(
        PY,
        head_address="10.0.0.1:6379",
        node_ip="10.0.0.2",
        devices=[0, 1, 2, 3, 4, 5, 6, 7],
        interfaces={"HCCL_IF_IP": "10.0.0.2"},
        env={"HCCL_CONNECT_TIMEOUT": "1800"},
    )
    assert argv == [
        PY,
        "-m",
        "ray.scripts.scripts",
        "start",
        "--address=10.0.0.1:6379",
        "--node-ip-address=10.0.0.2",
        "--block",
    ]
    assert env["HCCL_IF_IP"] == "10.0.0.2"
    assert env["HCCL_CONNECT_TIMEOUT"] == "1800"
    assert env["RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES"] == "1"
    argv, env = ray_worker_command(
        "/opt/vllm/bin/python",
        head_address="10.0.0.1:6379",
        node_ip="10.0.0.3",
        platform="cuda",
        devices=[0, 1],
        num_gpus=2,
    )
    assert argv[-2:] == ["--num-gpus=2", "--block"]
    assert env == {"CUDA_VISIBLE_DEVICES": "0,1", "RAY_USAGE_STATS_ENABLED": "0"}


def test_ray_command_refusals():
    with pytest.raises(CommandSpecError, match="node_ip must be an IP address"):
        ray_head_command(PY, node_ip="head; reboot")
    with pytest.raises(CommandSpecError, match="port must be"):
        ray_head_command(PY, node_ip="10.0.0.1", port=70000)
    with pytest.raises(CommandSpecError, match="num_gpus applies to cuda"):
        ray_head_command(PY, node_ip="10.0.0.1", num_gpus=8)
    with pytest.raises(CommandSpecError, match="head_address must be 'host:port'"):
        ray_worker_command(PY, head_address="--evil", node_ip="10.0.0.2")
    with pytest.raises(CommandSpecError, match="absolute path"):
        ray_worker_command("ray", head_address="10.0.0.1:6379", node_ip="10.0.0.2")
    with pytest.raises(CommandSpecError, match="PATH is not an allowed"):
        ray_worker_command(PY, head_address="10.0.0.1:6379", node_ip="10.0.0.2", env={"PATH": "/tmp"})
    with pytest.raises(CommandSpecError, match="platform must be one of"):
        ray_head_command(PY, node_ip="10.0.0.1", platform="tpu")


# ------------------------------------------------------------------ format_for_shell


def test_format_for_shell_round_trips():
    argv, env = build_command(
        spec(model_path="/models/My Model's \"dir\" $HOME `x`", devices=[0, 1], tensor_parallel_size=2)
    )
    env = {**env, "VLLM_X": "a b;c|d&e$(f)"}  # a value no allow-listed variable takes: quoting alone
    text = format_for_shell(argv, env)
    tokens = shlex.split(text)
    assert tokens == [f"{k}={v}" for k, v in env.items()] + argv
    assert text.startswith("ASCEND_RT_VISIBLE_DEVICES=0,1 ")
    assert f" {PY} -m vllm.entrypoints.openai.api_server --model " in text


def test_format_for_shell_redacts_secrets():
    text = format_for_shell(["/x/python", "-m", "m"], {"HCCL_TOKEN_THING": "s3cret", "VLLM_X": "1"})
    assert "s3cret" not in text and "HCCL_TOKEN_THING='***'" in text
    assert "s3cret" in format_for_shell(["/x/python"], {"HCCL_TOKEN_THING": "s3cret"}, redact=False)
    assert format_for_shell(["/x/python", "-m", "m"]) == "/x/python -m m"
