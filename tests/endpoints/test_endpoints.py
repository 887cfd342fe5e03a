"""Endpoint specs: validation and refusals, command construction from the spec, the
lifecycle state machine, and the pages and API that drive them."""

import os
import re

import pytest
from django.utils import timezone

from console.models import Team
from endpoints.launch import held_cores, launch_spec
from endpoints.models import Endpoint, EndpointEvent, Replica
from endpoints.replica_state import aggregate_state, backoff_seconds
from models_registry.models import Artifact, Model
from tests.support import FIXTURES
from workers.models import Node

LLAMA2_70B = {
    "format": "hf",
    "architecture": "LlamaForCausalLM",
    "param_count": 68_976_648_192,
    "num_layers": 80,
    "hidden_size": 8192,
    "num_attention_heads": 64,
    "num_kv_heads": 8,
    "head_dim": 128,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "dtype": "float16",
    "weight_bytes": 137_953_296_384,
}


def _artifact(fmt, inspection=None, status="ready", path="/models/x"):
    model, _ = Model.objects.get_or_create(name="m")
    return Artifact.objects.create(model=model, format=fmt, path=path, status=status, inspection=inspection or {})


@pytest.mark.django_db
def test_launch_on_ascend_builds_the_documented_command(operator, api_for, ascend_node, tiny_artifact):
    response = api_for(operator).post(
        "/api/v1/endpoints",
        {
            "name": "tiny-ep",
            "artifact": tiny_artifact.pk,
            "devices": [2, 3],
            "tensor_parallel_size": 2,
            "max_model_len": 2048,
        },
    )
    assert response.status_code == 201, response.content
    body = response.json()
    assert body["node"] == "npu-host" and body["state"] == "pending" and body["served_model_name"] == "tiny-ep"
    assert body["max_num_seqs"] >= 1 and body["replicas"][0]["devices"] == [2, 3]
    endpoint = Endpoint.objects.get(name="tiny-ep")
    from endpoints.commands import build_command

    argv, env = build_command(
        launch_spec(endpoint=endpoint, replica=endpoint.replica_set.get(), node=ascend_node, port=8200)
    )
    assert argv[:3] == ["/opt/engine/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert argv[argv.index("--model") + 1] == tiny_artifact.path
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2" and argv[argv.index("--max-model-len") + 1] == "2048"
    assert env["ASCEND_RT_VISIBLE_DEVICES"] == "2,3" and env["PYTORCH_NPU_ALLOC_CONF"] == "expandable_segments:True"


@pytest.mark.django_db
def test_replicas_split_devices_and_node_defaults_to_the_only_one(operator, api_for, ascend_node, tiny_artifact):
    response = api_for(operator).post(
        "/api/v1/endpoints",
        {"name": "dp", "artifact": tiny_artifact.pk, "devices": [0, 1, 2, 3], "replicas": 2, "tensor_parallel_size": 2},
    )
    assert response.status_code == 201, response.content
    assert [r["devices"] for r in response.json()["replicas"]] == [[0, 1], [2, 3]]


@pytest.mark.django_db
@pytest.mark.parametrize(
    "payload,field,message",
    [
        ({"name": "Bad Name!"}, "name", "lower-case"),
        ({"devices": [0, 1]}, "devices", "need 1 devices"),
        ({"devices": [9]}, "devices", "has no device(s) [9]"),
        ({"devices": [0, 0]}, "devices", "listed twice"),
        ({"max_model_len": 999999}, "max_model_len", "between 16 and"),
        ({"extra_args": {"--api-key": "x"}}, "extra_args", "not an allowed vLLM flag"),
        ({"extra_args": {"--block-size": 7}}, "extra_args", "block-size"),
        ({"env": {"LD_PRELOAD": "/tmp/x.so"}}, "env", "LD_PRELOAD"),
        ({"dtype": "int4"}, "dtype", "Choose one of"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization", "Between 0.1 and 0.99"),
        ({"node": "nowhere"}, "node", "No node"),
    ],
)
def test_bad_launch_requests_are_refused_clearly(
    payload, field, message, operator, api_for, ascend_node, tiny_artifact
):
    data = {"name": "ep", "artifact": tiny_artifact.pk, "devices": [0], **payload}
    response = api_for(operator).post("/api/v1/endpoints", data)
    assert response.status_code == 400, response.content
    assert message in response.json()["detail"], response.json()
    assert any(message in m for m in response.json()["errors"][field]), response.json()
    assert not Endpoint.objects.exists() and not Replica.objects.exists()


@pytest.mark.django_db
def test_a_misspelt_launch_field_is_refused_not_dropped(operator, api_for, ascend_node, tiny_artifact):
    """It launched with the default gpu_memory_utilization before: the schema drops what it does not know."""
    response = api_for(operator).post(
        "/api/v1/endpoints", {"name": "ep", "artifact": tiny_artifact.pk, "devices": [0], "gpu_memory_util": 0.5}
    )
    assert response.status_code == 422 and [e["loc"][-1] for e in response.json()["detail"]] == ["gpu_memory_util"]
    assert not Endpoint.objects.exists()


@pytest.mark.django_db
@pytest.mark.parametrize(
    "fmt,message",
    [
        ("om", "OM models are for ACL/MindIE"),
        ("onnx", "cannot serve"),
        ("gguf", "Convert it to Hugging Face format first"),
    ],
)
def test_artifacts_vllm_cannot_serve_are_refused(fmt, message, operator, api_for, cpu_node):
    artifact = _artifact(fmt)
    response = api_for(operator).post("/api/v1/endpoints", {"name": "ep", "artifact": artifact.pk})
    assert response.status_code == 400 and message in response.json()["detail"]


@pytest.mark.django_db
def test_busy_devices_are_refused_unless_shared(operator, api_for, ascend_node, tiny_artifact):
    api = api_for(operator)
    assert api.post("/api/v1/endpoints", {"name": "a", "artifact": tiny_artifact.pk, "devices": [0]}).status_code == 201
    clash = api.post("/api/v1/endpoints", {"name": "b", "artifact": tiny_artifact.pk, "devices": [0]})
    assert clash.status_code == 400 and "In use by another endpoint: 0 (a)" in clash.json()["detail"]
    shared = api.post(
        "/api/v1/endpoints", {"name": "b", "artifact": tiny_artifact.pk, "devices": [0], "share_devices": True}
    )
    assert shared.status_code == 201


@pytest.mark.django_db
def test_capacity_refusal_and_audited_admin_override(operator, admin, api_for, ascend_node):
    from console.models import AuditEvent

    big = _artifact("hf", LLAMA2_70B)
    refused = api_for(operator).post("/api/v1/endpoints", {"name": "big", "artifact": big.pk, "devices": [0]})
    assert refused.status_code == 400 and "Does not fit" in refused.json()["detail"]
    not_admin = api_for(operator).post(
        "/api/v1/endpoints", {"name": "big", "artifact": big.pk, "devices": [0], "capacity_override": "testing"}
    )
    assert not_admin.status_code == 400 and "Only an Admin" in not_admin.json()["detail"]
    allowed = api_for(admin).post(
        "/api/v1/endpoints",
        {"name": "big", "artifact": big.pk, "devices": [0], "capacity_override": "swap test, approved by ops lead"},
    )
    assert allowed.status_code == 201
    event = AuditEvent.objects.get(action="endpoint.launch")
    assert event.changes["capacity_override"] == "swap test, approved by ops lead" and event.actor == admin
    # Eight 910B4 with TP 8 hold it (the guide's 70B set-up).
    fits = api_for(operator).post(
        "/api/v1/endpoints",
        {
            "name": "big8",
            "artifact": big.pk,
            "devices": list(range(1, 8)) + [0],
            "tensor_parallel_size": 8,
            "max_model_len": 4096,
            "share_devices": True,
        },
    )
    assert fits.status_code == 201, fits.content
    assert fits.json()["max_num_seqs"] <= 16 * 8


@pytest.mark.django_db
def test_int8_artifacts_refuse_float32(operator, api_for, cpu_node, tiny_artifact):
    tiny_artifact.format = "compressed-tensors"
    tiny_artifact.save()
    response = api_for(operator).post(
        "/api/v1/endpoints", {"name": "q", "artifact": tiny_artifact.pk, "dtype": "float32"}
    )
    assert response.status_code == 400 and "bfloat16 or float16" in response.json()["detail"]


@pytest.mark.django_db
def test_modelslim_artifacts_get_ascend_quantization(operator, api_for, ascend_node, tiny_artifact):
    tiny_artifact.format = "ascend-modelslim"
    tiny_artifact.save()
    response = api_for(operator).post(
        "/api/v1/endpoints", {"name": "w8a8", "artifact": tiny_artifact.pk, "devices": [0]}
    )
    assert response.status_code == 201 and response.json()["quantization"] == "ascend"


@pytest.mark.django_db
def test_cpu_node_command_and_env(operator, api_for, cpu_node, tiny_artifact, settings):
    response = api_for(operator).post(
        "/api/v1/endpoints", {"name": "c", "artifact": tiny_artifact.pk, "enforce_eager": True}
    )
    assert response.status_code == 201, response.content
    endpoint = Endpoint.objects.get(name="c")
    from endpoints.commands import build_command

    argv, env = build_command(
        launch_spec(endpoint=endpoint, replica=endpoint.replica_set.get(), node=cpu_node, port=8201)
    )
    assert "--enforce-eager" in argv and "--gpu-memory-utilization" not in argv
    assert env["VLLM_CPU_KVCACHE_SPACE"] == str(settings.VLLM_CPU_KVCACHE_GIB)
    assert "ASCEND_RT_VISIBLE_DEVICES" not in env and "CUDA_VISIBLE_DEVICES" not in env
    devices = api_for(operator).post("/api/v1/endpoints", {"name": "d", "artifact": tiny_artifact.pk, "devices": [0]})
    assert devices.status_code == 400 and "CPU node" in devices.json()["detail"]


@pytest.mark.django_db
def test_offline_node_leaves_the_launch_pending_with_the_reason(operator, api_for, cpu_node, tiny_artifact):
    Node.objects.filter(pk=cpu_node.pk).update(last_heartbeat=timezone.now() - timezone.timedelta(minutes=5))
    body = api_for(operator).post("/api/v1/endpoints", {"name": "p", "artifact": tiny_artifact.pk}).json()
    assert body["state"] == "pending" and "offline" in body["reason"]


@pytest.mark.django_db
def test_state_machine_aggregation(cpu_node, tiny_artifact):
    endpoint = Endpoint.objects.create(
        name="e", artifact=tiny_artifact, node=cpu_node, served_model_name="e", replicas=2
    )
    r0 = Replica.objects.create(endpoint=endpoint, index=0, node=cpu_node)
    r1 = Replica.objects.create(endpoint=endpoint, index=1, node=cpu_node)
    S = Endpoint.State

    def states(a, b):
        Replica.objects.filter(pk=r0.pk).update(state=a)
        Replica.objects.filter(pk=r1.pk).update(state=b)
        return aggregate_state(endpoint)[0]

    assert states(S.READY, S.READY) == S.READY
    assert states(S.READY, S.CRASHED) == S.DEGRADED
    assert states(S.STARTING, S.PENDING) == S.STARTING
    assert states(S.RESTARTING, S.STARTING) == S.RESTARTING
    assert states(S.FAILED, S.FAILED) == S.FAILED
    assert states(S.PENDING, S.PENDING) == S.PENDING
    endpoint.desired_state = Endpoint.Desired.STOPPED
    assert states(S.READY, S.STOPPED) == S.STOPPING
    assert states(S.STOPPED, S.FAILED) == S.STOPPED


def test_backoff_doubles_from_ten_seconds_to_five_minutes(settings):
    settings.ENDPOINT_BACKOFF_BASE_SECONDS = 10
    settings.ENDPOINT_BACKOFF_MAX_SECONDS = 300
    assert [backoff_seconds(n) for n in range(1, 8)] == [10, 20, 40, 80, 160, 300, 300]


@pytest.mark.django_db
def test_start_stop_restart_change_desired_state_and_are_audited(
    as_operator, operator, cpu_node, tiny_artifact, redis_conn
):
    from console.models import AuditEvent

    endpoint = Endpoint.objects.create(name="e", artifact=tiny_artifact, node=cpu_node, served_model_name="e")
    Replica.objects.create(endpoint=endpoint, index=0, node=cpu_node, state="failed", crashes_in_a_row=5)
    as_operator.post(f"/endpoints/{endpoint.pk}/stop")
    endpoint.refresh_from_db()
    assert endpoint.desired_state == "stopped"
    as_operator.post(f"/endpoints/{endpoint.pk}/start")
    replica = endpoint.replica_set.get()
    assert Endpoint.objects.get(pk=endpoint.pk).desired_state == "running"
    assert replica.state == "pending" and replica.crashes_in_a_row == 0  # a fresh start clears a give-up
    as_operator.post(f"/endpoints/{endpoint.pk}/restart")
    assert endpoint.replica_set.get().restart_requested
    actions = list(AuditEvent.objects.filter(action__startswith="endpoint.").values_list("action", flat=True))
    assert sorted(actions) == ["endpoint.restart", "endpoint.start", "endpoint.stop"]
    assert EndpointEvent.objects.filter(endpoint=endpoint).count() == 3
    page = as_operator.get(f"/endpoints/{endpoint.pk}/").content.decode()
    assert "Try it" in page and 'id="endpoint-state"' in page


def _a_replica_that_crashed(*, node, artifact, supervisor, settings, monkeypatch, tmp_path):
    """An endpoint "e" of one replica, started under the stand-in supervisor and then dead: the agent's pass has
    recorded the crash. Returns (endpoint, the workload that saw it)."""
    from endpoints import reconcile as reconcile_module
    from endpoints.reconcile import ReplicaWorkload

    settings.DATA_DIR = tmp_path
    monkeypatch.setattr(reconcile_module, "check_ready", lambda replica: (True, "ok"))
    endpoint = Endpoint.objects.create(name="e", artifact=artifact, node=node, served_model_name="e")
    Replica.objects.create(endpoint=endpoint, index=0, node=node)
    workload = ReplicaWorkload()
    workload.reconcile(node=node, supervisor=supervisor)
    supervisor.running.clear()  # it dies
    workload.reconcile(node=node, supervisor=supervisor)
    return endpoint, workload


def _restart_clicked_while_the_crash_is_recorded(operator):
    """The stand-in supervisor, with the web's Restart of endpoint "e" clicked inside crashed() (while the agent
    reads the dead replica's log)."""
    from endpoints.services import endpoint_restart
    from tests.endpoints.test_npu_faults import StandInSupervisor

    class RestartClickedMeanwhile(StandInSupervisor):
        def log_tail(self, handle, log_path, count=200):
            endpoint_restart(endpoint=Endpoint.objects.get(name="e"), user=operator)
            return ""

    return RestartClickedMeanwhile()


@pytest.mark.django_db
def test_an_operators_restart_does_not_wait_out_a_crash_backoff(
    operator, cpu_node, tiny_artifact, settings, monkeypatch, tmp_path
):
    """A replica backing off after a crash (up to five minutes) starts on the next pass once an operator
    presses Restart; its crash count stands."""
    from endpoints.services import endpoint_restart
    from tests.endpoints.test_npu_faults import StandInSupervisor

    supervisor = StandInSupervisor()
    endpoint, workload = _a_replica_that_crashed(
        node=cpu_node,
        artifact=tiny_artifact,
        supervisor=supervisor,
        settings=settings,
        monkeypatch=monkeypatch,
        tmp_path=tmp_path,
    )
    replica = Replica.objects.get()
    assert replica.state == "restarting" and replica.next_start_at > timezone.now()
    workload.reconcile(node=cpu_node, supervisor=supervisor)
    assert len(supervisor.started) == 1  # backing off

    endpoint_restart(endpoint=endpoint, user=operator)
    workload.reconcile(node=cpu_node, supervisor=supervisor)
    replica = Replica.objects.get()
    assert len(supervisor.started) == 2 and replica.state == "starting" and replica.crashes_in_a_row == 1


@pytest.mark.django_db
def test_a_restart_asked_for_while_the_agent_records_a_crash_is_kept(
    operator, cpu_node, tiny_artifact, settings, monkeypatch, tmp_path
):
    """The crash's write set the backoff over the Restart's next_start_at=None, clicked while the agent read the
    dead replica's exit code and log: the replica then waited out the backoff (up to five minutes)."""
    supervisor = _restart_clicked_while_the_crash_is_recorded(operator)
    endpoint, workload = _a_replica_that_crashed(
        node=cpu_node,
        artifact=tiny_artifact,
        supervisor=supervisor,
        settings=settings,
        monkeypatch=monkeypatch,
        tmp_path=tmp_path,
    )
    replica = Replica.objects.get()
    assert replica.state == "restarting" and replica.restart_requested and replica.next_start_at is None
    assert replica.state_reason == "crashed (exit code None); restarting now on request", replica.state_reason
    assert "restarting now on request" in EndpointEvent.objects.get(endpoint=endpoint, kind="crashed").message
    workload.reconcile(node=cpu_node, supervisor=supervisor)
    replica = Replica.objects.get()
    assert len(supervisor.started) == 2 and replica.state == "starting" and replica.crashes_in_a_row == 1


@pytest.mark.django_db
def test_a_restart_asked_for_while_the_agent_gives_up_on_a_replica_starts_it_afresh(
    operator, cpu_node, tiny_artifact, settings, monkeypatch, tmp_path
):
    """The give-up's write (failed, at the crash limit) went over a Restart clicked meanwhile: the replica started
    with its count at the limit, so its next crash gave up at once (and a distributed one's members stopped)."""
    from tests.endpoints.test_npu_faults import StandInSupervisor

    settings.ENDPOINT_MAX_CRASHES = 1  # the first crash is the last
    supervisor = _restart_clicked_while_the_crash_is_recorded(operator)
    endpoint, workload = _a_replica_that_crashed(
        node=cpu_node,
        artifact=tiny_artifact,
        supervisor=supervisor,
        settings=settings,
        monkeypatch=monkeypatch,
        tmp_path=tmp_path,
    )
    replica = Replica.objects.get()
    assert (replica.state, replica.crashes_in_a_row, replica.next_start_at) == ("restarting", 0, None)
    assert not EndpointEvent.objects.filter(endpoint=endpoint, kind="failed").exists()
    workload.reconcile(node=cpu_node, supervisor=supervisor)
    assert len(supervisor.started) == 2 and Replica.objects.get().state == "starting"

    # A restart asked for before the crash (a member's crash asks for one) does not keep it from giving up.
    Replica.objects.update(restart_requested=True)
    workload.crashed(
        Replica.objects.select_related("endpoint").get(), supervisor=StandInSupervisor(), now=timezone.now()
    )
    assert Replica.objects.get().state == "failed"


@pytest.mark.django_db
def test_a_start_refused_for_a_lost_lease_ends_the_pass_and_writes_nothing_on_the_replica(
    cpu_node, tiny_artifact, settings, tmp_path
):
    """The agent's supervisor is fenced once another agent took the node over (workers.agent.supervisor.fence):
    the refusal ends the pass, and the replica (the new agent's now) is not marked failed for it."""
    from endpoints.reconcile import ReplicaWorkload
    from tests.endpoints.test_npu_faults import StandInSupervisor
    from workers.agent.handles import LeaseLost

    class Fenced(StandInSupervisor):
        def start(self, spec):
            raise LeaseLost("agent lease-node no longer holds its node's lease")

    settings.DATA_DIR = tmp_path
    endpoint = Endpoint.objects.create(name="e", artifact=tiny_artifact, node=cpu_node, served_model_name="e")
    Replica.objects.create(endpoint=endpoint, index=0, node=cpu_node)
    with pytest.raises(LeaseLost):
        ReplicaWorkload().reconcile(node=cpu_node, supervisor=Fenced())
    assert Replica.objects.get().state == "pending" and not EndpointEvent.objects.filter(kind="error").exists()


@pytest.mark.django_db
def test_a_ready_replica_whose_health_check_fails_logs_one_degraded_event(
    cpu_node, tiny_artifact, settings, monkeypatch, tmp_path
):
    """READY → DEGRADED wrote no event: the endpoint page showed a replica out of routing with nothing in its
    events to say when or why. One event on the transition, not one per failed check; one when it recovers."""
    from endpoints import reconcile as reconcile_module
    from endpoints.reconcile import ReplicaWorkload
    from tests.endpoints.test_npu_faults import StandInSupervisor

    settings.DATA_DIR = tmp_path
    settings.ENDPOINT_HEALTH_FAILURES = 5
    answers = iter([(True, "ok"), (False, "/health answered 503"), (False, "/health answered 503"), (True, "ok")])
    monkeypatch.setattr(reconcile_module, "check_ready", lambda replica: next(answers))
    endpoint = Endpoint.objects.create(name="e", artifact=tiny_artifact, node=cpu_node, served_model_name="e")
    Replica.objects.create(endpoint=endpoint, index=0, node=cpu_node)
    supervisor, workload = StandInSupervisor(), ReplicaWorkload()
    workload.reconcile(node=cpu_node, supervisor=supervisor)  # started
    states = []
    for _ in range(4):
        workload.last_health.clear()
        workload.reconcile(node=cpu_node, supervisor=supervisor)
        states.append(Replica.objects.get().state)
    assert states == ["ready", "degraded", "degraded", "ready"]
    events = list(
        EndpointEvent.objects.filter(endpoint=endpoint, kind__in=["degraded", "recovered"])
        .order_by("id")
        .values_list("kind", "level", "message")
    )
    assert [(kind, level) for kind, level, _ in events] == [("degraded", "warning"), ("recovered", "info")]
    assert events[0][2].startswith("health check failed (/health answered 503): out of routing")


@pytest.mark.django_db
def test_a_start_that_never_becomes_ready_counts_as_a_crash(cpu_node, tiny_artifact, settings, monkeypatch, tmp_path):
    """Past ENDPOINT_START_TIMEOUT_SECONDS a starting replica is stopped, backed off and, after
    ENDPOINT_MAX_CRASHES such starts, given up: before, it was started again at once, for ever, uncounted."""
    from datetime import timedelta

    from endpoints import reconcile as reconcile_module
    from endpoints.reconcile import ReplicaWorkload
    from tests.endpoints.test_npu_faults import StandInSupervisor

    settings.DATA_DIR = tmp_path
    settings.ENDPOINT_START_TIMEOUT_SECONDS, settings.ENDPOINT_MAX_CRASHES = 60, 2
    monkeypatch.setattr(reconcile_module, "check_ready", lambda replica: (False, "connection refused"))
    endpoint = Endpoint.objects.create(name="e", artifact=tiny_artifact, node=cpu_node, served_model_name="e")
    Replica.objects.create(endpoint=endpoint, index=0, node=cpu_node)
    supervisor, workload = StandInSupervisor(), ReplicaWorkload()

    def hang_past_the_timeout():
        workload.reconcile(node=cpu_node, supervisor=supervisor)
        Replica.objects.update(started_at=timezone.now() - timedelta(seconds=61))
        workload.last_health.clear()
        workload.reconcile(node=cpu_node, supervisor=supervisor)
        return Replica.objects.get()

    replica = hang_past_the_timeout()
    assert len(supervisor.started) == 1 and len(supervisor.terminated) == 1
    assert replica.state == "restarting" and replica.crashes_in_a_row == 1 and replica.pid is None
    assert replica.next_start_at > timezone.now()
    assert replica.state_reason.startswith("not ready within 60 s (connection refused); restarting in ")
    assert EndpointEvent.objects.get(endpoint=endpoint, kind="start-timeout").level == "error"
    workload.reconcile(node=cpu_node, supervisor=supervisor)
    assert len(supervisor.started) == 1  # backing off, not started again at once

    Replica.objects.update(next_start_at=timezone.now())
    replica = hang_past_the_timeout()
    assert len(supervisor.started) == 2 and replica.state == "failed" and replica.crashes_in_a_row == 2
    assert replica.state_reason.startswith("gave up after 2 crashes in a row; last: not ready within 60 s")
    workload.reconcile(node=cpu_node, supervisor=supervisor)
    assert len(supervisor.started) == 2


@pytest.mark.django_db
def test_a_start_that_raises_is_tried_again_after_a_backoff_not_held_failed(
    cpu_node, tiny_artifact, settings, tmp_path
):
    """A start that raised before any process ran (the engine's venv on a mount not there yet after a reboot,
    a container runtime's hiccup) left the replica failed, holding its port, until an operator's Start."""
    from endpoints.reconcile import ReplicaWorkload
    from tests.endpoints.test_npu_faults import StandInSupervisor

    class MountNotThereYet(StandInSupervisor):
        def start(self, spec):
            if not self.started and not getattr(self, "refused", False):
                self.refused = True
                raise FileNotFoundError(2, "No such file or directory", spec.argv[0])
            return super().start(spec)

    settings.DATA_DIR = tmp_path
    endpoint = Endpoint.objects.create(name="e", artifact=tiny_artifact, node=cpu_node, served_model_name="e")
    Replica.objects.create(endpoint=endpoint, index=0, node=cpu_node)
    supervisor, workload = MountNotThereYet(), ReplicaWorkload()
    workload.reconcile(node=cpu_node, supervisor=supervisor)
    replica = Replica.objects.get()
    assert replica.state == "restarting" and replica.port is None and replica.crashes_in_a_row == 1
    assert replica.state_reason.startswith("could not start: FileNotFoundError") and replica.next_start_at
    assert EndpointEvent.objects.get(endpoint=endpoint, kind="start-failed").level == "error"
    Replica.objects.update(next_start_at=timezone.now())
    workload.reconcile(node=cpu_node, supervisor=supervisor)
    replica = Replica.objects.get()
    assert len(supervisor.started) == 1 and replica.state == "starting" and replica.port is not None


@pytest.mark.django_db
def test_a_restart_asked_for_while_the_agent_starts_the_replica_is_kept(cpu_node, tiny_artifact, settings, tmp_path):
    """The start's write cleared restart_requested: a Restart clicked after an edit, while the agent was inside
    the start (a container start takes minutes), was lost, and the replica ran the settings read before it."""
    from endpoints.reconcile import ReplicaWorkload
    from tests.endpoints.test_npu_faults import StandInSupervisor

    class RestartClickedMeanwhile(StandInSupervisor):
        def start(self, spec):
            Replica.objects.update(restart_requested=True)  # the web's Restart, during the start
            return super().start(spec)

    settings.DATA_DIR = tmp_path
    endpoint = Endpoint.objects.create(name="e", artifact=tiny_artifact, node=cpu_node, served_model_name="e")
    Replica.objects.create(endpoint=endpoint, index=0, node=cpu_node)
    ReplicaWorkload().reconcile(node=cpu_node, supervisor=RestartClickedMeanwhile())
    replica = Replica.objects.get()
    assert replica.state == "starting" and replica.restart_requested  # the next pass restarts it


@pytest.mark.django_db
def test_a_replica_started_for_an_endpoint_deleted_meanwhile_is_stopped(
    cpu_node, tiny_artifact, settings, tmp_path, caplog
):
    """The start's write matched no row and the process ran on, unowned: no pass would ever find, stop or reap it
    (on the devices and port of whatever launched next)."""
    from endpoints.reconcile import ReplicaWorkload
    from tests.endpoints.test_npu_faults import StandInSupervisor

    class DeletedMeanwhile(StandInSupervisor):
        def start(self, spec):
            Endpoint.objects.filter(pk=endpoint.pk).delete()  # the web's Delete, during the start
            return super().start(spec)

    settings.DATA_DIR = tmp_path
    endpoint = Endpoint.objects.create(name="e", artifact=tiny_artifact, node=cpu_node, served_model_name="e")
    Replica.objects.create(endpoint=endpoint, index=0, node=cpu_node)
    supervisor = DeletedMeanwhile()
    ReplicaWorkload().reconcile(node=cpu_node, supervisor=supervisor)
    assert len(supervisor.started) == 1 and supervisor.terminated == [supervisor.next_pid]
    assert not supervisor.running and not Replica.objects.exists() and not EndpointEvent.objects.exists()
    assert "its row was deleted while it started" in caplog.text


def test_a_replica_that_cuts_its_answer_short_is_not_ready_and_raises_nothing(cpu_node):
    """A vLLM dying mid-answer (IncompleteRead, a bad status line) raised out of the health check, and the catch-all
    marked a running replica failed."""
    from endpoints.replica_state import check_ready
    from tests.support.http import QuietHandler, ServerThread

    class CutShort(QuietHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", "100")
            self.end_headers()
            self.wfile.write(b"{}")
            self.close_connection = True

    server = ServerThread().serve(CutShort)
    try:
        replica = Replica(endpoint=Endpoint(name="e", served_model_name="e"), index=0, port=server.port)
        ok, detail = check_ready(replica)
    finally:
        server.stop()
    assert not ok and detail.startswith("IncompleteRead")


def test_a_log_tail_has_no_nul_bytes(tmp_path):
    """A log's tail after a power loss is NUL-filled; PostgreSQL's text columns refuse NUL, and the write of the
    crash (last_log) failed the agent's whole pass, again at every pass."""
    from workers.agent.logfiles import tail_lines

    log_file = tmp_path / "replica.log"
    log_file.write_bytes(b"INFO started\n" + b"\x00" * 4096 + b"\nERROR killed\n")
    assert "\x00" not in tail_lines(str(log_file)) and tail_lines(str(log_file)).endswith("ERROR killed")


@pytest.mark.django_db
def test_try_it_without_a_ready_replica_says_why(as_operator, operator, api_for, cpu_node, tiny_artifact):
    endpoint = Endpoint.objects.create(
        name="e", artifact=tiny_artifact, node=cpu_node, served_model_name="e", state="starting"
    )
    Replica.objects.create(endpoint=endpoint, index=0, node=cpu_node, state="starting")
    response = api_for(operator).post(f"/api/v1/endpoints/{endpoint.pk}/chat", {"message": "hi"})
    assert response.status_code == 503 and "no ready replica" in response.json()["detail"]
    page = as_operator.post(f"/endpoints/{endpoint.pk}/try", {"message": "hi"})
    assert page.status_code == 200 and b"no ready replica" in page.content
    for bad in (0, -5, 10**9):  # refused on the field before any replica is asked
        refused = api_for(operator).post(f"/api/v1/endpoints/{endpoint.pk}/chat", {"message": "hi", "max_tokens": bad})
        assert refused.status_code == 400 and list(refused.json()["errors"]) == ["max_tokens"], refused.content


@pytest.mark.django_db
def test_delete_needs_a_stopped_endpoint(admin, api_for, cpu_node, tiny_artifact):
    endpoint = Endpoint.objects.create(name="e", artifact=tiny_artifact, node=cpu_node, served_model_name="e")
    Replica.objects.create(endpoint=endpoint, index=0, node=cpu_node, state="ready", pid=12345)
    api = api_for(admin)
    assert api.delete(f"/api/v1/endpoints/{endpoint.pk}").status_code == 409
    assert Endpoint.objects.filter(pk=endpoint.pk).exists()
    Replica.objects.update(state="stopped", pid=None)
    assert api.delete(f"/api/v1/endpoints/{endpoint.pk}").status_code == 204
    assert not Endpoint.objects.filter(pk=endpoint.pk).exists() and not Replica.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_an_agent_recording_a_start_during_a_delete_waits_for_it_and_finds_no_row(
    admin, cpu_node, tiny_artifact, monkeypatch
):
    """The delete checked that nothing ran, then deleted without a lock: an agent's write of a start's pid in
    between landed (1 row) and the endpoint went with a process running that nothing would stop. Locked, the
    write waits for the delete and matches no row, which the agent answers by stopping what it started."""
    import threading

    from django.db import connection

    from endpoints import services

    endpoint = Endpoint.objects.create(name="e", artifact=tiny_artifact, node=cpu_node, served_model_name="e")
    replica = Replica.objects.create(endpoint=endpoint, index=0, node=cpu_node, state="stopped")
    recorded = []

    def agent_records_its_start():
        try:
            recorded.append(Replica.objects.filter(pk=replica.pk).update(pid=4_000_001, state="starting"))
        finally:
            connection.close()

    def audit_log(**kwargs):  # between the checks and the delete: the agent writes now
        agent = threading.Thread(target=agent_records_its_start)
        agent.start()
        agent.join(timeout=1)  # done at once without a lock; with one it waits for the delete's commit
        audit_log.agent = agent

    monkeypatch.setattr(services, "audit_log", audit_log)
    services.endpoint_delete(endpoint=endpoint, user=admin)
    audit_log.agent.join(timeout=30)
    assert recorded == [0] and not Endpoint.objects.exists() and not Replica.objects.exists()


@pytest.mark.django_db
def test_artifact_in_use_cannot_be_deleted(admin, api_for, cpu_node, tiny_artifact):
    Endpoint.objects.create(name="e", artifact=tiny_artifact, node=cpu_node, served_model_name="e")
    response = api_for(admin).delete(f"/api/v1/artifacts/{tiny_artifact.pk}")
    assert response.status_code == 409 and "used by endpoint(s) e" in response.json()["detail"]


@pytest.mark.django_db
def test_node_compat_warnings_from_the_matrix():
    from workers.engine_info import cann_version, compat_warnings, load_matrix

    rows = load_matrix()
    assert (
        rows[0]["vllm_ascend"] == "0.23.0"
        and {
            "vllm_ascend": "0.7.3",
            "vllm": "0.7.3",
            "cann": "8.1.RC1",
            "python": ((3, 9), (3, 12)),
            "torch": "2.5.1",
            "torch_npu": "2.5.1",
        }
        in rows
    )

    info_file = FIXTURES / "ascend" / "ascend_toolkit_install.info_8.1.RC1.txt"
    assert cann_version([str(info_file)]) == "8.1.RC1"
    good = {"vllm_ascend": "0.7.3", "vllm": "0.7.3", "torch": "2.5.1", "torch_npu": "2.5.1"}
    assert compat_warnings(good, cann="8.1.RC1") == []
    bad = compat_warnings({**good, "torch_npu": "2.7.1"}, cann="8.0.0")
    assert any("torch_npu 2.7.1 does not match" in w for w in bad) and any("CANN 8.0.0 differs" in w for w in bad)
    assert "not installed" in compat_warnings({"vllm": "0.11.0"}, cann=None)[0]


def test_running_replica_logs_are_copied_and_truncated(tmp_path, settings):
    """A process appending to its log keeps writing to the same file after rotation."""
    import subprocess
    import sys

    from tests.support.agents import wait_for
    from workers.agent.supervisor import rotate_if_large

    settings.ENDPOINT_LOG_MAX_BYTES = 300
    settings.ENDPOINT_LOG_KEEP = 3
    log = tmp_path / "replica-0.log"
    with open(log, "ab") as out:
        writer = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import sys,time\nfor i in range(400):\n print('line', i, flush=True); time.sleep(0.005)",
            ],
            stdout=out,
        )
    # Rotated once the log is past the limit while the writer still writes (waited for, not slept: a loaded
    # machine may take a second to start the writer's Python).
    wait_for(lambda: log.stat().st_size > settings.ENDPOINT_LOG_MAX_BYTES, timeout=60, interval=0.01, what="the log")
    assert writer.poll() is None, "the writer finished before the rotation: nothing was rotated under it"
    rotate_if_large(str(log), max_bytes=settings.ENDPOINT_LOG_MAX_BYTES, keep=settings.ENDPOINT_LOG_KEEP)
    writer.wait()
    first = (tmp_path / "replica-0.log.1").read_text()
    assert first.startswith("line 0\n") and len(first) > 300
    rest = log.read_text().lstrip("\0")
    assert rest.rstrip().endswith("line 399")
    # Whole lines only: copy-and-truncate may split the one line written between the copy and the
    # truncation (logrotate's copytruncate has the same window), so fragments at the seam are allowed.
    copied = [int(n) for n in re.findall(r"^line (\d+)$", first, re.M)]
    kept = [int(n) for n in re.findall(r"^line (\d+)$", rest, re.M)]
    assert copied == list(range(len(copied))) and kept == list(range(kept[0], 400))
    assert copied[-1] < kept[0]  # nothing rewritten, the writer carried on


@pytest.mark.django_db
def test_blue_green_from_the_endpoint_page(as_operator, cpu_node, tiny_artifact):
    live = Endpoint.objects.create(name="chat-blue", artifact=tiny_artifact, node=cpu_node, served_model_name="chat")
    green = Endpoint.objects.create(name="chat-green", artifact=tiny_artifact, node=cpu_node, served_model_name="chat")
    Endpoint.objects.create(name="other", artifact=tiny_artifact, node=cpu_node, served_model_name="other")
    page = as_operator.get(f"/endpoints/{live.pk}/").content.decode()
    assert 'id="bluegreen-form"' in page and "chat-green" in page and ">other (" not in page
    as_operator.post(f"/gateway/endpoints/{live.pk}/bluegreen", {"action": "stage", "staged": green.pk})
    page = as_operator.get(f"/endpoints/{live.pk}/").content.decode()
    assert 'id="bluegreen-serving">live<' in page and 'id="bluegreen-switch"' in page
    refused = as_operator.post(f"/gateway/endpoints/{live.pk}/bluegreen", {"action": "switch"}, follow=True)
    assert b"chat-green has no ready replica: traffic stays where it is" in refused.content
    Replica.objects.create(endpoint=green, index=0, node=cpu_node, state="ready", port=8301)
    as_operator.post(f"/gateway/endpoints/{live.pk}/bluegreen", {"action": "switch"})
    assert 'id="bluegreen-serving">staged<' in as_operator.get(f"/endpoints/{live.pk}/").content.decode()


@pytest.mark.django_db
def test_scheduled_restarts_every_n_hours_or_daily(operator, api_for, cpu_node, tiny_artifact):
    import datetime as dt

    from endpoints.replica_state import scheduled_restart_due

    bad = api_for(operator).post(
        "/api/v1/endpoints", {"name": "s", "artifact": tiny_artifact.pk, "restart_daily_at": "25:99"}
    )
    assert bad.status_code == 400 and "HH:MM" in bad.json()["detail"]
    body = (
        api_for(operator)
        .post("/api/v1/endpoints", {"name": "s", "artifact": tiny_artifact.pk, "restart_daily_at": "03:30"})
        .json()
    )
    endpoint = Endpoint.objects.get(pk=body["id"])
    assert endpoint.restart_daily_at == dt.time(3, 30)
    utc = dt.UTC
    now = dt.datetime(2026, 12, 2, 3, 31, tzinfo=utc)
    assert (
        scheduled_restart_due(endpoint, dt.datetime(2026, 12, 1, 20, 0, tzinfo=utc), now)
        == "daily restart at 03:30 UTC"
    )
    assert (
        scheduled_restart_due(endpoint, dt.datetime(2026, 12, 2, 3, 30, 30, tzinfo=utc), now) == ""
    )  # restarted already
    assert (
        scheduled_restart_due(
            endpoint, dt.datetime(2026, 12, 1, 20, 0, tzinfo=utc), dt.datetime(2026, 12, 2, 3, 0, tzinfo=utc)
        )
        == ""
    )  # not yet today
    endpoint.restart_daily_at, endpoint.restart_every_hours = None, 6
    assert scheduled_restart_due(endpoint, now - dt.timedelta(hours=6, seconds=1), now) == "scheduled restart after 6 h"
    assert scheduled_restart_due(endpoint, now - dt.timedelta(hours=5), now) == ""


@pytest.mark.django_db
def test_launch_page_parses_the_form_once_with_the_api_messages(as_operator, ascend_node, tiny_artifact):
    form = {
        "name": "web-ep",
        "artifact": str(tiny_artifact.pk),
        "node": str(ascend_node.pk),
        "devices": "0, 1",
        "replicas": "2",
        "tensor_parallel_size": "1",
        "pipeline_parallel_size": "",
        "max_model_len": "",
        "max_num_seqs": "",
        "gpu_memory_utilization": "",
        "dtype": "",
        "served_model_name": "",
        "extra_args": '{"--enable-prefix-caching": true}',
        "env": '{"VLLM_LOGGING_LEVEL": "INFO"}',
        "capacity_override": "",
        "restart_every_hours": "",
        "restart_daily_at": "03:30",
        "enforce_eager": "on",
    }
    bad = as_operator.post("/endpoints/launch", {**form, "devices": "0", "gpu_memory_utilization": "lots"})
    assert bad.status_code == 400 and "Between 0.1 and 0.99." in bad.content.decode()
    bad = as_operator.post("/endpoints/launch", {**form, "devices": "0"})
    assert bad.status_code == 400 and "2 replica(s) × TP 1 × PP 1 need 2 devices; 1 given." in bad.content.decode()
    bad = as_operator.post("/endpoints/launch", {**form, "devices": "a,b", "env": "{bad json"})
    page = bad.content.decode()
    assert bad.status_code == 400 and "Devices are numbers, e.g. 0,1." in page and "Expecting property name" in page
    assert 'value="a,b"' in page  # what was typed comes back
    bad = as_operator.post("/endpoints/launch", {**form, "restart_daily_at": "25:99", "replicas": "-1"})
    assert bad.status_code == 400 and "HH:MM" in bad.content.decode()
    assert not Endpoint.objects.exists()
    assert as_operator.post("/endpoints/launch", form).status_code == 302
    endpoint = Endpoint.objects.get(name="web-ep")
    assert (endpoint.devices, endpoint.replicas, endpoint.enforce_eager, endpoint.share_devices) == (
        [0, 1],
        2,
        True,
        False,
    )
    assert endpoint.extra_args == {"--enable-prefix-caching": True} and endpoint.env == {"VLLM_LOGGING_LEVEL": "INFO"}
    assert endpoint.served_model_name == "web-ep"
    assert str(endpoint.restart_daily_at) == "03:30:00" and endpoint.replica_set.count() == 2


# --- the launch: environment allow-list, log path, the node page's fragment --------------------

CONSOLE_SECRETS = (
    "METRICS_TOKEN",
    "REDIS_URL",
    "SECRET_KEY",
    "SECRET_KEY_FILE",
    "DATABASE_URL",
    "CONSOLE_ADMIN_PASSWORD",
    "CONSOLE_ADMIN_PASSWORD_FILE",
    "DJANGO_SETTINGS_MODULE",
)


def test_child_environment_inherits_only_the_allow_list(monkeypatch):
    from endpoints.launch import child_environment

    for key in CONSOLE_SECRETS + ("AWS_SECRET_ACCESS_KEY", "SOMETHING_ELSE", "LD_PRELOAD"):
        monkeypatch.setenv(key, "secret")
    monkeypatch.setenv("LANG", "C.UTF-8")
    monkeypatch.setenv("LC_ALL", "C.UTF-8")
    monkeypatch.setenv("TZ", "UTC")
    monkeypatch.setenv("ASCEND_TOOLKIT_HOME", "/usr/local/Ascend/ascend-toolkit/latest")
    monkeypatch.setenv("LD_LIBRARY_PATH", "/usr/local/Ascend/driver/lib64")
    env = child_environment({"VLLM_CPU_KVCACHE_SPACE": "1", "TZ": "Asia/Shanghai"})
    for key in CONSOLE_SECRETS + ("AWS_SECRET_ACCESS_KEY", "SOMETHING_ELSE", "LD_PRELOAD"):
        assert key not in env, key
    assert env["PATH"] == os.environ["PATH"] and env["HOME"] == os.environ["HOME"]
    assert env["LANG"] == "C.UTF-8" and env["LC_ALL"] == "C.UTF-8"
    assert env["ASCEND_TOOLKIT_HOME"].endswith("latest") and env["LD_LIBRARY_PATH"].endswith("lib64")
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1" and env["TZ"] == "Asia/Shanghai"  # the console's additions win
    assert child_environment({}, base={"PATH": "/bin", "SECRET_KEY": "x"}) == {"PATH": "/bin"}


@pytest.mark.django_db
def test_replica_process_spec_carries_no_console_secret(
    operator, api_for, cpu_node, tiny_artifact, settings, monkeypatch
):
    from endpoints.launch import replica_process

    for key in CONSOLE_SECRETS:
        monkeypatch.setenv(key, "secret")
    assert api_for(operator).post("/api/v1/endpoints", {"name": "c", "artifact": tiny_artifact.pk}).status_code == 201
    replica = Replica.objects.select_related("endpoint", "endpoint__artifact").get(endpoint__name="c")
    spec, added = replica_process(replica=replica, node=cpu_node, port=8202)
    assert not set(CONSOLE_SECRETS) & set(spec.env)
    assert spec.env["VLLM_CPU_KVCACHE_SPACE"] == added["VLLM_CPU_KVCACHE_SPACE"] == str(settings.VLLM_CPU_KVCACHE_GIB)
    assert "--port" in spec.argv and spec.argv[spec.argv.index("--port") + 1] == "8202"
    assert spec.log_path == settings.DATA_DIR / "logs" / "endpoints" / "c" / "replica-0.log"
    assert spec.log_keep == settings.ENDPOINT_LOG_KEEP


def test_endpoints_register_with_the_agent_and_telemetry():
    from endpoints.reconcile import ReplicaWorkload
    from endpoints.telemetry import collect_replicas
    from workers.agent.workloads import registered_workloads
    from workers.telemetry.sources import registered_collectors

    assert any(isinstance(w, ReplicaWorkload) for w in registered_workloads())
    assert collect_replicas in registered_collectors()


@pytest.mark.django_db
def test_node_page_lists_its_replicas_through_the_endpoints_fragment(as_viewer, cpu_node, tiny_artifact):
    endpoint = Endpoint.objects.create(name="tiny", artifact=tiny_artifact, node=cpu_node, served_model_name="tiny")
    Replica.objects.create(endpoint=endpoint, index=0, node=cpu_node, state="ready", pid=4242, port=8301)
    Replica.objects.create(endpoint=endpoint, index=1, node=cpu_node, state="stopped", port=8302)
    page = as_viewer.get(f"/nodes/{cpu_node.pk}/").content.decode()
    assert f'hx-get="/nodes/{cpu_node.pk}/replicas"' in page and "Replicas on this node" in page
    fragment = as_viewer.get(f"/nodes/{cpu_node.pk}/replicas").content.decode()
    assert (
        f'href="/endpoints/{endpoint.pk}/">tiny#0</a>' in fragment
        and "pid 4242" in fragment
        and "port 8301" in fragment
    )
    assert "tiny#1" not in fragment  # stopped replicas are left out
    assert as_viewer.get("/nodes/").status_code == 200 and as_viewer.get("/nodes/999/replicas").status_code == 404


def _threads(replica: Replica, endpoint: Endpoint | None = None) -> tuple[str | None, str | None]:
    """What the launch would give the replica now: its VLLM_CPU_OMP_THREADS_BIND and OMP_NUM_THREADS."""
    from endpoints.commands import build_command

    endpoint = endpoint or replica.endpoint
    env = build_command(launch_spec(endpoint=endpoint, replica=replica, node=replica.node, port=8201))[1]
    return env.get("VLLM_CPU_OMP_THREADS_BIND"), env.get("OMP_NUM_THREADS")


def _run(replica: Replica, endpoint: Endpoint | None = None) -> tuple[str | None, str | None]:
    """Start it as the agent records a start (a PID, the variables the console set); its threads."""
    from endpoints.commands import build_command

    endpoint = endpoint or replica.endpoint
    env = build_command(launch_spec(endpoint=endpoint, replica=replica, node=replica.node, port=8201))[1]
    Replica.objects.filter(pk=replica.pk).update(pid=40000 + replica.pk, env=env)
    return env.get("VLLM_CPU_OMP_THREADS_BIND"), env.get("OMP_NUM_THREADS")


def _stop(*replicas: Replica) -> None:
    Replica.objects.filter(pk__in=[r.pk for r in replicas]).update(pid=None, env={})


@pytest.mark.django_db
def test_replicas_of_one_endpoint_on_a_cpu_node_get_their_own_cores(cpu_node, tiny_artifact):
    """vllm-cpu's auto binding gives every replica the same cores; the launch gives each its own share,
    less one core left to its scheduler process, as vLLM's auto binding leaves one."""
    cpu_node.host = {"cpus": 16, "cpu_cores": [0, 1, 2, 3, 4, 5, 6, 7]}  # 8 cores, 2 hyperthreads each
    cpu_node.save()
    endpoint = Endpoint.objects.create(
        name="e",
        artifact=tiny_artifact,
        node=cpu_node,
        served_model_name="e",
        replicas=1,
        autoscale={"min_replicas": 1, "max_replicas": 2},
    )
    replicas = [Replica.objects.create(endpoint=endpoint, index=i, node=cpu_node) for i in range(3)]

    # An autoscaled endpoint holds its share for its largest size, even while one replica runs.
    assert _run(replicas[0]) == ("0-2", None)
    assert _threads(replicas[1]) == ("4-6", None)
    _stop(replicas[0])
    assert _threads(replicas[1]) == ("0-2", None)  # the share nobody holds now
    endpoint.autoscale = None
    assert _threads(replicas[0]) == (None, None)  # one replica: vLLM's auto binding
    endpoint.replicas = 3
    assert [_run(r) for r in replicas] == [("0", None), ("2", None), ("4", None)]  # 1 of each 2 to the scheduler
    _stop(*replicas)
    endpoint.replicas = 5  # under two cores per slot: unpinned, a thread each per slot's worth of cores
    assert [_run(r) for r in replicas] == [("nobind", "1")] * 3
    _stop(*replicas)
    endpoint.env = {"OMP_NUM_THREADS": "2"}  # the endpoint's own env wins
    assert _threads(replicas[0]) == ("nobind", "2")
    endpoint.replicas = 2
    endpoint.env = {"VLLM_CPU_OMP_THREADS_BIND": "3"}  # the operator's binding wins, for every replica
    assert [_run(r) for r in replicas[:2]] == [("3", None), ("3", None)]
    _stop(*replicas)
    endpoint.env, endpoint.tensor_parallel_size = {}, 2  # one core set per rank: vLLM's auto binding
    assert [_threads(r) for r in replicas[:2]] == [(None, None), (None, None)]
    endpoint.tensor_parallel_size = 1
    cpu_node.host = {"cpus": 4}  # an agent from before cpu_cores: its CPU count
    cpu_node.save()
    assert [_run(r) for r in replicas[:2]] == [("0", None), ("2", None)]


@pytest.mark.django_db
def test_endpoints_on_one_cpu_node_share_its_cores_out(cpu_node, tiny_artifact):
    """Two endpoints on one CPU node: each replica gets its own run of the node's cores (vLLM's auto binding
    would give both NUMA node 0's), whichever starts first; a share handed out is held until its replica
    stops."""
    cpu_node.host = {"cpus": 12, "cpu_cores": list(range(12))}
    cpu_node.save()

    def endpoint(name, **fields):
        made = Endpoint.objects.create(
            name=name, artifact=tiny_artifact, node=cpu_node, served_model_name=name, **fields
        )
        return [Replica.objects.create(endpoint=made, index=i, node=cpu_node) for i in range(3)]

    scaled = endpoint("scaled", replicas=1, autoscale={"min_replicas": 1, "max_replicas": 2})
    lone = endpoint("lone", replicas=1)
    # Three slots on the node (two of the autoscaled endpoint's, the other's one): 4 cores each, in a row.
    assert _run(scaled[0]) == ("0-2", None)
    assert _run(lone[0]) == ("4-6", None)
    assert _run(scaled[1]) == ("8-10", None)
    _stop(scaled[0])
    assert _run(scaled[0]) == ("0-2", None)  # restarted: the run nobody holds
    _stop(*scaled, *lone)

    # Started while the other endpoint is stopped, the lone one is alone: vLLM's auto binding. The other,
    # beside a neighbour whose cores cannot be named, runs unpinned with its share's worth of threads.
    Endpoint.objects.filter(name="scaled").update(desired_state="stopped")
    assert _run(lone[0]) == (None, None)
    Endpoint.objects.filter(name="scaled").update(desired_state="running")
    assert _run(scaled[0]) == ("nobind", "4")
    _stop(lone[0])
    assert _run(lone[0]) == ("0-2", None)  # its restart: the other is unpinned, so every core is free
    _stop(*scaled, *lone)

    # A share is a run of cores: with an operator's binding in the middle of the node, the longest free run
    # when none is long enough, and the core after it is that share's, not the next replica's.
    Endpoint.objects.filter(name="scaled").update(desired_state="stopped")
    pinned = endpoint("pinned", replicas=1, env={"VLLM_CPU_OMP_THREADS_BIND": "5"})
    assert _run(pinned[0]) == ("5", None)  # holds 5 and 6 (the core after its set)
    assert _run(lone[0]) == ("0-3", None)  # 6 wanted; 0-4 and 7-11 free: the first longest, 4 its scheduler's
    Endpoint.objects.filter(name="scaled").update(desired_state="running")
    assert _run(scaled[0]) == ("7-8", None)  # 4 slots now: 3 cores, from 7-11
    _stop(*scaled, *lone, *pinned)
    Endpoint.objects.filter(name="pinned").delete()

    # A host of two cores (this machine's and CI's): two endpoints run unpinned, a thread each.
    cpu_node.host = {"cpus": 2, "cpu_cores": [0, 1]}
    cpu_node.save()
    assert _run(scaled[0]) == ("nobind", "1")
    assert _run(lone[0]) == ("nobind", "1")
    _stop(*scaled, *lone)

    # A rank of a multi-node replica on the node (auto-bound, beside its server elsewhere): unpinned too.
    from endpoints.models import ReplicaMember

    other = Node.objects.create(name="head", hostname="head", address="10.0.0.2", platform="cpu")
    head = Endpoint.objects.create(
        name="dp", artifact=tiny_artifact, node=other, served_model_name="dp", distributed="dp", data_parallel_size=2
    )
    head_replica = Replica.objects.create(endpoint=head, index=0, node=other)
    ReplicaMember.objects.create(replica=head_replica, node=cpu_node, rank=1, role="dp-headless", pid=4242)
    cpu_node.host = {"cpus": 12, "cpu_cores": list(range(12))}
    cpu_node.save()
    Endpoint.objects.filter(name="scaled").update(desired_state="stopped")
    assert _threads(lone[0]) == ("nobind", "6")


@pytest.mark.django_db
def test_a_neighbour_on_auto_binding_holds_its_numa_node(
    cpu_node, tiny_artifact, operator, api_for, as_viewer, settings, tmp_path
):
    """An endpoint that started alone on its node keeps vLLM's auto binding: the cores of the first NUMA node
    it may take memory from, which the agent records (Node.host["numa_cores"]). One launched beside it later
    gets a run of the other NUMA node's cores. Where auto took the whole node (one NUMA node) or its cores are
    not known, the newcomer runs unpinned and its endpoint's page names the restarts that share the node out;
    under two cores a share no restart would, and nothing is said."""
    from endpoints.launch import cpu_share_note
    from endpoints.reconcile import ReplicaWorkload
    from tests.endpoints.test_npu_faults import StandInSupervisor

    settings.DATA_DIR = tmp_path
    two_nodes = {"cpus": 24, "cpu_cores": list(range(12)), "numa_cores": [list(range(6)), list(range(6, 12))]}
    cpu_node.host = two_nodes
    cpu_node.save()
    assert cpu_node.cpu_layout == "12 cores (0-11) · by NUMA node: 0-5 | 6-11"
    first = Endpoint.objects.create(name="first", artifact=tiny_artifact, node=cpu_node, served_model_name="first")
    [alone] = [Replica.objects.create(endpoint=first, index=0, node=cpu_node)]
    assert _run(alone) == (None, None)  # alone on the node: vLLM's auto binding, NUMA node 0's cores
    second = Endpoint.objects.create(name="second", artifact=tiny_artifact, node=cpu_node, served_model_name="second")
    beside = Replica.objects.create(endpoint=second, index=0, node=cpu_node)
    assert _threads(beside) == ("6-10", None)  # NUMA node 1's run, 11 left to its scheduler
    assert cpu_share_note(replica=beside, node=cpu_node) == ""

    # NUMA nodes whose CPU ids interleave (node 0 the even ones): a share is cut from one node's cores.
    cpu_node.host = {**two_nodes, "numa_cores": [list(range(0, 12, 2)), list(range(1, 12, 2))]}
    cpu_node.save()
    assert _threads(beside) == ("1,3,5,7,9", None)
    Replica.objects.filter(pk=beside.pk).update(pid=40000 + beside.pk, env={"VLLM_CPU_OMP_THREADS_BIND": "1,3,5,7,9"})
    # ... and held again from the same order: the core after its set (11) is its scheduler's.
    assert held_cores([Replica.objects.get(pk=beside.pk)], [*range(0, 12, 2), *range(1, 12, 2)]) == {1, 3, 5, 7, 9, 11}
    _stop(beside)
    cpu_node.host = two_nodes
    cpu_node.save()
    # The first rank of a two-rank endpoint on auto binding takes NUMA node 0, the second NUMA node 1.
    Endpoint.objects.filter(pk=first.pk).update(tensor_parallel_size=2)
    assert _threads(beside) == ("nobind", "6")
    # Its restart would not change that (vLLM's binding, one set per rank), so the page suggests none.
    assert cpu_share_note(replica=beside, node=cpu_node) == ""
    Endpoint.objects.filter(pk=first.pk).update(tensor_parallel_size=1)

    for host in (
        {**two_nodes, "numa_cores": [list(range(12))]},  # one NUMA node: auto took every core
        {"cpus": 12, "cpu_cores": list(range(12))},
    ):  # an agent from before numa_cores
        cpu_node.host = host
        cpu_node.save()
        assert _threads(beside) == ("nobind", "6")
        assert cpu_share_note(replica=beside, node=cpu_node) == (
            "runs unpinned: the cores a share of its own needs on cpu-host are held by first (replica 0), started "
            "before this replica was wanted there; restart it, then this endpoint, to give each its own cores"
        )
    # Held by another team's replica: said without its name (the node is shared, the endpoint is not: issue 37).
    Endpoint.objects.filter(pk=second.pk).update(team=Team.objects.create(name="Other", slug="other"))
    assert cpu_share_note(replica=Replica.objects.get(pk=beside.pk), node=cpu_node) == (
        "runs unpinned: the cores a share of its own needs on cpu-host are held by another team's replica, started "
        "before this replica was wanted there; restart it, then this endpoint, to give each its own cores"
    )
    Endpoint.objects.filter(pk=second.pk).update(team=first.team)
    cpu_node.host = {"cpus": 2, "cpu_cores": [0, 1], "numa_cores": [[0, 1]]}  # a core a share: nothing to split
    cpu_node.save()
    assert _threads(beside) == ("nobind", "1") and cpu_share_note(replica=beside, node=cpu_node) == ""
    # A neighbour on the operator's own binding keeps it when restarted: no restart to suggest either.
    cpu_node.host = {"cpus": 12, "cpu_cores": list(range(12))}
    cpu_node.save()
    Endpoint.objects.filter(pk=first.pk).update(env={"VLLM_CPU_OMP_THREADS_BIND": "0-11"})
    Replica.objects.filter(pk=alone.pk).update(env={"VLLM_CPU_OMP_THREADS_BIND": "0-11"})
    assert _threads(beside) == ("nobind", "6") and cpu_share_note(replica=beside, node=cpu_node) == ""
    Endpoint.objects.filter(pk=first.pk).update(env={})
    Replica.objects.filter(pk=alone.pk).update(env={})

    # The agent's start says it on the endpoint's page; the restarts it names pin each to its own cores.
    cpu_node.host = {**two_nodes, "numa_cores": [list(range(12))]}
    cpu_node.save()
    supervisor, workload = StandInSupervisor(), ReplicaWorkload()
    supervisor.adopt(40000 + alone.pk)  # the first endpoint's running replica (_run's PID)
    workload.start(beside, node=cpu_node, supervisor=supervisor)
    [note] = second.events.filter(kind="cpu-share")
    assert note.level == "warning" and note.message.startswith("runs unpinned: the cores a share of its own needs")
    assert "restart it, then this endpoint" in as_viewer.get(f"/endpoints/{second.pk}/").content.decode()
    beside.refresh_from_db()
    assert beside.env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    # The node's page shows its cores, and each replica's place on them.
    from django.urls import reverse

    assert "12 cores (0-11)</dd>" in as_viewer.get(f"/nodes/{cpu_node.pk}/").content.decode()
    listed = as_viewer.get(reverse("node_replicas", args=[cpu_node.pk])).content.decode()
    assert "vLLM&#x27;s auto binding" in listed and "unpinned, 6 threads" in listed
    _stop(alone)
    assert _run(alone) == ("0-4", None)  # restarted beside an unpinned neighbour: every core is free
    _stop(beside)
    assert _run(beside) == ("6-10", None)
    assert not first.events.filter(kind="cpu-share").exists()
