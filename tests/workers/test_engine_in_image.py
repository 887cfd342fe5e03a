"""A containerised node's engine is its image's: the agent probes the versions and vLLM's parser in a
container of the image its replicas run in (endpoints.commands.container.probe_container_command), not in the
host's engine venv, which such a host may not even have. The stand-in `docker` (tests/support/fake_docker.py)
plays the image with a python of the test's choosing; the run with the real engine venv in the image (and
its parser) is tests/e2e/test_container_runtime.py."""

import os
import sys
import time

import psutil
import pytest

from endpoints.commands import CommandSpecError
from endpoints.commands.container import ASCEND_DRIVER_MOUNTS, probe_container_command
from tests.support.fake_docker import calls, client_settings, image_id, install, set_image_id
from workers.agent import NodeAgent
from workers.engine_info import EngineSite, engine_cli, engine_fingerprint, probe_engine, probe_engine_cli
from workers.models import Node

IMAGE = "quay.io/ascend/vllm-ascend:v0.23.0"


def test_the_probe_runs_the_images_python_as_a_replica_would_without_devices_or_network():
    argv = probe_container_command(
        runtime="podman", image=IMAGE, name="llm-console-probe-0a1b", env={"A": "1"}, python_args=["-c", "print(1)"]
    )
    assert argv[:7] == ["podman", "run", "--rm", "--pull=never", "--name", "llm-console-probe-0a1b", "--net=none"]
    mounts = [argv[i + 1] for i, a in enumerate(argv) if a == "-v"]
    assert mounts == list(ASCEND_DRIVER_MOUNTS) and "--device" not in argv and "-d" not in argv
    assert argv[argv.index(IMAGE) - 2 :] == [
        "-e",
        "A=1",
        IMAGE,
        "bash",
        "-ic",
        'exec "$@"',
        "bash",
        "python3",
        "-c",
        "print(1)",
    ]
    with pytest.raises(CommandSpecError, match="image must be a reference"):
        probe_container_command(
            runtime="docker", image="x;rm -rf /", name="llm-console-probe-0a1b", env={}, python_args=[]
        )
    lowered = probe_container_command(
        runtime="docker", image=IMAGE, name="llm-console-probe-0a1b", env={}, python_args=["-c", "print(1)"], nice=10
    )
    assert lowered[lowered.index(IMAGE) + 1 :] == [
        "bash",
        "-ic",
        'exec "$@"',
        "bash",
        "nice",
        "-n",
        "10",
        "python3",
        "-c",
        "print(1)",
    ]


def test_the_parser_probe_runs_lowered_inside_the_container(docker, tmp_path):
    """vLLM's parser probe imports vLLM and torch (seconds of CPU) beside serving replicas, at nice 10: inside
    the container, whose processes are the daemon's children, not the CLI client's."""
    image_python = tmp_path / "image-python"
    image_python.write_text(f"#!/bin/sh\nnice > {tmp_path / 'niceness'}\nexec {sys.executable} \"$@\"\n")
    image_python.chmod(0o755)
    install(tmp_path / "bin", state=docker, image_python=str(image_python))
    probe_engine_cli(EngineSite(runtime="docker", image=IMAGE))
    [run] = calls(docker)
    assert run[run.index(IMAGE) + 5 : run.index(IMAGE) + 9] == ["nice", "-n", "10", "python3"]
    assert int((tmp_path / "niceness").read_text()) == min(19, os.getpriority(os.PRIO_PROCESS, 0) + 10)


def test_versions_are_read_in_the_image_and_a_missing_image_says_so(docker):
    site = EngineSite(runtime="docker", image=IMAGE)
    engine = probe_engine(site)
    # This run's python plays the image: its versions, and no vLLM in it.
    assert (
        engine["python"] == sys.version.split()[0] and engine["error"] == f"vLLM is not installed in the image {IMAGE}"
    )
    inspect, run = calls(docker)
    assert inspect == ["image", "inspect", "--format", "{{.Id}}", IMAGE]
    assert run[:3] == ["run", "--rm", "--pull=never"] and run[run.index("--name") + 1].startswith("llm-console-probe-")
    assert not list((docker / "containers").glob("*.json"))  # --rm: gone
    assert engine_fingerprint(site, {"vllm": "0.11.0"}) != engine_fingerprint(
        EngineSite(python=sys.executable), {"vllm": "0.11.0"}
    )

    (docker / "images").write_text("quay.io/ascend/vllm-ascend:v0.11.0\n")  # only another tag was pulled
    assert probe_engine(site)["error"].startswith(f"engine probe failed ({IMAGE} under docker): ")


