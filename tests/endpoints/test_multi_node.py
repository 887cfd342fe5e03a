"""Multi-node endpoints (issue 15): the launch request's checks, the replica's members, and the order
the two agents bring a Ray cluster up, restart a dead node and tear it down, driven tick by tick with
the stand-in supervisor (no process starts; tests/e2e/test_multi_node_e2e.py runs them for real). The
one thing a stand-in cannot make is `ray start`'s own "Ray runtime started." line, so the test writes
it where Ray would: the member's log (ray/scripts/scripts.py prints it once the node is in the GCS)."""

from pathlib import Path

import pytest
from django.utils import timezone

from endpoints import reconcile as reconcile_module
from endpoints.commands import CommandSpecError
from endpoints.launch import member_process, replica_process
from endpoints.members import RAY_STARTED
from endpoints.models import Endpoint, Replica, ReplicaMember
from endpoints.reconcile import ReplicaWorkload
from endpoints.services import endpoint_stop
from tests.endpoints.test_npu_faults import StandInSupervisor
from workers.models import Device, Node

S = Endpoint.State


def _node(name, address, platform="cpu", devices=0):
    node = Node.objects.create(
        name=name,
        hostname="one-host",
        address=address,
        platform=platform,
        engine_python="/opt/engine/bin/python",
        last_heartbeat=timezone.now(),
        settings={"interfaces": {"GLOO_SOCKET_IFNAME": "lo"}},
    )
    for index in range(devices):
        Device.objects.create(
            node=node, index=index, kind="npu", name="910B4", memory_total_bytes=64 << 30, health="OK"
        )
    return node


@pytest.fixture
def cpu_pair(db):
    return _node("head", "127.0.0.2"), _node("worker", "127.0.0.3")


def _create(api, **values):
    return api.post("/api/v1/endpoints", {"name": "multi", **values})


@pytest.mark.django_db
def test_launch_request_checks(operator, api_for, cpu_pair, tiny_artifact):
    api = api_for(operator)
    base = {
        "artifact": tiny_artifact.pk,
        "node": "head",
        "distributed": "ray",
        "worker_nodes": ["worker"],
        "pipeline_parallel_size": 2,
    }
    for values, field, message in [
        ({"worker_nodes": []}, "worker_nodes", "Name the other node"),
        ({"worker_nodes": ["nowhere"]}, "worker_nodes", "No node 'nowhere'"),
        ({"worker_nodes": ["worker", "head"]}, "worker_nodes", "listed twice, or is the head node"),
        ({"replicas": 2}, "replicas", "one replica across its nodes"),
        ({"pipeline_parallel_size": 1}, "pipeline_parallel_size", "must split evenly over the 2 nodes"),
        ({"distributed": "mpi"}, "distributed", "Choose one node (blank), ray or dp"),
        ({"distributed": "dp", "pipeline_parallel_size": 1}, "distributed", "No package metadata was found for vllm"),
        ({"distributed": "", "pipeline_parallel_size": 1}, "worker_nodes", "Only a multi-node endpoint"),
        ({"data_parallel_size": 2}, "data_parallel_size", "use distributed dp"),
        (
            {"extra_args": {"--headless": True}},
            "extra_args",
            "--headless: data parallelism is set with data_parallel_size",
        ),
        ({"extra_args": {"data_parallel_rpc_port": 13389}}, "extra_args", "the console gives each node its flags"),
    ]:
        response = _create(api, **{**base, **values})
        assert response.status_code == 400, values
        assert field in response.json()["detail"] and message in response.json()["detail"], response.json()
        assert list(response.json()["errors"]) == [field], response.json()
    assert not Endpoint.objects.exists()

    Node.objects.filter(name="worker").update(platform="ascend")
    response = _create(api, **base)
    assert response.status_code == 400 and "worker: not cpu nodes like head" in response.json()["detail"]
    Node.objects.filter(name="worker").update(platform="cpu")

    body = _create(api, **base).json()
    assert body["distributed"] == "ray" and body["node"] == "head"
    [replica] = body["replicas"]
    assert [(m["rank"], m["node"], m["role"]) for m in replica["members"]] == [
        (0, "head", "ray-head"),
        (1, "worker", "ray-worker"),
    ]


