"""The gateway and LoRA adapters: an adapter's name routes to the replicas of the endpoints holding it (the request's
"model" reaches vLLM unchanged, and vLLM picks the adapter), /v1/models lists the adapters a key may use, and a key
scoped to the base model's name may not use an adapter unless scoped to it or to the endpoint; usage is counted per
adapter (telemetry series per endpoint and adapter)."""

import time

import pytest

from endpoints.gateway import services
from models_registry.models import Artifact
from tests.support.gateway import chat, make_endpoint
from workers.telemetry.models import Point, Series


def _adapter(endpoint, name, **kw):
    adapter = Artifact.objects.create(
        model=endpoint.artifact.model, name=name, format="lora", path=f"/models/{name}", **kw
    )
    endpoint.adapters.add(adapter)
    return adapter


@pytest.mark.django_db(transaction=True)
def test_adapter_names_route_to_the_endpoints_holding_them(fakes, gateway, admin):
    a, b = fakes("a"), fakes("b")
    ep_a = make_endpoint("ep-a", [a], model="tiny")
    make_endpoint("ep-b", [b], model="other")
    _adapter(ep_a, "bob")
    gone = _adapter(ep_a, "old", status="deleted")
    assert gone.status == "deleted"
    _, all_raw = services.key_create(name="app-all", actor=admin)
    _, tiny_raw = services.key_create(name="app-tiny", models=["tiny"], actor=admin)
    _, bob_raw = services.key_create(name="app-bob", models=["bob"], actor=admin)
    _, ep_raw = services.key_create(name="app-ep", endpoints=["ep-a"], actor=admin)
    gw = gateway()
    gw.wait_routes("bob", 1)

    answer = gw.post("/v1/chat/completions", all_raw, chat("bob"))
    assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"] == "hello from a"
    assert a.models[-1] == "bob" and b.served == 0  # forwarded as asked, to ep-a's replica only
    assert gw.post("/v1/chat/completions", bob_raw, chat("bob")).status_code == 200
    assert gw.post("/v1/chat/completions", ep_raw, chat("bob")).status_code == 200
    assert gw.post("/v1/chat/completions", tiny_raw, chat("bob")).status_code == 404  # out of scope: as if absent
    assert gw.post("/v1/chat/completions", bob_raw, chat("tiny")).status_code == 404
    assert gw.post("/v1/chat/completions", all_raw, chat("old")).status_code == 404  # a deleted adapter

    def listed(raw):
        return [m["id"] for m in gw.client.get("/v1/models", headers={"Authorization": f"Bearer {raw}"}).json()["data"]]

    assert listed(all_raw) == ["bob", "other", "tiny"]
    assert listed(bob_raw) == ["bob"] and listed(tiny_raw) == ["tiny"]
    # usage per adapter: requests and tokens per minute of each (endpoint, adapter), none for the base model's
    deadline = time.monotonic() + 15
    while not Series.objects.filter(key=f"e{ep_a.pk}.lora.requests_pm.bob").exists():
        assert time.monotonic() < deadline, "no usage series for the adapter"
        time.sleep(0.3)
    series = Series.objects.get(key=f"e{ep_a.pk}.lora.requests_pm.bob")
    assert series.endpoint_id == ep_a.pk and series.label == "bob"
    assert sum(Point.objects.filter(series=series).values_list("value", flat=True)) > 0
    assert Series.objects.filter(key=f"e{ep_a.pk}.lora.tokens_pm.bob").exists()
    assert not Series.objects.filter(key__contains=".lora.").exclude(key__endswith=".bob").exists()

    # unloaded: the name leaves routing at the next refresh
    ep_a.adapters.clear()
    deadline = time.monotonic() + 10
    while gw.post("/v1/chat/completions", all_raw, chat("bob")).status_code != 404:
        assert time.monotonic() < deadline, "the unloaded adapter still routes"
        time.sleep(0.2)