def test_the_same_tag_pulled_again_is_another_engine_to_the_parser_check(docker, monkeypatch, settings, tmp_path):
    """The parser report is kept per fingerprint (workers.engine_info.engine_cli): the image's id is in it, so a
    tag pulled again after a rebuild (the same vLLM and vllm-ascend versions, perhaps patched) is probed again.
    Every call reaches the daemon the node's CLI is set to (DOCKER_HOST), as the replicas' runs do."""
    monkeypatch.setenv("DOCKER_HOST", "unix:///run/user/1000/docker.sock")
    site = EngineSite(runtime="docker", image=IMAGE)
    first = probe_engine(site)
    assert first["image_id"].startswith("sha256:") and len(first["image_id"]) == 71
    set_image_id(docker, IMAGE, "sha256:" + "1" * 64)
    again = probe_engine(site)
    assert again["image_id"] == "sha256:" + "1" * 64
    versions = {"vllm": "0.11.0", "vllm_ascend": "0.11.0"}
    assert engine_fingerprint(site, {**again, **versions}) != engine_fingerprint(site, {**first, **versions})
    assert [c[:2] for c in calls(docker)] == [["image", "inspect"], ["run", "--rm"]] * 2
    assert client_settings(docker) == [{"DOCKER_HOST": "unix:///run/user/1000/docker.sock"}] * 4
    # The parser is read in a container of the image the fingerprint names, by its id: not of whatever the
    # tag names by the time the probe starts.
    settings.DATA_DIR = tmp_path / "data"
    set_image_id(docker, IMAGE, "sha256:" + "3" * 64)
    engine_cli(site, {**again, **versions})
    run = calls(docker)[-1]
    assert run[:2] == ["run", "--rm"] and "sha256:" + "1" * 64 in run and IMAGE not in run


def test_an_images_versions_are_read_once_per_image_id(docker, tmp_path, settings):
    """Its package metadata cannot change under one id: the container start with the driver mounts (every
    doctor pass) is spent once per id, and again when the tag names another image."""
    settings.DATA_DIR = tmp_path / "data"
    image_python = tmp_path / "image-python"  # the image's python3: what the version probe reads there
    image_python.write_text('#!/bin/sh\necho \'{"vllm": "0.23.0", "vllm_ascend": "0.23.0", "python": "3.11.13"}\'\n')
    image_python.chmod(0o755)
    install(tmp_path / "bin", state=docker, image_python=str(image_python))
    site = EngineSite(runtime="docker", image=IMAGE)
    first = probe_engine(site)
    assert first["vllm_ascend"] == "0.23.0" and first["image_id"] == image_id(docker, IMAGE) and "error" not in first
    assert probe_engine(site) == first
    assert [c[0] for c in calls(docker)] == ["image", "run", "image"]  # the second: its id only
    run = calls(docker)[1]  # by the id just read: a tag pulled again meanwhile is not read under this id
    assert image_id(docker, IMAGE) in run and IMAGE not in run
    set_image_id(docker, IMAGE, "sha256:" + "2" * 64)  # pulled again
    assert probe_engine(site)["image_id"] == "sha256:" + "2" * 64
    assert [c[0] for c in calls(docker)] == ["image", "run", "image", "image", "run"]
    # A report that cannot be kept (DATA_DIR unwritable, a full disk) is returned, and read again next time.
    settings.DATA_DIR = tmp_path / "not-a-dir"
    (tmp_path / "not-a-dir").write_text("a file")
    assert probe_engine(site)["vllm"] == "0.23.0" and probe_engine(site)["vllm"] == "0.23.0"
    assert [c[0] for c in calls(docker)][5:] == ["image", "run", "image", "run"]


def test_a_probe_that_hangs_is_killed_and_its_container_removed(docker, tmp_path, monkeypatch):
    monkeypatch.setenv("CONTAINER_HOST", "unix:///run/podman/podman.sock")  # removed on the daemon it ran on
    hanging = tmp_path / "hanging-python"
    hanging.write_text("#!/bin/sh\nexec sleep 60\n")
    hanging.chmod(0o755)
    install(tmp_path / "bin", state=docker, image_python=str(hanging))
    started = time.monotonic()
    engine = probe_engine(EngineSite(runtime="docker", image=IMAGE), timeout=2)
    assert engine["error"].startswith("engine probe failed: ") and "timed out" in engine["error"]
    assert time.monotonic() - started < 30
    inspect, run, rm = calls(docker)
    assert rm == ["rm", "-f", run[run.index("--name") + 1]]
    assert client_settings(docker) == [{"CONTAINER_HOST": "unix:///run/podman/podman.sock"}] * 3
    assert not list((docker / "containers").glob("*.json"))
    assert not [p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == ["sleep", "60"]]