@pytest.mark.django_db
def test_data_parallel_members_and_devices_on_each_node(operator, api_for, tiny_artifact, db):
    api = api_for(operator)
    _node("npu-a", "10.0.0.1", "ascend", devices=8)
    _node("npu-b", "10.0.0.2", "ascend", devices=8)
    base = {
        "artifact": tiny_artifact.pk,
        "node": "npu-a",
        "distributed": "dp",
        "worker_nodes": ["npu-b"],
        "tensor_parallel_size": 2,
        "data_parallel_size": 4,
    }
    response = _create(api, **base, devices=[0, 1])
    assert response.status_code == 400
    assert "TP 2 × PP 1 × 2 per node need 4 devices on npu-a; 2 given." in response.json()["detail"]
    response = _create(api, **{**base, "data_parallel_size": 3, "devices": [0, 1, 2, 3]})
    assert "3 ranks do not split evenly over 2 nodes" in response.json()["detail"]
    body = _create(api, **base, devices=[0, 1, 2, 3]).json()
    assert body["data_parallel_size"] == 4
    assert [(m["rank"], m["node"], m["role"], m["devices"]) for m in body["replicas"][0]["members"]] == [
        (1, "npu-b", "dp-headless", [0, 1, 2, 3])
    ]
    # The devices are held on the worker node too: another endpoint there cannot take them.
    clash = api.post(
        "/api/v1/endpoints",
        {"name": "other", "artifact": tiny_artifact.pk, "node": "npu-b", "devices": [3], "tensor_parallel_size": 1},
    )
    assert clash.status_code == 400 and "In use by another endpoint: 3 (multi)" in clash.json()["detail"]


@pytest.mark.django_db
def test_a_multi_node_replica_runs_on_process_nodes_only(operator, api_for, tiny_artifact, db):
    """Its parts run from each node's engine venv (members are plain processes): a node whose replicas run in
    vllm-ascend's image is refused at launch, and at start if its runtime was changed since."""
    api = api_for(operator)
    _node("npu-a", "10.0.0.1", "ascend", devices=1)
    _node("npu-b", "10.0.0.2", "ascend", devices=1)
    base = {
        "artifact": tiny_artifact.pk,
        "node": "npu-a",
        "distributed": "dp",
        "worker_nodes": ["npu-b"],
        "devices": [0],
    }
    Node.objects.filter(name="npu-b").update(engine_runtime="docker")
    response = _create(api, **base)
    assert response.status_code == 400 and "npu-b run replicas in containers" in response.json()["detail"]
    assert not Endpoint.objects.exists()
    Node.objects.filter(name="npu-b").update(engine_runtime="process")
    assert _create(api, **base).status_code == 201
    Replica.objects.update(cluster_port=6440)  # as the head's agent claims it
    spec, _ = member_process(ReplicaMember.objects.get())
    assert spec.runtime == "process" and not spec.container_name
    assert spec.argv[1:4] == ["-m", "vllm.entrypoints.cli.main", "serve"] and "--headless" in spec.argv

    Node.objects.update(engine_runtime="podman")  # changed on the nodes' pages after the launch
    with pytest.raises(CommandSpecError, match="npu-b runs replicas under podman: set its engine runtime to process"):
        member_process(ReplicaMember.objects.get())
    replica = Replica.objects.select_related("endpoint", "node").get()
    with pytest.raises(CommandSpecError, match="npu-a runs replicas under podman: set its engine runtime to process"):
        replica_process(replica=replica, node=replica.node, port=8000)


