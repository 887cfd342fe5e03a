"""Each start checks the vLLM command it is about to run against its node's parser now (Node.engine_cli,
which the node's agent records again when the engine under it changes), not only the launch: a flag or
VLLM_* variable that node's vLLM lacks leaves the replica (or the member of a multi-node one) failed, not
started, with the flags, the node and its vLLM release named. The parsers are real recordings
(tests/fixtures/vllm_cli); the processes are the stand-in supervisor's, so no vLLM starts."""

import pytest

from endpoints import reconcile as reconcile_module
from endpoints.models import Endpoint, Replica, ReplicaMember
from endpoints.reconcile import ReplicaWorkload
from endpoints.services import endpoint_restart, endpoint_start
from tests.endpoints.test_engine_cli import V0110, V091
from tests.endpoints.test_multi_node import _node, _say_ray_started, cpu_pair  # noqa: F401 (a fixture)
from tests.endpoints.test_npu_faults import StandInSupervisor
from workers.models import Node
from workers.telemetry import services as telemetry
from workers.telemetry.models import Alert

S = Endpoint.State


@pytest.fixture
def always_ready(monkeypatch):
    monkeypatch.setattr(reconcile_module, "check_ready", lambda replica: (True, "ok"))


def engine_changed(node: Node, cli: dict) -> None:
    """What the node's agent records once it has probed another vLLM (NodeAgent.check_engine_cli)."""
    Node.objects.filter(pk=node.pk).update(engine_cli=cli)


@pytest.mark.django_db
def test_a_restart_on_a_node_whose_vllm_lost_a_flag_is_refused(
    operator, api_for, as_viewer, ascend_node, tiny_artifact, always_ready, settings, tmp_path
):
    settings.DATA_DIR = tmp_path
    engine_changed(ascend_node, V0110)
    response = api_for(operator).post(
        "/api/v1/endpoints",
        {
            "name": "ep",
            "artifact": tiny_artifact.pk,
            "devices": [0],
            "extra_args": {"--async-scheduling": True},
            "env": {"VLLM_LOG_STATS_INTERVAL": "10"},
        },
    )
    assert response.status_code == 201, response.content
    endpoint = Endpoint.objects.get(name="ep")
    supervisor, workload = StandInSupervisor(), ReplicaWorkload()
    workload.reconcile(node=ascend_node, supervisor=supervisor)  # every flag it runs is one of 0.11.0's
    [first] = supervisor.started
    assert "--async-scheduling" in first.argv
    workload.reconcile(node=ascend_node, supervisor=supervisor)
    assert Replica.objects.get().state == S.READY

    # vLLM 0.9.1 installed under the agent (it re-probes and records it); the running replica is left alone
    engine_changed(ascend_node, V091)
    workload.last_health.clear()
    workload.reconcile(node=ascend_node, supervisor=supervisor)
    assert Replica.objects.get().state == S.READY and supervisor.terminated == []

    endpoint_restart(endpoint=endpoint, user=operator)
    workload.reconcile(node=ascend_node, supervisor=supervisor)  # stops it
    workload.reconcile(node=ascend_node, supervisor=supervisor)  # its start is refused
    replica = Replica.objects.get()
    why = (
        "not started: --async-scheduling is not a flag and VLLM_LOG_STATS_INTERVAL is not a variable of "
        "vLLM 0.9.1 on node npu-host (its engine changed since the launch)"
    )
    assert len(supervisor.started) == 1 and not supervisor.running
    assert replica.state == S.FAILED and replica.state_reason.startswith(why)
    assert replica.port is None and replica.pid is None
    event = endpoint.events.get(kind="start-refused")
    assert event.level == "error" and event.message.startswith(why)
    endpoint.refresh_from_db()
    assert endpoint.state == S.FAILED and endpoint.state_reason.startswith(why)
    assert why in as_viewer.get(f"/endpoints/{endpoint.pk}/").content.decode()
    telemetry.evaluate_alerts(notify=False)
    alert = Alert.objects.get(rule__name="Endpoint not ready", subject=f"endpoint:{endpoint.pk}")
    assert alert.state in Alert.OPEN and alert.label == "endpoint ep is failed"
    # Failed: left alone on the next passes (no second event), until an operator's Start or Restart.
    workload.reconcile(node=ascend_node, supervisor=supervisor)
    assert endpoint.events.filter(kind="start-refused").count() == 1 and len(supervisor.started) == 1

    # Its engine back at 0.11.0 and Start pressed: it runs again.
    engine_changed(ascend_node, V0110)
    endpoint_start(endpoint=endpoint, user=operator)
    workload.reconcile(node=ascend_node, supervisor=supervisor)
    assert len(supervisor.started) == 2 and Replica.objects.get().state == S.STARTING