@pytest.mark.django_db
def test_a_docker_node_records_its_images_engine_not_the_hosts(docker, ascend_node, settings, tmp_path):
    """The node's page shows the image's versions; back to the process runtime, the host's again."""
    settings.DATA_DIR = tmp_path
    Node.objects.filter(pk=ascend_node.pk).update(engine_runtime="docker")
    agent = NodeAgent(ascend_node.name, engine_python="/opt/no-engine/bin/python")  # a host without a venv
    node = agent.register()
    assert node.engine["python"] == sys.version.split()[0]
    assert node.compat_warnings[0] == f"vLLM is not installed in the image {IMAGE}"
    agent.check_engine_cli()
    assert Node.objects.get(pk=node.pk).engine_cli == {}  # no vLLM in this image: nothing to check against

    Node.objects.filter(pk=node.pk).update(engine_runtime="process")
    agent.check_engine_cli()
    node.refresh_from_db()
    assert node.engine["error"].startswith("engine python /opt/no-engine/bin/python not found")
    assert node.compat_warnings[0] == node.engine["error"] and len(calls(docker)) == 4  # two probes, each an inspect


@pytest.mark.django_db
def test_the_doctor_of_a_docker_node_checks_the_images_engine(docker, monkeypatch):
    from workers.doctor import FAILED, host_report

    monkeypatch.setenv("NODE_PLATFORM", "ascend")
    monkeypatch.setenv("DOCKER_CONTEXT", "npu-daemon")  # the node's CLI is set to another daemon
    report = host_report(engine_python="/opt/no-engine/bin/python", runtime="docker", image=IMAGE)
    checks = {c["name"]: c for c in report["checks"]}
    engine = checks["vLLM and vllm-ascend (in the image)"]
    assert engine["status"] == FAILED and engine["detail"] == f"vLLM is not installed in the image {IMAGE}"
    assert engine["fix"].startswith(f"pull an image with vLLM (replicas run {IMAGE})")
    assert not [name for name in checks if "torch" in name.lower()]  # torch-npu sees chips only in a replica
    assert checks["container runtime"]["status"] == "ok"
    short_id = image_id(docker, IMAGE).removeprefix("sha256:")[:12]  # the stand-in's id for the reference
    assert checks["container runtime"]["detail"].endswith(f"{IMAGE} is here ({short_id})")
    assert {tuple(c.items()) for c in client_settings(docker)} == {(("DOCKER_CONTEXT", "npu-daemon"),)}


def test_an_image_the_runner_refuses_is_an_error_not_a_crash(docker):
    engine = probe_engine(EngineSite(runtime="docker", image="Not An Image"))
    assert engine["error"].startswith("engine probe failed: image must be a reference") and calls(docker) == []


@pytest.mark.django_db
def test_a_runtime_change_on_the_page_nudges_the_agent_to_read_the_engine_again(
    ascend_node, admin, monkeypatch, django_capture_on_commit_callbacks
):
    """The engine probes run at the doctor's interval (10 min), and at once when the node's runtime or image
    changed: launches are not checked against the engine the node had."""
    from workers import nudges
    from workers.services import node_set_engine_runtime

    monkeypatch.setenv("NODE_PLATFORM", "ascend")
    agent = NodeAgent(ascend_node.name, engine_python="/opt/no-engine/bin/python")
    agent.register()
    agent.last_doctor = time.monotonic()
    assert not agent.doctor_due()
    woken = []
    monkeypatch.setattr(nudges, "publish", woken.append)
    with django_capture_on_commit_callbacks(execute=True):
        node_set_engine_runtime(
            node=Node.objects.get(pk=ascend_node.pk), engine_runtime="docker", engine_image_variant="a3", user=admin
        )
    assert woken == [ascend_node.name] and agent.doctor_due()
    assert agent.engine_site() == EngineSite(runtime="docker", image=IMAGE + "-a3")
