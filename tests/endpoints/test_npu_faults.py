"""NPU faults acted on (issue 15): the fake npu-smi replays a real healthy 8 × 910B4 sample, then the
same sample with one chip's health changed (or the chip gone), written in the test's tmp dir. The
agent's telemetry pass (workers: Device.health) and its reconcile pass (endpoints: what happens to
the replicas) are driven directly; the processes are a stand-in supervisor's, so no vLLM starts."""

import re
from pathlib import Path

import pytest
from django.utils import timezone

from endpoints import reconcile as reconcile_module
from endpoints.gateway.selectors import routing_table
from endpoints.models import Endpoint, Replica
from endpoints.reconcile import ReplicaWorkload
from models_registry.models import Artifact, Model
from tests.support.npu_smi import fixture, with_health
from workers.agent.supervisor import ProcessHandle, Stopped
from workers.models import Device, Node
from workers.telemetry import collect, services
from workers.telemetry.models import Alert

HEALTHY = "info_910B4_8npu_v25.0.rc1.1_idle.txt"  # real: Atlas 800I A2 (SOURCES.md)
S = Endpoint.State


def without_npu(text: str, npu: int) -> str:
    """The sample with NPU `npu`'s two rows (and the separator under them) gone, as when a chip drops out."""
    lines = text.splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if re.match(rf"^\| {npu}\s+910B4\s+\|", line))
    return "".join(lines[:start] + lines[start + 3 :])


class StandInSupervisor:
    """The agent's supervisor without processes: records what is started and stopped."""

    def __init__(self):
        self.running: dict[int, object] = {}
        self.started, self.terminated = [], []
        self.next_pid = 4_000_000

    def adopt(self, pid: int) -> None:
        self.running[pid] = None

    def start(self, spec):
        self.next_pid += 1
        self.running[self.next_pid] = spec
        self.started.append(spec)
        return ProcessHandle(pid=self.next_pid, create_time=1.0, argv=list(spec.argv))

    def find(self, handle):
        return type("Proc", (), {"pid": handle.pid})() if handle.pid in self.running else None

    def terminate(self, proc, *, grace):
        self.running.pop(proc.pid, None)
        self.terminated.append(proc.pid)
        return Stopped(exit_code=0, killed=False)

    def exit_code(self, handle):
        return None

    def reap(self, handle):
        self.running.pop(handle.pid, None)

    def log_tail(self, handle, log_path, count=200):
        return ""


@pytest.fixture
def npu_smi(fake_npu_smi, monkeypatch, tmp_path):
    """replay(text): what the fake npu-smi prints for `npu-smi info` from now on (`replay.fake`: the stand-in)."""
    fake_npu_smi.set(map="info_-m_910B4_8npu.txt")
    monkeypatch.setattr(collect, "_net_seen", {})

    def replay(text: str) -> None:
        path = Path(tmp_path) / "npu-smi-info-910B4.txt"
        path.write_text(text, encoding="utf-8")
        fake_npu_smi.set(default=path)

    replay(fixture(HEALTHY))
    replay.fake = fake_npu_smi
    return replay


@pytest.fixture
def node(db):
    return Node.objects.create(
        name="npu-host", hostname="npu-host", address="127.0.0.1", platform="ascend", last_heartbeat=timezone.now()
    )


@pytest.fixture
def always_ready(monkeypatch):
    """The replicas' /health and /v1/models answer (there is no vLLM behind the stand-in)."""
    monkeypatch.setattr(reconcile_module, "check_ready", lambda replica: (True, "ok"))


def serving(node, supervisor, *, devices, replicas, placed):
    """An endpoint on `devices` whose replicas run on `placed` (one device list per replica)."""
    model, _ = Model.objects.get_or_create(name="m")
    artifact = Artifact.objects.create(model=model, format="hf", path="/models/tiny", status="ready")
    endpoint = Endpoint.objects.create(
        name="tiny",
        artifact=artifact,
        node=node,
        served_model_name="tiny-llama",
        devices=devices,
        replicas=replicas,
        state=S.READY,
    )
    for index, on in enumerate(placed):
        wanted = index < replicas
        pid = 3_000_000 + index if wanted else None
        if pid:
            supervisor.adopt(pid)
        Replica.objects.create(
            endpoint=endpoint,
            index=index,
            node=node,
            devices=on,
            port=8600 + index if wanted else None,
            port_host=node.hostname,
            pid=pid,
            pid_create_time=1.0 if pid else None,
            state=S.READY if wanted else S.STOPPED,
            ready_at=timezone.now() if wanted else None,
        )
    return endpoint


def routed() -> set[int]:
    return {b.replica_index for b in routing_table().backends.get("tiny-llama", [])}


def pass_of(node, workload, supervisor) -> None:
    """One agent tick: telemetry, then reconcile."""
    collect.collect_node(node)
    workload.reconcile(node=node, supervisor=supervisor)


def health_alert(node, npu):
    return Alert.objects.filter(rule__name="Accelerator health not OK", subject=f"n{node.pk}.d{npu}.dev.health").first()


