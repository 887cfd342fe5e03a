"""deploy/kubernetes: each overlay rendered by kustomize (kubectl's own, `kubectl kustomize`) and the
result validated by kubernetes-validate against the schemas of Kubernetes 1.37 (--strict: no unknown field)."""

import shutil
from pathlib import Path

import pytest
import yaml

from tests.deploy.tools import DEPLOY, assert_clean, assert_refused, run, tool

KUBERNETES = DEPLOY / "kubernetes"
OVERLAYS = sorted(path.parent for path in (KUBERNETES / "overlays").glob("*/kustomization.yaml"))


def kustomize(folder: Path):
    return run([tool("kubectl"), "kustomize", str(folder)])


def validate(manifests: Path):
    return run([tool("kubernetes-validate"), "--strict", "--quiet", str(manifests)])


def rendered(overlay: Path, tmp_path: Path) -> tuple[Path, list[dict]]:
    done = kustomize(overlay)
    assert done.returncode == 0, done.stderr
    manifests = tmp_path / f"{overlay.name}.yaml"
    manifests.write_text(done.stdout)
    return manifests, [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def test_the_overlays_are_there():
    assert [overlay.name for overlay in OVERLAYS] == ["external-services", "in-cluster"]


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda path: path.name)
def test_overlay_renders_and_validates(overlay, tmp_path):
    manifests, objects = rendered(overlay, tmp_path)
    assert_clean(validate(manifests))
    kinds = {(obj["kind"], obj["metadata"]["name"]) for obj in objects}
    assert {
        ("Deployment", "llm-console-web"),
        ("Service", "llm-console-web"),
        ("DaemonSet", "llm-console-agent"),
        ("Deployment", "llm-console-gateway"),
        ("PersistentVolumeClaim", "llm-console-data"),
    } <= kinds
    in_cluster = {("StatefulSet", "llm-console-postgres"), ("StatefulSet", "llm-console-redis")}
    assert in_cluster & kinds == (in_cluster if overlay.name == "in-cluster" else set())
    # Secrets come from the Secret the site makes, never from these files.
    assert "Secret" not in {kind for kind, _ in kinds}


def test_the_agent_runs_on_ascend_device_plugin_nodes(tmp_path):
    _, objects = rendered(OVERLAYS[0], tmp_path)
    agent = next(obj for obj in objects if obj["kind"] == "DaemonSet")["spec"]["template"]["spec"]
    assert agent["nodeSelector"] == {"accelerator": "huawei-Ascend910"}
    assert "huawei.com/Ascend910" in agent["containers"][0]["resources"]["limits"]
    for obj in objects:  # every pod runs as the image's user, not root
        if obj["kind"] in {"Deployment", "DaemonSet"}:
            assert obj["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True, obj["metadata"]


def test_only_the_ingress_controller_reaches_the_web_port(tmp_path):
    """The console trusts the last X-Forwarded-For entry (BEHIND_PROXY): a pod reaching the port directly
    could choose its own address for the login lockout and the audit log."""
    _, objects = rendered(OVERLAYS[0], tmp_path)
    [policy] = [obj for obj in objects if obj["kind"] == "NetworkPolicy"]
    web = next(obj for obj in objects if obj["kind"] == "Deployment" and obj["metadata"]["name"] == "llm-console-web")
    selected = policy["spec"]["podSelector"]["matchLabels"]
    assert selected.items() <= web["spec"]["template"]["metadata"]["labels"].items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert policy["spec"]["ingress"] == [
        {
            "from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress-nginx"}}}],
            "ports": [{"port": "http"}],
        }
    ]
    config = next(obj for obj in objects if obj["kind"] == "ConfigMap")["data"]
    assert config["BEHIND_PROXY"] == "true"


def test_kustomize_refuses_a_missing_resource(tmp_path):
    base = tmp_path / "base"
    shutil.copytree(KUBERNETES / "base", base)
    (base / "gateway.yaml").unlink()
    assert_refused(kustomize(base), "gateway.yaml")


def test_kubernetes_validate_refuses_a_wrong_field(tmp_path):
    manifests, _ = rendered(OVERLAYS[0], tmp_path)
    manifests.write_text(
        manifests.read_text()
        .replace("containerPort: 8000", "containerPort: http-port", 1)
        .replace("readinessProbe:", "readynessProbe:", 1)
    )
    assert_refused(validate(manifests), "containerPort", "readynessProbe")