@pytest.mark.django_db
def test_a_ray_replica_leaves_the_engine_cache_to_each_host(operator, api_for, cpu_pair, tiny_artifact, monkeypatch):
    """vLLM copies the server's VLLM_* variables to its Ray workers on every node (vllm/v1/executor/ray_executor.py
    get_env_vars_to_copy): a cache root set for the head would have every host compile into the head's folder
    (the root may be shared storage, and an AVX-512 kernel on an AVX2 host dies)."""
    from endpoints.commands.cache import ENGINE_CACHE_ENV
    from endpoints.launch import launch_spec

    for key in ENGINE_CACHE_ENV:
        monkeypatch.delenv(key, raising=False)
    assert (
        _create(
            api_for(operator),
            artifact=tiny_artifact.pk,
            node="head",
            distributed="ray",
            worker_nodes=["worker"],
            pipeline_parallel_size=2,
        ).status_code
        == 201
    )
    Replica.objects.update(cluster_port=6440)  # as the head's agent claims it
    replica = Replica.objects.select_related("endpoint", "node").get()
    assert (
        launch_spec(endpoint=replica.endpoint, replica=replica, node=replica.node, port=8000).engine_cache_dir is None
    )
    process, _ = replica_process(replica=replica, node=replica.node, port=8000)
    assert not set(ENGINE_CACHE_ENV) & set(process.env)
    for member in ReplicaMember.objects.all():  # `ray start` on each node: none either
        assert not set(ENGINE_CACHE_ENV) & set(member_process(member)[0].env), member.role


def _say_ray_started(member: ReplicaMember) -> None:
    Path(member.log_path).parent.mkdir(parents=True, exist_ok=True)
    with open(member.log_path, "a") as log:
        log.write(f"2026-12-03 14:07:47,564\tSUCC scripts.py:950 -- {RAY_STARTED}\n")


@pytest.mark.django_db
def test_two_agents_bring_up_restart_and_tear_down_a_ray_replica(
    operator, api_for, cpu_pair, tiny_artifact, settings, monkeypatch, tmp_path
):
    settings.DATA_DIR = tmp_path
    settings.ENDPOINT_CLUSTER_PORT_RANGE = (6440, 6449)
    monkeypatch.setattr(reconcile_module, "check_ready", lambda replica: (True, "ok"))  # no vLLM behind the stand-in
    head, worker = cpu_pair
    on_head, on_worker = (StandInSupervisor(), ReplicaWorkload()), (StandInSupervisor(), ReplicaWorkload())

    def tick(node, agent):
        agent[1].last_health.clear()  # health is looked at every tick, not every 0.4 s
        agent[1].reconcile(node=node, supervisor=agent[0])

    body = _create(
        api_for(operator),
        artifact=tiny_artifact.pk,
        node="head",
        distributed="ray",
        worker_nodes=["worker"],
        pipeline_parallel_size=2,
    ).json()
    endpoint = Endpoint.objects.get(pk=body["id"])
    member = {m.role: m for m in ReplicaMember.objects.all()}

    def fresh(role):
        return ReplicaMember.objects.get(pk=member[role].pk)

    tick(worker, on_worker)  # nothing to join yet
    assert fresh("ray-worker").state == S.PENDING and "claim the replica's port" in fresh("ray-worker").state_reason
    tick(head, on_head)  # the head claims the cluster port and starts `ray start --head` on it
    replica = Replica.objects.get()
    assert 6440 <= replica.cluster_port <= 6449 and replica.pid is None
    assert replica.state_reason.startswith("waiting for the Ray cluster: 0 of 2 nodes up")
    [ray_head] = on_head[0].started
    assert ray_head.argv[1:] == [
        "-m",
        "ray.scripts.scripts",
        "start",
        "--head",
        f"--port={replica.cluster_port}",
        "--node-ip-address=127.0.0.2",
        "--block",
    ]
    assert ray_head.env["GLOO_SOCKET_IFNAME"] == "lo" and "SECRET_KEY" not in ray_head.env
    assert ray_head.runtime == "process"  # members are plain processes, whatever the node's engine runtime
    tick(worker, on_worker)
    assert fresh("ray-worker").state_reason == "waiting for the Ray head on node head"

    _say_ray_started(fresh("ray-head"))
    tick(head, on_head)
    assert fresh("ray-head").state == S.READY and Replica.objects.get().pid is None  # one node is no cluster
    tick(worker, on_worker)
    [ray_worker] = on_worker[0].started
    assert ray_worker.argv[4:] == [
        f"--address=127.0.0.2:{replica.cluster_port}",
        "--node-ip-address=127.0.0.3",
        "--block",
    ]
    _say_ray_started(fresh("ray-worker"))
    tick(worker, on_worker)
    tick(head, on_head)  # the cluster is whole: the server starts over it
    server = on_head[0].started[-1]
    assert server.argv[server.argv.index("--distributed-executor-backend") + 1] == "ray"
    assert server.env["RAY_ADDRESS"] == f"127.0.0.2:{replica.cluster_port}"
    assert server.runtime == "process" and Replica.objects.get().runtime == "process"
    tick(head, on_head)
    endpoint.refresh_from_db()
    assert endpoint.state == S.READY

    # The worker's Ray node dies: the endpoint is degraded, the node restarts, the server with it.
    on_worker[0].running.pop(fresh("ray-worker").pid)
    tick(worker, on_worker)
    endpoint.refresh_from_db()
    assert fresh("ray-worker").state == S.RESTARTING and endpoint.state == S.DEGRADED
    assert endpoint.state_reason.startswith("ray-worker on node worker: crashed")
    assert Replica.objects.get().restart_requested
    tick(head, on_head)  # the server's Ray workers were on that node: it stops, and waits for the cluster
    assert Replica.objects.get().state == S.RESTARTING and len(on_head[0].terminated) == 1
    Replica.objects.update(next_start_at=None)
    ReplicaMember.objects.filter(role="ray-worker").update(next_start_at=None)
    tick(worker, on_worker)
    _say_ray_started(fresh("ray-worker"))
    tick(worker, on_worker)
    tick(head, on_head)
    tick(head, on_head)
    endpoint.refresh_from_db()
    assert endpoint.state == S.READY and fresh("ray-worker").restarts == 1 and Replica.objects.get().restarts == 1
    kinds = list(endpoint.events.values_list("kind", flat=True))
    assert "member-crashed" in kinds and kinds.count("member-ready") == 3

    # Stop: each agent stops its own part; the cluster port is given back once no member runs.
    endpoint_stop(endpoint=endpoint, user=operator)
    tick(head, on_head)
    tick(worker, on_worker)
    tick(head, on_head)
    endpoint.refresh_from_db()
    assert endpoint.state == S.STOPPED
    assert not on_head[0].running and not on_worker[0].running
    assert Replica.objects.get().cluster_port is None
    assert set(ReplicaMember.objects.values_list("state", flat=True)) == {S.STOPPED}