@pytest.mark.django_db
def test_a_headless_rank_is_checked_against_its_own_nodes_vllm(
    operator, api_for, tiny_artifact, always_ready, settings, tmp_path
):
    settings.DATA_DIR = tmp_path
    settings.ENDPOINT_CLUSTER_PORT_RANGE = (6440, 6449)
    head, worker = _node("npu-a", "10.0.0.1", "ascend", devices=2), _node("npu-b", "10.0.0.2", "ascend", devices=2)
    engine_changed(head, V0110)
    engine_changed(worker, V0110)
    response = api_for(operator).post(
        "/api/v1/endpoints",
        {
            "name": "dp",
            "artifact": tiny_artifact.pk,
            "node": "npu-a",
            "distributed": "dp",
            "worker_nodes": ["npu-b"],
            "devices": [0],
        },
    )
    assert response.status_code == 201, response.content
    endpoint = Endpoint.objects.get(name="dp")
    on_head, on_worker = (StandInSupervisor(), ReplicaWorkload()), (StandInSupervisor(), ReplicaWorkload())

    def tick(node, agent):
        agent[1].last_health.clear()
        agent[1].reconcile(node=Node.objects.get(pk=node.pk), supervisor=agent[0])

    tick(head, on_head)  # claims the rendezvous port and starts the server (it waits for its engines itself)
    tick(worker, on_worker)  # the headless rank: 0.11.0 has --headless
    tick(head, on_head)
    member = ReplicaMember.objects.get()
    assert "--headless" in member.argv and member.state == S.STARTING
    assert Replica.objects.get().state == S.READY

    # npu-b's engine is now vLLM 0.9.1, which has no headless ranks; npu-a keeps 0.11.0. The rank dies:
    # its start again is refused on npu-b, and the server that needs it stops and is held failed.
    engine_changed(worker, V091)
    on_worker[0].running.pop(member.pid)
    tick(worker, on_worker)
    ReplicaMember.objects.update(next_start_at=None)
    tick(worker, on_worker)
    member.refresh_from_db()
    why = (
        "not started: --headless, --data-parallel-start-rank are not flags of vLLM 0.9.1 on node npu-b "
        "(its engine changed since the launch)"
    )
    assert member.state == S.FAILED and member.state_reason.startswith(why)
    assert len(on_worker[0].started) == 1
    tick(head, on_head)  # stops the server
    tick(head, on_head)  # holds it failed with the member's reason
    replica = Replica.objects.get()
    assert replica.state == S.FAILED and replica.state_reason.startswith(f"dp-headless: {why}")
    assert not on_head[0].running and len(on_head[0].started) == 1
    endpoint.refresh_from_db()
    assert endpoint.state == S.FAILED and why in endpoint.state_reason
    assert endpoint.events.filter(kind="start-refused", level="error").count() == 2


@pytest.mark.django_db
def test_a_ray_worker_node_is_checked_for_the_specs_flags(
    operator, api_for, cpu_pair, tiny_artifact, settings, tmp_path
):
    """`ray start` has no vLLM flags, but the server's Ray workers run that node's vLLM with the spec's."""
    settings.DATA_DIR = tmp_path
    settings.ENDPOINT_CLUSTER_PORT_RANGE = (6440, 6449)
    head, worker = cpu_pair
    response = api_for(operator).post(
        "/api/v1/endpoints",
        {
            "name": "multi",
            "artifact": tiny_artifact.pk,
            "node": "head",
            "distributed": "ray",
            "worker_nodes": ["worker"],
            "pipeline_parallel_size": 2,
            "extra_args": {"--async-scheduling": True},
        },
    )
    assert response.status_code == 201, response.content
    engine_changed(worker, V091)  # after the launch
    on_head, on_worker = (StandInSupervisor(), ReplicaWorkload()), (StandInSupervisor(), ReplicaWorkload())
    on_head[1].reconcile(node=Node.objects.get(pk=head.pk), supervisor=on_head[0])  # the Ray head starts
    _say_ray_started(ReplicaMember.objects.get(role="ray-head"))
    on_head[1].reconcile(node=Node.objects.get(pk=head.pk), supervisor=on_head[0])  # and is up
    on_worker[1].reconcile(node=Node.objects.get(pk=worker.pk), supervisor=on_worker[0])
    ray_worker = ReplicaMember.objects.get(role="ray-worker")
    why = "not started: --async-scheduling is not a flag of vLLM 0.9.1 on node worker"
    assert ray_worker.state == S.FAILED and ray_worker.state_reason.startswith(why) and not on_worker[0].started
    on_head[1].reconcile(node=Node.objects.get(pk=head.pk), supervisor=on_head[0])
    replica = Replica.objects.get()
    assert replica.state == S.FAILED and replica.state_reason.startswith(f"ray-worker: {why}")
    assert [s.argv[3] for s in on_head[0].started] == ["start"]  # the server never started
    assert Endpoint.objects.get().state == S.FAILED

    # Held failed, the replica needs no Ray cluster: its head stopped in the same pass (the refused worker
    # keeps its reason), and the next pass gives the rendezvous port back.
    assert on_head[0].terminated and replica.cluster_port is not None
    ray_head = ReplicaMember.objects.get(role="ray-head")
    assert not on_head[0].running and ray_head.state == S.STOPPED and ray_head.pid is None
    stopped = Endpoint.objects.get().events.get(kind="member-stopped")
    assert stopped.message.startswith(f"ray-head on head stopped: its replica failed: ray-worker: {why}")
    ray_worker.refresh_from_db()
    assert ray_worker.state == S.FAILED and ray_worker.state_reason.startswith(why)
    on_head[1].reconcile(node=Node.objects.get(pk=head.pk), supervisor=on_head[0])
    on_worker[1].reconcile(node=Node.objects.get(pk=worker.pk), supervisor=on_worker[0])
    assert Replica.objects.get().cluster_port is None and not on_head[0].running and not on_worker[0].started
    assert Replica.objects.get().state == S.FAILED

    # The worker's engine fixed and Start pressed: the cluster comes up again.
    engine_changed(worker, V0110)
    endpoint_start(endpoint=Endpoint.objects.get(), user=operator)
    on_head[1].reconcile(node=Node.objects.get(pk=head.pk), supervisor=on_head[0])
    assert [s.argv[3] for s in on_head[0].started] == ["start", "start"] and len(on_head[0].running) == 1
