"""The engine runtime on the node's page: Admins choose process, Docker or Podman (vllm-ascend's image,
Ascend nodes only) and the image variant; the change is audited; bad input is named and changes nothing;
other roles are refused on the server. The doctor then checks that node's runtime and image."""

import os
import sys

import pytest

from console.models import AuditEvent
from tests.support.fake_docker import install
from workers.doctor import FAILED, OK, WARNING, check_container_runtime
from workers.models import Node


def post(client, node, **data):
    return client.post(f"/nodes/{node.pk}/engine-runtime", data)


def test_an_admin_chooses_docker_and_the_image_and_it_is_audited(as_admin, admin, ascend_node):
    page = as_admin.get(f"/nodes/{ascend_node.pk}/")
    assert b'id="engine-runtime-form"' in page.content and b"quay.io/ascend/vllm-ascend:v0.23.0" in page.content
    response = post(as_admin, ascend_node, engine_runtime="docker", engine_image_variant="a3")
    assert response.status_code == 302
    node = Node.objects.get(pk=ascend_node.pk)
    assert (node.engine_runtime, node.engine_image_variant) == ("docker", "a3")
    assert node.engine_image() == "quay.io/ascend/vllm-ascend:v0.23.0-a3"
    event = AuditEvent.objects.get(action="node.engine_runtime")
    assert event.object_id == str(node.pk) and event.actor_name == admin.username
    assert event.changes == {
        "engine_runtime": ["process", "docker"],
        "engine_image_variant": ["auto", "a3"],
        "image": "quay.io/ascend/vllm-ascend:v0.23.0-a3",
    }
    page = as_admin.get(f"/nodes/{ascend_node.pk}/")
    assert b"in <code>quay.io/ascend/vllm-ascend:v0.23.0-a3</code>" in page.content
    # The same again changes nothing and writes no second event.
    post(as_admin, ascend_node, engine_runtime="docker", engine_image_variant="a3")
    assert AuditEvent.objects.filter(action="node.engine_runtime").count() == 1


@pytest.mark.parametrize(
    "data, field, message",
    [
        (
            {"engine_runtime": "lxc", "engine_image_variant": "auto"},
            "engine_runtime",
            "Engine runtime must be one of process, docker, podman; got &#x27;lxc&#x27;.",
        ),
        ({"engine_runtime": "", "engine_image_variant": "auto"}, "engine_runtime", "Engine runtime must be one of"),
        (
            {"engine_runtime": "podman", "engine_image_variant": "-950dt"},
            "engine_image_variant",
            (
                "Image must be one of auto, a2, openeuler, a3, a3-openeuler, 310p, 310p-openeuler, a5, a5-openeuler; "
                "got &#x27;-950dt&#x27;."
            ),
        ),
    ],
)
def test_bad_input_is_named_and_changes_nothing(as_admin, ascend_node, data, field, message):
    response = post(as_admin, ascend_node, **data)
    assert response.status_code == 400 and message.encode() in response.content
    node = Node.objects.get(pk=ascend_node.pk)
    assert (node.engine_runtime, node.engine_image_variant) == ("process", "auto")
    assert not AuditEvent.objects.filter(action="node.engine_runtime").exists()


def test_a_container_runtime_is_for_ascend_nodes_only(as_admin, cpu_node):
    response = post(as_admin, cpu_node, engine_runtime="docker", engine_image_variant="auto")
    assert response.status_code == 400
    assert (
        b"Docker (vllm-ascend&#x27;s image) runs vllm-ascend&#x27;s image, which serves Ascend NPUs; cpu-host is a "
        b"CPU node, so its replicas run as processes." in response.content
    )
    assert Node.objects.get(pk=cpu_node.pk).engine_runtime == "process"


@pytest.mark.parametrize("client", ["as_operator", "as_viewer"])
def test_only_admins_change_it(request, client, ascend_node):
    client = request.getfixturevalue(client)
    assert b'id="engine-runtime-form"' not in client.get(f"/nodes/{ascend_node.pk}/").content
    assert post(client, ascend_node, engine_runtime="docker", engine_image_variant="auto").status_code == 403
    assert Node.objects.get(pk=ascend_node.pk).engine_runtime == "process"
    assert not AuditEvent.objects.filter(action="node.engine_runtime").exists()


def test_the_doctor_checks_the_nodes_runtime_and_its_image(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    image = "quay.io/ascend/vllm-ascend:v0.23.0"
    missing = check_container_runtime("podman", image=image)
    assert missing.status == FAILED and missing.fix.startswith("install podman on this node, or set its engine runtime")
    assert check_container_runtime("process") is None
    state = tmp_path / "state"
    install(tmp_path / "bin", state=state, image_python=sys.executable, name="podman")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}/usr/bin:/bin")
    assert check_container_runtime("podman", image=image).status == OK
    (state / "images").write_text("quay.io/ascend/vllm-ascend:v0.22.0\n")  # an older release pulled, not this one
    stale = check_container_runtime("podman", image=image)
    assert stale.status == WARNING and stale.fix == f"podman pull {image} (replicas start with --pull=never)"