@pytest.mark.django_db
def test_a_node_that_was_up_comes_back_a_failed_start_gives_up(
    operator, api_for, cpu_pair, tiny_artifact, settings, tmp_path
):
    settings.DATA_DIR = tmp_path
    settings.ENDPOINT_CLUSTER_PORT_RANGE = (6440, 6449)
    settings.ENDPOINT_MAX_CRASHES = 1
    head, _ = cpu_pair
    supervisor, workload = StandInSupervisor(), ReplicaWorkload()
    _create(
        api_for(operator),
        artifact=tiny_artifact.pk,
        node="head",
        distributed="ray",
        worker_nodes=["worker"],
        pipeline_parallel_size=2,
    )
    workload.reconcile(node=head, supervisor=supervisor)
    ray_head = ReplicaMember.objects.get(role="ray-head")
    assert ray_head.state == S.STARTING
    supervisor.running.pop(ray_head.pid)  # dies before it is up: a failed start
    workload.reconcile(node=head, supervisor=supervisor)
    ray_head.refresh_from_db()
    assert ray_head.state == S.FAILED and ray_head.state_reason.startswith("gave up after 1 crashes in a row")
    assert Endpoint.objects.get().state == S.DEGRADED

    ReplicaMember.objects.filter(pk=ray_head.pk).update(state=S.PENDING, crashes_in_a_row=0)  # as Start does
    workload.reconcile(node=head, supervisor=supervisor)
    _say_ray_started(ReplicaMember.objects.get(pk=ray_head.pk))
    workload.reconcile(node=head, supervisor=supervisor)
    ray_head.refresh_from_db()
    assert ray_head.state == S.READY
    supervisor.running.pop(ray_head.pid)  # dies after it was up: always started again
    workload.reconcile(node=head, supervisor=supervisor)
    ray_head.refresh_from_db()
    assert ray_head.state == S.RESTARTING and ray_head.crashes_in_a_row == 0


