"""A deleted endpoint's directories on its node (endpoints.node_files): its working and profiler directories
go at the agent's next sweep, its logs ENDPOINT_LOG_RETENTION_DAYS after their last write; nothing of an
endpoint that exists, and nothing through a symbolic link."""

import os
import time

import pytest

from endpoints import reconcile as reconcile_module
from endpoints.models import Endpoint, Replica
from endpoints.node_files import SWEEP_EVERY_S, sweep_deleted_endpoints
from endpoints.reconcile import ReplicaWorkload
from endpoints.services import endpoint_delete, endpoint_stop
from tests.endpoints.test_npu_faults import StandInSupervisor


def _age(path, days):
    """Back-dates a file or directory's last write by `days`."""
    then = time.time() - days * 86400
    os.utime(path, (then, then))


@pytest.mark.django_db
def test_a_deleted_endpoints_directories_are_swept_from_its_node(
    admin, cpu_node, tiny_artifact, settings, tmp_path, monkeypatch
):
    settings.DATA_DIR = tmp_path / "data"
    settings.ENDPOINT_PROFILE_ROOT = tmp_path / "data" / "profiles"
    settings.ENDPOINT_LOG_RETENTION_DAYS = 14
    monkeypatch.setattr(reconcile_module, "check_ready", lambda replica: (True, "ok"))
    endpoints = {
        name: Endpoint.objects.create(
            name=name, artifact=tiny_artifact, node=cpu_node, served_model_name=name, profiling=True
        )
        for name in ("chat-a", "chat")
    }  # "chat" is a prefix of the other: "chat-a-0" is not chat's replica 0
    for endpoint in endpoints.values():
        Replica.objects.create(endpoint=endpoint, index=0, node=cpu_node)
    supervisor, workload = StandInSupervisor(), ReplicaWorkload()
    workload.reconcile(node=cpu_node, supervisor=supervisor)  # both start: their directories are made
    work, logs, profiles = (
        tmp_path / "data" / "work" / "endpoints",
        tmp_path / "data" / "logs" / "endpoints",
        tmp_path / "data" / "profiles" / "replicas",
    )
    for name in ("chat-a", "chat"):
        assert (work / name / "replica-0").is_dir() and (profiles / f"{name}-0").is_dir()
        (logs / name).mkdir(parents=True, exist_ok=True)  # the stand-in supervisor writes no log
        (logs / name / "replica-0.log").write_text("served\n")
    outside = tmp_path / "elsewhere"  # what a link in a root points to stays whole
    outside.mkdir()
    (outside / "keep.txt").write_text("not the console's")
    (work / "linked").symlink_to(outside, target_is_directory=True)
    (work / "Not_A_Name").mkdir()

    endpoint_stop(endpoint=endpoints["chat-a"], user=admin)
    workload.reconcile(node=cpu_node, supervisor=supervisor)
    endpoint_delete(endpoint=Endpoint.objects.get(name="chat-a"), user=admin)
    workload.reconcile(node=cpu_node, supervisor=supervisor)
    assert (work / "chat-a").is_dir()  # swept every SWEEP_EVERY_S, not at every pass
    assert workload.next_sweep - time.monotonic() > SWEEP_EVERY_S - 60

    workload.next_sweep = 0.0  # ten minutes on
    workload.reconcile(node=cpu_node, supervisor=supervisor)
    assert not (work / "chat-a").exists() and not (profiles / "chat-a-0").exists()
    assert (logs / "chat-a" / "replica-0.log").read_text() == "served\n"  # kept for a post-mortem
    assert (work / "chat" / "replica-0").is_dir() and (profiles / "chat-0").is_dir() and (logs / "chat").is_dir()
    assert (outside / "keep.txt").exists() and (work / "linked").is_symlink() and (work / "Not_A_Name").is_dir()

    # The logs go once they have not been written for the retention: the newest file counts (a rotated one).
    (logs / "chat-a" / "replica-0.log.1").write_text("older lines\n")
    _age(logs / "chat-a" / "replica-0.log", 20)
    _age(logs / "chat-a", 20)
    assert sweep_deleted_endpoints() == []
    _age(logs / "chat-a" / "replica-0.log.1", 15)
    assert sweep_deleted_endpoints() == [logs / "chat-a"] and not (logs / "chat-a").exists()
    _age(logs / "chat", 30)
    _age(logs / "chat" / "replica-0.log", 30)
    assert sweep_deleted_endpoints() == []  # its endpoint exists: logs stay whatever their age
    assert Replica.objects.get().state == Endpoint.State.READY  # the one left was never touched


@pytest.mark.django_db
def test_a_sweep_that_fails_leaves_the_agents_pass_alone(cpu_node, monkeypatch, caplog):
    """Housekeeping: a root the sweep cannot read (permissions, a stale NFS handle) is logged, and the agent's
    pass goes on; an exception out of the pass ended the agent, and its restart swept again at once."""

    def unreadable():
        raise PermissionError(13, "Permission denied", "/var/lib/llm-console/work/endpoints")

    monkeypatch.setattr(reconcile_module, "sweep_deleted_endpoints", unreadable)
    workload = ReplicaWorkload()
    assert workload.reconcile(node=cpu_node, supervisor=StandInSupervisor()) is False
    assert "sweep of deleted endpoints' files failed" in caplog.text and workload.next_sweep > time.monotonic()


@pytest.mark.django_db
def test_a_log_path_read_back_from_a_row_is_confined_to_the_endpoint_log_folder(
    settings, tmp_path, cpu_node, tiny_artifact, as_operator
):
    """Rows are the agent's own writes; an edited one must not make the web show, or the agent tail, rotate or
    append to, any other file (a link out of the folder included). The log tail is an Operator's to read
    (tests/endpoints/test_log_tail_roles.py)."""
    from endpoints.launch import endpoint_log_root, recorded_log
    from endpoints.reconcile import handle_of

    settings.DATA_DIR = tmp_path
    secret = tmp_path / "secret.txt"
    secret.write_text("top secret\n")
    own = endpoint_log_root() / "e" / "replica-0.log"
    own.parent.mkdir(parents=True)
    own.write_text("vLLM says hello\n")
    link = own.with_name("replica-1.log")
    link.symlink_to(secret)
    assert recorded_log(str(own)) == str(own)
    assert (
        recorded_log(str(secret)) == recorded_log(str(link)) == recorded_log(f"{own.parent}/../../../secret.txt") == ""
    )
    assert recorded_log("") == ""

    endpoint = Endpoint.objects.create(name="e", artifact=tiny_artifact, node=cpu_node, served_model_name="e")
    replica = Replica.objects.create(endpoint=endpoint, index=0, node=cpu_node, log_path=str(secret))
    assert handle_of(replica).log_path == ""
    page = as_operator.get(f"/endpoints/{endpoint.pk}/").content.decode()
    assert "top secret" not in page
    Replica.objects.filter(pk=replica.pk).update(log_path=str(own))
    assert "vLLM says hello" in as_operator.get(f"/endpoints/{endpoint.pk}/").content.decode()