@pytest.mark.parametrize(
    "fault, shown",
    [
        ("Critical", "NPU 3 health is Critical"),
        ("Warning", "NPU 3 health is Warning"),
        ("0x80e18402", "NPU 3 health is 0x80e18402"),  # an error code in the Health column
        ("missing", "NPU 3 is missing from npu-smi"),
    ],
)
def test_a_faulty_chip_takes_its_replica_out_until_it_is_ok_again(npu_smi, node, always_ready, as_viewer, fault, shown):
    supervisor, workload = StandInSupervisor(), ReplicaWorkload()
    healthy = fixture(HEALTHY)
    pass_of(node, workload, supervisor)  # the agent has seen 8 healthy chips
    endpoint = serving(node, supervisor, devices=[2, 3], replicas=2, placed=[[2], [3]])
    assert routed() == {0, 1}

    npu_smi(without_npu(healthy, 3) if fault == "missing" else with_health(healthy, 3, fault))
    collect.collect_node(node)
    npu3 = Device.objects.get(node=node, index=3)
    assert npu3.fault == shown and not npu3.healthy
    # Out of routing as soon as the agent has recorded it, before the replica itself is touched.
    assert routed() == {0}

    services.evaluate_alerts(notify=False)
    alert = health_alert(node, 3)
    assert alert is not None and alert.state == Alert.State.FIRING and alert.node_id == node.pk

    # The spec pins devices [2, 3] and NPU 2 belongs to replica 0: no healthy spare. The replica
    # keeps its process but stays out of routing, with the reason on the endpoint and node pages.
    workload.reconcile(node=node, supervisor=supervisor)
    replica = Replica.objects.get(endpoint=endpoint, index=1)
    assert replica.state == S.DEGRADED and replica.devices == [3] and replica.pid in supervisor.running
    assert replica.state_reason.startswith(f"device fault: {shown}; no healthy spare")
    assert supervisor.terminated == [] and supervisor.started == []
    assert routed() == {0}
    endpoint.refresh_from_db()
    assert endpoint.state == S.DEGRADED
    page = as_viewer.get(f"/endpoints/{endpoint.pk}/").content.decode()
    assert f"device fault: {shown}" in page
    node_page = as_viewer.get(f"/nodes/{node.pk}/").content.decode()
    assert shown in node_page
    assert f"device fault: {shown}" in as_viewer.get(f"/nodes/{node.pk}/replicas").content.decode()
    # Another pass with the chip still faulty changes nothing and logs no second event.
    events = endpoint.events.filter(kind="device-fault").count()
    pass_of(node, workload, supervisor)
    assert endpoint.events.filter(kind="device-fault").count() == events == 1

    # The chip is OK again: usable again, the replica back in routing, the alert resolved.
    npu_smi(healthy)
    pass_of(node, workload, supervisor)
    assert Device.objects.get(node=node, index=3).healthy
    replica.refresh_from_db()
    assert replica.state == S.READY and replica.state_reason == "" and replica.devices == [3]
    assert routed() == {0, 1}
    services.evaluate_alerts(notify=False)
    assert health_alert(node, 3).state == Alert.State.RESOLVED
    endpoint.refresh_from_db()
    assert endpoint.state == S.READY and endpoint.state_reason == ""


def test_a_replica_moves_to_a_healthy_spare_of_the_endpoints_devices(npu_smi, node, always_ready, settings):
    """Scaled from 2 replicas to 1: NPU 2 of the endpoint's devices is free. Replica 0's NPU 3
    goes Critical: it is stopped and started again on NPU 2 (its devices follow)."""
    settings.MODEL_ROOTS = ["/models"]  # where the endpoint's artifact says it is (a start checks it is inside)
    supervisor, workload = StandInSupervisor(), ReplicaWorkload()
    pass_of(node, workload, supervisor)
    endpoint = serving(node, supervisor, devices=[2, 3], replicas=1, placed=[[3], [2]])
    old_pid = Replica.objects.get(endpoint=endpoint, index=0).pid
    assert routed() == {0}

    npu_smi(with_health(fixture(HEALTHY), 3, "Critical"))
    pass_of(node, workload, supervisor)
    replica = Replica.objects.get(endpoint=endpoint, index=0)
    assert supervisor.terminated == [old_pid]
    assert replica.state == S.RESTARTING and replica.devices == [2] and replica.pid is None
    assert "device fault: NPU 3 health is Critical; restarting on devices [2]" == replica.state_reason
    assert routed() == set()
    event = endpoint.events.get(kind="device-fault")
    assert event.level == "error" and "was on [3]" in event.message

    workload.reconcile(node=node, supervisor=supervisor)  # the next tick starts it on NPU 2
    (spec,) = supervisor.started
    assert spec.env["ASCEND_RT_VISIBLE_DEVICES"] == "2"
    replica.refresh_from_db()
    assert replica.state == S.STARTING and replica.pid == supervisor.next_pid
    workload.reconcile(node=node, supervisor=supervisor)
    replica.refresh_from_db()
    assert replica.state == S.READY and routed() == {0}

    # NPU 3 comes back: usable again (no replica is on it now, nothing else moves).
    npu_smi(fixture(HEALTHY))
    pass_of(node, workload, supervisor)
    assert Device.objects.get(node=node, index=3).healthy and len(supervisor.started) == 1


def test_a_broken_npu_smi_does_not_mark_chips_missing(npu_smi, node, monkeypatch, settings):
    """Only a complete `npu-smi info` answer says a chip is gone; a hung one says nothing."""
    collect.collect_node(node)
    npu_smi.fake.set(hang=30)
    settings.TELEMETRY_NPU_SMI_TIMEOUT_SECONDS = 1.0
    collect.collect_node(node)
    assert not Device.objects.filter(node=node).unhealthy().exists()


def test_a_failing_chip_map_does_not_mark_chips_missing(npu_smi, node, monkeypatch):
    """Without `-m` a 310P duo's chips would be numbered by NPU id: that is no proof a chip is gone."""
    npu_smi.fake.set(map="does-not-exist.txt")
    Device.objects.create(node=node, index=9, kind="npu", name="910B4", health="OK")
    collect.collect_node(node)
    assert Device.objects.get(node=node, index=9).health == "OK"