def test_node_interfaces_setting(monkeypatch):
    from django.core.exceptions import ImproperlyConfigured

    from console.env import env_pairs

    monkeypatch.setenv("NODE_INTERFACES", "HCCL_IF_IP=10.0.0.5, GLOO_SOCKET_IFNAME=enp189s0f0")
    assert env_pairs("NODE_INTERFACES") == {"HCCL_IF_IP": "10.0.0.5", "GLOO_SOCKET_IFNAME": "enp189s0f0"}
    monkeypatch.setenv("NODE_INTERFACES", "eth0")
    with pytest.raises(ImproperlyConfigured, match="'eth0' is not NAME=VALUE"):
        env_pairs("NODE_INTERFACES")


@pytest.mark.django_db
def test_a_member_started_for_an_endpoint_deleted_meanwhile_is_stopped(
    operator, api_for, cpu_pair, tiny_artifact, settings, tmp_path, caplog
):
    """`ray start --head` ran on, unowned, when its endpoint was deleted during the start (its row gone)."""
    settings.DATA_DIR = tmp_path
    settings.ENDPOINT_CLUSTER_PORT_RANGE = (6440, 6449)
    head, _ = cpu_pair

    class DeletedMeanwhile(StandInSupervisor):
        def start(self, spec):
            Endpoint.objects.all().delete()  # the web's Delete, during the start
            return super().start(spec)

    _create(
        api_for(operator),
        artifact=tiny_artifact.pk,
        node="head",
        distributed="ray",
        worker_nodes=["worker"],
        pipeline_parallel_size=2,
    )
    supervisor = DeletedMeanwhile()
    ReplicaWorkload().reconcile(node=head, supervisor=supervisor)
    assert len(supervisor.started) == 1 and supervisor.terminated == [supervisor.next_pid] and not supervisor.running
    assert not ReplicaMember.objects.exists() and "its row was deleted while it started" in caplog.text


@pytest.mark.django_db
def test_a_multi_node_launch_whose_nodes_recorded_no_interfaces_warns_before_it_starts(
    operator, api_for, tiny_artifact
):
    """The preview's check and the endpoint's first events name the nodes with no interface variables recorded
    (NODE_INTERFACES); a one-node launch and a group whose nodes recorded theirs say nothing of it."""
    from endpoints.models import EndpointEvent

    api = api_for(operator)
    _node("npu-a", "10.0.0.1", "ascend", devices=8)
    bare = _node("npu-b", "10.0.0.2", "ascend", devices=8)
    Node.objects.filter(pk=bare.pk).update(settings={})
    body = {
        "artifact": tiny_artifact.pk,
        "node": "npu-a",
        "distributed": "dp",
        "worker_nodes": ["npu-b"],
        "tensor_parallel_size": 2,
        "data_parallel_size": 4,
        "devices": [0, 1, 2, 3],
    }
    preview = api.post("/api/v1/endpoints/preview", {"name": "multi", **body}).json()
    warned = [c for n in preview["nodes"] for c in n["checks"] if c["name"] == "interfaces"]
    assert [c["level"] for c in warned] == ["warning"] and "npu-b" in warned[0]["message"]
    made = _create(api, **body).json()
    events = EndpointEvent.objects.filter(endpoint_id=made["id"], level="warning")
    assert [e.message.split(" recorded")[0] for e in events] == ["npu-b"]
    one = api.post(
        "/api/v1/endpoints", {"name": "single", "artifact": tiny_artifact.pk, "node": "npu-b", "devices": [4]}
    ).json()
    assert not EndpointEvent.objects.filter(endpoint_id=one["id"], level="warning").exists()
