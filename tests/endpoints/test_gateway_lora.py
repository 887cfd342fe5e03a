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


@pytest.mark.django_db(transaction=True)
def test_an_adapter_no_replica_holds_is_loaded_on_request_where_the_endpoint_allows(fakes, gateway, admin):
    """Issue 36: the gateway "loads it on a replica when none does (if the endpoint allows)": a request naming a
    registered adapter of the model is held while the adapter loads on every ready replica of an endpoint with
    adapters_on_demand, then routed there; the load is the endpoint's (its list, an event, an audit by the gateway).
    Elsewhere the name is unknown (404), and a key not scoped to it gets the same 404 (as for an unknown model)
    before anything loads."""
    from console.models import AuditEvent
    from endpoints.models import Endpoint, EndpointEvent

    a1, a2, b = fakes("a1"), fakes("a2"), fakes("b")
    ep_a = make_endpoint("ep-a", [a1, a2], model="tiny")
    ep_b = make_endpoint("ep-b", [b], model="plain")  # another model, no on-demand loading
    Endpoint.objects.filter(pk=ep_a.pk).update(adapters_on_demand=True, max_lora_rank=8, max_loras=2)
    sue = Artifact.objects.create(model=ep_a.artifact.model, name="sue", format="lora", path="/models/sue")
    Artifact.objects.create(model=ep_a.artifact.model, name="wip", format="lora", path="/m/wip", status="building")
    _, all_raw = services.key_create(name="app-all", actor=admin)
    _, plain_raw = services.key_create(name="app-plain", endpoints=["ep-b"], actor=admin)
    gw = gateway()
    gw.wait_routes("tiny", 2)

    assert (
        gw.post("/v1/chat/completions", plain_raw, chat("sue")).status_code == 404
    )  # ep-a is not its endpoint: as if unknown
    assert gw.post("/v1/chat/completions", all_raw, chat("wip")).status_code == 404  # not ready: not loadable
    assert not [p for f in (a1, a2, b) for p, _ in f.posts if p.endswith("lora_adapter")]

    answer = gw.post("/v1/chat/completions", all_raw, chat("sue"))
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"] in ("hello from a1", "hello from a2")
    for replica in (a1, a2):  # loaded on every ready replica, as vLLM's run-time route takes it
        assert ("/v1/load_lora_adapter", {"lora_name": "sue", "lora_path": "/models/sue"}) in replica.posts
    assert not b.posts
    assert list(Endpoint.objects.get(pk=ep_a.pk).adapters.values_list("name", flat=True)) == ["sue"]
    assert EndpointEvent.objects.filter(endpoint=ep_a, kind="adapter-load", message__contains="by gateway").exists()
    audit = AuditEvent.objects.get(action="endpoint.adapter.load")
    assert audit.via == "gateway" and audit.changes["adapter"] == sue.pk and audit.actor is None
    # held now: routed without another load
    assert gw.post("/v1/chat/completions", all_raw, chat("sue")).status_code == 200
    loads = [p for f in (a1, a2) for p, _ in f.posts if p == "/v1/load_lora_adapter"]
    assert len(loads) == 2 and ep_b.adapters.count() == 0
