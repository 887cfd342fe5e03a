"""NPU faults on the worker node of a multi-node replica (issue 15): the fake npu-smi replays the real
healthy 8 × 910B4 sample for both nodes, then the same sample with one chip of the worker node changed.
Both agents' telemetry and reconcile passes are driven directly; the processes are stand-ins."""

import pytest
from django.utils import timezone

from endpoints.models import Endpoint, Replica, ReplicaMember
from endpoints.reconcile import ReplicaWorkload
from tests.endpoints.test_npu_faults import (  # noqa: F401 (fixtures)
    HEALTHY,
    StandInSupervisor,
    always_ready,
    health_alert,
    npu_smi,
    routed,
)
from tests.support.npu_smi import fixture, with_health
from workers.models import Device, Node
from workers.telemetry import collect, services
from workers.telemetry.models import Alert

S = Endpoint.State


def _ascend(name, address):
    return Node.objects.create(
        name=name,
        hostname="one-host",
        address=address,
        platform="ascend",
        engine_python="/opt/engine/bin/python",
        last_heartbeat=timezone.now(),
    )


@pytest.mark.django_db
@pytest.mark.parametrize(
    "distributed, role, shape",
    [
        ("dp", "dp-headless", {}),
        ("ray", "ray-worker", {"pipeline_parallel_size": 2}),
    ],
)
def test_a_faulty_chip_on_the_worker_node_holds_the_replica_until_it_is_ok(
    npu_smi, always_ready, operator, api_for, tiny_artifact, as_viewer, settings, tmp_path, distributed, role, shape
):
    settings.DATA_DIR = tmp_path
    head, worker = _ascend("npu-a", "10.0.0.1"), _ascend("npu-b", "10.0.0.2")
    healthy = fixture(HEALTHY)
    collect.collect_node(head)
    collect.collect_node(worker)  # both agents have seen 8 healthy chips
    response = api_for(operator).post(
        "/api/v1/endpoints",
        {
            "name": "tiny",
            "artifact": tiny_artifact.pk,
            "node": "npu-a",
            "served_model_name": "tiny-llama",
            "distributed": distributed,
            "worker_nodes": ["npu-b"],
            "devices": [3],
            **shape,
        },
    )
    assert response.status_code == 201, response.content
    endpoint = Endpoint.objects.get(name="tiny")
    on_head, on_worker = (StandInSupervisor(), ReplicaWorkload()), (StandInSupervisor(), ReplicaWorkload())

    # Running and ready on both nodes (as the agents left it: tests/endpoints/test_multi_node.py brings it up).
    replica = Replica.objects.get()
    on_head[0].adopt(3_000_000)
    Replica.objects.filter(pk=replica.pk).update(
        state=S.READY,
        port=8600,
        port_host="one-host",
        cluster_port=6440,
        pid=3_000_000,
        pid_create_time=1.0,
        ready_at=timezone.now(),
    )
    for pid, member in enumerate(ReplicaMember.objects.all(), start=3_100_000):
        (on_head if member.node_id == head.pk else on_worker)[0].adopt(pid)
        ReplicaMember.objects.filter(pk=member.pk).update(state=S.READY, pid=pid, pid_create_time=1.0)
    assert ReplicaMember.objects.get(node=worker).role == role
    assert routed() == {0}

    def tick(node, agent):
        agent[1].last_health.clear()
        agent[1].reconcile(node=node, supervisor=agent[0])

    npu_smi(with_health(healthy, 3, "Critical"))
    collect.collect_node(worker)
    assert not Device.objects.get(node=worker, index=3).healthy and Device.objects.get(node=head, index=3).healthy
    # Out of routing as soon as the worker's agent has recorded it, before the head's agent acts.
    assert routed() == set()
    services.evaluate_alerts(notify=False)
    alert = health_alert(worker, 3)
    assert alert.state == Alert.State.FIRING and alert.node_id == worker.pk

    # The head's agent holds the replica: the devices are pinned by the spec on each node, nowhere to go.
    tick(head, on_head)
    tick(worker, on_worker)
    replica.refresh_from_db()
    why = (
        f"device fault: NPU 3 health is Critical on node npu-b ({role}); devices [3] pinned on each of its "
        "nodes: out of routing until it is OK again"
    )
    assert replica.state == S.DEGRADED and replica.state_reason == why
    assert not on_head[0].terminated and not on_head[0].started and not on_worker[0].terminated
    assert routed() == set()
    endpoint.refresh_from_db()
    assert endpoint.state == S.DEGRADED and endpoint.state_reason == why
    assert endpoint.events.get(kind="device-fault").level == "error"
    assert why in as_viewer.get(f"/endpoints/{endpoint.pk}/").content.decode()
    assert "NPU 3 health is Critical" in as_viewer.get(f"/nodes/{worker.pk}/").content.decode()
    worker_parts = as_viewer.get(f"/nodes/{worker.pk}/replicas").content.decode()
    assert f"tiny#0</a> <span class=\"muted\">{role}, rank 1</span>" in worker_parts and why in worker_parts
    tick(head, on_head)  # still faulty: nothing changes, no second event
    assert endpoint.events.filter(kind="device-fault").count() == 1

    # The chip is OK again: the replica is back in routing, the alert resolved.
    npu_smi(healthy)
    collect.collect_node(worker)
    tick(head, on_head)
    replica.refresh_from_db()
    assert replica.state == S.READY and replica.state_reason == "" and routed() == {0}
    services.evaluate_alerts(notify=False)
    assert health_alert(worker, 3).state == Alert.State.RESOLVED
    endpoint.refresh_from_db()
    assert endpoint.state == S.READY and endpoint.state_reason == ""
    assert not on_head[0].started and not on_worker[0].started  # held, never restarted


@pytest.mark.django_db
def test_a_fault_on_the_head_node_of_a_multi_node_replica_does_not_move_it(
    npu_smi, always_ready, operator, api_for, tiny_artifact, settings, tmp_path
):
    """Its devices are the spec's on every node: no spare placement on the head either."""
    settings.DATA_DIR = tmp_path
    head, worker = _ascend("npu-a", "10.0.0.1"), _ascend("npu-b", "10.0.0.2")
    collect.collect_node(head)
    collect.collect_node(worker)
    api_for(operator).post(
        "/api/v1/endpoints",
        {
            "name": "tiny",
            "artifact": tiny_artifact.pk,
            "node": "npu-a",
            "served_model_name": "tiny-llama",
            "distributed": "dp",
            "worker_nodes": ["npu-b"],
            "devices": [3],
        },
    )
    supervisor = StandInSupervisor()
    supervisor.adopt(3_000_000)
    Replica.objects.update(
        state=S.READY, port=8600, port_host="one-host", cluster_port=6440, pid=3_000_000, pid_create_time=1.0
    )
    npu_smi(with_health(fixture(HEALTHY), 3, "Alarm"))
    collect.collect_node(head)
    ReplicaWorkload().reconcile(node=head, supervisor=supervisor)
    replica = Replica.objects.get()
    assert replica.state == S.DEGRADED and replica.devices == [3] and not supervisor.terminated
    assert replica.state_reason == (
        "device fault: NPU 3 health is Alarm; devices [3] pinned on each of its nodes: "
        "out of routing until it is OK again"
    )
    assert routed() == set()
