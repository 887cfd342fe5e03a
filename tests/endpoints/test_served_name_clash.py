"""Issue 39's probe: a launch whose served_model_name repeats another endpoint's would join that endpoint's gateway
pool and take a share of its keys' traffic. It is refused, naming the field and the other endpoint, unless the
launch is that endpoint's blue-green standby (stage_beside): then it is staged beside it at once and takes no
traffic until a canary or a switch."""

import pytest

from endpoints.gateway.models import GatewayEndpoint
from endpoints.gateway.selectors import routing_table
from endpoints.models import Endpoint, Replica


def _launch(api, tiny_artifact, name, **fields):
    body = {"name": name, "artifact": tiny_artifact.pk, "max_model_len": 256, "enforce_eager": True, **fields}
    return api.post("/api/v1/endpoints", body)


@pytest.mark.django_db
def test_a_served_model_name_of_another_endpoint_is_refused_naming_it(operator, api_for, cpu_node, tiny_artifact):
    api = api_for(operator)
    assert _launch(api, tiny_artifact, "blue", served_model_name="chat").status_code == 201
    refused = _launch(api, tiny_artifact, "intruder", served_model_name="chat")
    assert refused.status_code == 400, refused.content
    message = str(refused.json())
    assert "served_model_name" in message and "blue" in message, message
    assert not Endpoint.objects.filter(name="intruder").exists()
    # Its default, the endpoint's own name, is another endpoint's served name: refused as well.
    refused = _launch(api, tiny_artifact, "chat")
    assert refused.status_code == 400 and "blue" in str(refused.json()), refused.content
    # A stopped endpoint keeps its name: started again, it would share the pool.
    Endpoint.objects.filter(name="blue").update(state="stopped")
    assert _launch(api, tiny_artifact, "again", served_model_name="chat").status_code == 400


@pytest.mark.django_db
def test_a_blue_green_standby_may_repeat_it_and_is_staged_at_once(operator, api_for, cpu_node, tiny_artifact):
    api = api_for(operator)
    blue = _launch(api, tiny_artifact, "blue", served_model_name="chat").json()["id"]
    missing = _launch(api, tiny_artifact, "green", served_model_name="chat", stage_beside="nobody")
    assert missing.status_code == 400 and "stage_beside" in str(missing.json()), missing.content
    other = _launch(api, tiny_artifact, "other", served_model_name="other")
    wrong = _launch(api, tiny_artifact, "green", served_model_name="chat", stage_beside="other")
    assert other.status_code == 201 and wrong.status_code == 400 and "stage_beside" in str(wrong.json())
    assert not Endpoint.objects.filter(name="green").exists()

    made = _launch(api, tiny_artifact, "green", served_model_name="chat", stage_beside="blue")
    assert made.status_code == 201, made.content
    green = made.json()["id"]
    pair = GatewayEndpoint.objects.get(endpoint_id=blue)
    assert pair.staged_id == green and pair.serving == GatewayEndpoint.Serving.LIVE
    # Both ready: the gateway's pool for "chat" is blue's alone (green idles until a canary or a switch).
    Endpoint.objects.filter(pk__in=(blue, green)).update(state="ready")
    for port, replica in enumerate(Replica.objects.filter(endpoint_id__in=(blue, green)), start=9150):
        Replica.objects.filter(pk=replica.pk).update(state="ready", port=port, pid=1)
    backends = routing_table().backends["chat"]
    assert {b.endpoint_id for b in backends} == {blue}, backends
    # A second standby of the same pair is refused, naming the first (staging it would unpair green, which would
    # then join blue's pool).
    third = _launch(api, tiny_artifact, "teal", served_model_name="chat", stage_beside="blue")
    assert third.status_code == 400 and "green" in str(third.json()), third.content
    assert GatewayEndpoint.objects.get(endpoint_id=blue).staged_id == green
