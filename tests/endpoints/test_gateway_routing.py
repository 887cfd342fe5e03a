"""The gateway's routing policies and canary share: the pure policy (endpoints/gateway/routing.py),
Gateway.pick over it, the settings' services, API and pages (bad input refused naming the field,
nothing changed, audited), and a real gateway process in front of FakeReplicas: a conversation
sticks to one replica under prefix routing, and a 25 % canary takes about a quarter of the requests."""

import asyncio
import math
import random
import time
from collections import Counter
from dataclasses import dataclass

import pytest
from django.core.exceptions import ValidationError

from console.models import AuditEvent
from endpoints.gateway import routing, services
from endpoints.gateway.asgi import Gateway
from endpoints.gateway.models import GatewayEndpoint
from endpoints.gateway.selectors import Backend, RoutingTable, routing_table
from endpoints.models import Endpoint, EndpointEvent, Replica
from tests.support.agents import wait_for
from tests.support.gateway import make_endpoint


@dataclass(frozen=True)
class R:
    url: str


def replicas(n):
    return [R(f"http://10.0.0.{i}:8000") for i in range(1, n + 1)]


def conversation(system: str, first: str, turns: int) -> list[dict]:
    """A chat's messages after `turns` user turns: the same system prompt and first turn throughout."""
    messages = [{"role": "system", "content": system}, {"role": "user", "content": first}]
    for t in range(1, turns):
        messages += [{"role": "assistant", "content": f"answer {t}"}, {"role": "user", "content": f"follow-up {t}"}]
    return messages


def key_of(payload, **kw):
    return routing.digest(routing.prefix_key(payload, **kw))


# --- the pure policy ------------------------------------------------------------------------------


def test_prefix_key_is_the_start_of_a_conversation_bounded():
    first = {"messages": conversation("You are terse.", "What is a KV cache?", 1)}
    later = {"messages": conversation("You are terse.", "What is a KV cache?", 4)}
    other = {"messages": conversation("You are terse.", "What is paged attention?", 1)}
    assert routing.prefix_key(first) == routing.prefix_key(later)  # every turn: one key
    assert routing.prefix_key(first) != routing.prefix_key(other)
    # Bounded: a huge system prompt gives a key of at most `chars` characters of content.
    huge = {"messages": conversation("x" * 1_000_000, "hi", 3)}
    assert len(routing.prefix_key(huge, chars=512)) < 600
    assert routing.prefix_key(huge, chars=512) == routing.prefix_key(
        {"messages": conversation("x" * 600, "something else", 1)}, chars=512
    )
    # Content parts: their text, in order.
    parts = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "describe"},
                    {"type": "image_url", "image_url": {"url": "http://i/1.png"}},
                ],
            }
        ]
    }
    assert b"describe" in routing.prefix_key(parts) and b"http://i/1.png" in routing.prefix_key(parts)
    # Completions: the prompt's first characters, token ids, a batch's first prompt.
    assert routing.prefix_key({"prompt": "abc" * 1000}, chars=100) == ("abc" * 1000)[:100].encode()
    ids = routing.prefix_key({"prompt": list(range(1000))}, tokens=128)
    assert ids == routing.prefix_key({"prompt": list(range(128)) + [7, 7, 7]}, tokens=128)
    assert ids != routing.prefix_key({"prompt": list(range(1, 129))}, tokens=128)
    assert routing.prefix_key({"prompt": ["first", "second"]}) == b"first"
    for nothing in (
        {},
        {"prompt": ""},
        {"prompt": []},
        {"messages": []},
        {"prompt": [1.5, 2]},
        {"prompt": [-1]},
        {"prompt": {"a": 1}},
        {"prompt": [[1.5]]},
    ):
        assert routing.prefix_key(nothing) is None, nothing


def test_a_key_stays_on_its_first_replica_and_new_keys_balance():
    rs, idle = replicas(4), {}
    homes = routing.PrefixHomes()
    key = key_of({"prompt": "A shared system prompt. Question 1"})
    first = homes.pick(key, rs, idle)
    assert all(homes.pick(key, rs, idle) == first for _ in range(20))
    # Sticky whatever the candidates' order and whatever the loads within the bound.
    assert homes.pick(key, list(reversed(rs)), {r.url: 2 for r in rs}) == first
    # New keys at equal loads: each to the replica home to the fewest keys, so they split evenly
    # (rendezvous hashing alone split the benchmark's 48 groups 26/22).
    for i in range(1999):
        homes.pick(key_of({"prompt": f"prefix {i}"}), rs, idle)
    assert sorted(homes.keys_of.values()) == [500, 500, 500, 500] and len(homes) == 2000
    # Two gateways seeing the same keys in the same order agree (ties end in rendezvous order).
    other = routing.PrefixHomes()
    keys = [key_of({"prompt": f"group {i}"}) for i in range(48)]
    assert [homes.pick(k, rs, idle) for k in keys] == [other.pick(k, list(reversed(rs)), idle) for k in keys]


def test_a_canarys_two_sides_keep_their_own_prefix_homes():
    """A conversation homed on the live side, its request sent to the staged side: under one key for both,
    the staged side routed it by rendezvous order alone (here to its busy replica) and counted no home there;
    keyed per side (routing.home_key), it is a new key there and goes to the least loaded replica."""
    live, staged = replicas(2), [R("http://10.0.1.1:8000"), R("http://10.0.1.2:8000")]
    busy = {staged[0].url: 3}
    homes = routing.PrefixHomes()
    leading = next(
        lead
        for lead in (f"conversation {i}".encode() for i in range(200))
        if routing.rendezvous_order(routing.home_key(model="m", staged=False, leading=lead), staged)[0] == staged[0]
    )
    as_live = routing.home_key(model="m", staged=False, leading=leading)
    homes.pick(as_live, live, {}, slack=8)
    assert homes.pick(as_live, staged, busy, slack=8) == staged[0]  # one key for both sides: the busy one
    as_staged = routing.home_key(model="m", staged=True, leading=leading)
    assert homes.pick(as_staged, staged, busy, slack=8) == staged[1] and homes.keys_of[staged[1].url] == 1
    assert routing.home_key(model="other", staged=False, leading=leading) != as_live  # per model too


def test_a_new_key_goes_to_the_least_loaded_replica():
    rs = replicas(3)
    homes = routing.PrefixHomes()
    load = {rs[0].url: 3, rs[1].url: 1, rs[2].url: 2}
    key = key_of({"prompt": "a conversation"})
    assert homes.pick(key, rs, load) == rs[1] and homes.home_of(key) == rs[1].url
    # Later requests stay there though another replica is less loaded now (its cache holds the prefix).
    assert homes.pick(key, rs, {rs[0].url: 0, rs[1].url: 3, rs[2].url: 0}, slack=8) == rs[1]
    assert homes.pick(b"", [], {}) is None


def test_bounded_load_overflows_a_hot_key_in_its_rendezvous_order_and_keeps_its_home():
    rs = replicas(3)
    homes = routing.PrefixHomes()
    key = key_of({"prompt": "hot prefix"})
    home = homes.pick(key, rs, {})
    order = [r for r in routing.rendezvous_order(key, rs) if r != home]
    load = {home.url: 10, order[0].url: 0, order[1].url: 0}
    # ceil(1.25 * 11 / 3) = 5: the home (10 in flight) is over the bound, the first other in the key's order takes it.
    assert homes.pick(key, rs, load) == order[0]
    load = {home.url: 5, order[0].url: 5, order[1].url: 0}  # bound ceil(1.25 * 11 / 3) = 5
    assert homes.pick(key, rs, load) == order[1]
    # The key kept its home: back there once it is within the bound.
    load = {home.url: 3, order[0].url: 2, order[1].url: 2}  # bound ceil(1.25 * 8 / 3) = 4
    assert homes.pick(key, rs, load) == home and homes.home_of(key) == home.url
    # Whatever the loads, a pick never exceeds the bound (Mirrokni et al.'s guarantee), new keys or homed.
    rnd = random.Random(3)
    for i in range(500):
        load = {r.url: rnd.randint(0, 20) for r in rs}
        for k in (key, key_of({"prompt": f"other {i}"})):
            pick = homes.pick(k, rs, load)
            assert load[pick.url] + 1 <= math.ceil(1.25 * (sum(load.values()) + 1) / 3)
    # A factor below 1 can leave every replica over the bound: least outstanding then.
    load = {home.url: 5, order[0].url: 3, order[1].url: 1}
    assert homes.pick(key, rs, load, factor=0.1) == order[1]


def test_load_slack_keeps_a_prefix_on_its_replica_up_to_that_many_extra_requests():
    rs = replicas(2)
    homes = routing.PrefixHomes()
    key = key_of({"prompt": "system prompt of one tenant"})
    first = homes.pick(key, rs, {})
    second = next(r for r in rs if r != first)
    # 3 in flight, all on its home: ceil(1.25 * 4 / 2) = 3 without slack, so it overflows...
    load = {first.url: 3, second.url: 0}
    assert homes.pick(key, rs, load) == second
    # ...with a slack of 2 the bound is 5: it stays, until its home runs 5.
    assert homes.pick(key, rs, load, slack=2) == first
    load = {first.url: 5, second.url: 0}  # bound ceil(1.25 * 6 / 2) + 2 = 6
    assert homes.pick(key, rs, load, slack=2) == first
    load = {first.url: 6, second.url: 0}  # bound ceil(1.25 * 7 / 2) + 2 = 7: 6 + 1 fits
    assert homes.pick(key, rs, load, slack=2) == first
    load = {first.url: 9, second.url: 0}  # bound ceil(1.25 * 10 / 2) + 2 = 9: 9 + 1 does not
    assert homes.pick(key, rs, load, slack=2) == second


def test_a_replica_leaving_moves_only_its_own_keys_and_one_joining_takes_new_keys():
    rs = replicas(5)
    homes = routing.PrefixHomes()
    keys = [key_of({"prompt": f"conversation {i}"}) for i in range(3000)]
    before = {k: homes.pick(k, rs, {}) for k in keys}
    gone = rs[2]
    # Down, tried or full for a moment: its keys overflow but keep their home.
    assert all(homes.pick(k, [r for r in rs if r != gone], {}) != gone for k in keys)
    assert all(homes.home_of(k) == before[k].url for k in keys)
    # Out of the routing table: its homes are forgotten and only its keys move.
    homes.keep_only(frozenset(r.url for r in rs if r != gone))
    after = {k: homes.pick(k, [r for r in rs if r != gone], {}) for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert len(moved) == 600 and all(before[k] == gone for k in moved)
    assert sorted(homes.keys_of.values()) == [750] * 4  # the leaver's keys spread evenly
    # A replica joining: the keys in use stay (their caches are where they are), new keys go to it.
    new, rs = R("http://10.0.0.99:8000"), [r for r in rs if r != gone]
    assert all(homes.pick(k, [*rs, new], {}) == after[k] for k in keys)
    fresh = [homes.pick(key_of({"prompt": f"new conversation {i}"}), [*rs, new], {}) for i in range(100)]
    assert set(fresh) == {new}


def test_homes_are_forgotten_when_idle_and_beyond_the_most_kept():
    now = [1000.0]
    homes = routing.PrefixHomes(idle_seconds=600, max_keys=3, clock=lambda: now[0])
    rs = replicas(2)
    a, b, c, d = (key_of({"prompt": p}) for p in "abcd")
    homes.pick(a, rs, {})
    now[0] += 500
    homes.pick(b, rs, {})
    now[0] += 200  # a: 700 s idle, b: 200 s
    homes.pick(c, rs, {})
    assert homes.home_of(a) is None and homes.home_of(b) and len(homes) == 2
    homes.pick(b, rs, {})  # used again: now the most recent
    homes.pick(d, rs, {})
    homes.pick(a, rs, {})  # a fourth key: the least recently used (c) goes
    assert homes.home_of(c) is None and len(homes) == 3 and sum(homes.keys_of.values()) == 3


def test_least_outstanding_and_the_canary_coin():
    rs = replicas(3)
    assert routing.least_outstanding(rs, {rs[0].url: 2, rs[1].url: 0, rs[2].url: 1}) == rs[1]
    assert routing.least_outstanding([], {}) is None
    assert {routing.least_outstanding(rs, {}, rnd=random.Random(s).choice) for s in range(30)} == set(rs)
    rnd = random.Random(25)
    n = 4000
    staged = sum(routing.staged_takes_it(25, rnd.random) for _ in range(n))
    assert abs(staged - n * 0.25) <= 4 * math.sqrt(n * 0.25 * 0.75), staged
    assert not any(routing.staged_takes_it(0, rnd.random) for _ in range(100))


def backend(url, ep=1, **kw):
    return Backend(
        url=url, endpoint_id=ep, endpoint_name=f"ep{ep}", replica_index=0, queue_depth=kw.pop("depth", 100), **kw
    )


def test_gateway_pick_sides_prefix_and_fallbacks():
    gw = Gateway()
    live = [backend("http://l1", 1, prefix=True), backend("http://l2", 1, prefix=True)]
    staged = [backend("http://s1", 2, staged=True, canary_percent=25)]
    both = live + staged
    assert gw.pick(both, set(), staged=True) == staged[0]
    assert gw.pick(both, set(), staged=False) in live
    # The staged side down (or tried, or its endpoint full): the live side takes the request.
    gw.down_until["http://s1"] = time.monotonic() + 60
    assert gw.pick(both, set(), staged=True) in live
    gw.down_until.clear()
    assert gw.pick(both, {"http://s1"}, staged=True) in live
    gw.ep_outstanding[2] = 100
    assert gw.pick(both, set(), staged=True) in live
    gw.ep_outstanding[2] = 0
    # Prefix-aware on the live side: one key, one replica (its home), until it is over the bound.
    key = key_of({"prompt": "same start"})
    first = gw.pick(both, set(), staged=False, key=key)
    assert all(gw.pick(both, set(), staged=False, key=key) == first for _ in range(10))
    # 5 in flight on it: ceil(1.25 * 6 / 2) = 4, + GATEWAY_PREFIX_LOAD_SLACK (8) = 12: it stays...
    gw.outstanding[first.url] = 5
    assert gw.pick(both, set(), staged=False, key=key) == first
    # ...until it runs more than that.
    gw.outstanding[first.url] = 40
    assert gw.pick(both, set(), staged=False, key=key) not in (first, staged[0])
    # A side with a least-outstanding endpoint in it is not routed by prefix.
    gw.outstanding.clear()
    mixed = [live[0], backend("http://l3", 3)]
    gw.outstanding["http://l3"] = 1
    assert all(gw.pick(mixed, set(), key=routing.digest(bytes([i]))) == live[0] for i in range(20))
    assert gw.pick(both, {"http://l1", "http://l2", "http://s1"}) is None


def test_a_routing_table_refresh_forgets_the_homes_of_replicas_that_left(monkeypatch):
    from endpoints.gateway import asgi

    gw = Gateway()
    a, b = backend("http://a", 1, prefix=True), backend("http://b", 1, prefix=True)
    tables = iter([RoutingTableOf(a, b), RoutingTableOf(b)])
    monkeypatch.setattr(asgi, "routing_table", lambda: next(tables))
    asyncio.run(gw.refresh_table())
    keys = [routing.digest(bytes([i])) for i in range(10)]
    homes = {k: gw.pick([a, b], set(), key=k).url for k in keys}
    assert set(homes.values()) == {"http://a", "http://b"}
    asyncio.run(gw.refresh_table())  # a is no longer routed (stopped, drained, or the other side of a switch)
    assert all(gw.prefix_homes.home_of(k) == (None if homes[k] == "http://a" else "http://b") for k in keys)


def RoutingTableOf(*backends):
    return RoutingTable(backends={"tiny": list(backends)}, known={"tiny": {"ep1"}}, max_queue={1: 100}, prefix={"tiny"})


# --- settings: services, API, pages ---------------------------------------------------------------


@pytest.mark.django_db
def test_routing_on_launch_and_patch_refusing_bad_values(operator, viewer, api_for, cpu_node, tiny_artifact):
    api = api_for(operator)
    bad = api.post("/api/v1/endpoints", {"name": "r-bad", "artifact": tiny_artifact.pk, "routing": "round-robin"})
    assert bad.status_code == 400 and "routing" in bad.json()["errors"], bad.content
    assert not Endpoint.objects.filter(name="r-bad").exists()
    made = api.post("/api/v1/endpoints", {"name": "r-prefix", "artifact": tiny_artifact.pk, "routing": "prefix"})
    assert made.status_code == 201 and made.json()["routing"] == "prefix", made.content
    plain = api.post("/api/v1/endpoints", {"name": "r-plain", "artifact": tiny_artifact.pk}).json()
    assert plain["routing"] == "least-outstanding"
    launch = AuditEvent.objects.get(action="endpoint.launch", object_id=str(made.json()["id"]))
    assert launch.changes["routing"] == "prefix"

    url = f"/api/v1/endpoints/{plain['id']}"
    for body, field, status in [
        ({"routing": "fastest"}, "routing", 400),
        ({"routing": 3}, "routing", 422),
        ({"routng": "prefix"}, "routng", 422),
    ]:
        refused = api.patch(url, body)
        assert refused.status_code == status and field in refused.content.decode(), refused.content
    assert Endpoint.objects.get(pk=plain["id"]).routing == "least-outstanding"
    assert not AuditEvent.objects.filter(action="endpoint.update").exists()
    assert api_for(viewer).patch(url, {"routing": "prefix"}).status_code == 403

    changed = api.patch(url, {"routing": "prefix"})
    assert changed.status_code == 200 and changed.json()["routing"] == "prefix"
    audit = AuditEvent.objects.get(action="endpoint.update")
    assert audit.changes == {"routing": ["least-outstanding", "prefix"]} and audit.actor == operator
    assert EndpointEvent.objects.filter(endpoint_id=plain["id"], kind="updated").exists()
    assert api.patch(url, {}).json()["routing"] == "prefix"  # nothing given, nothing changed
    assert api.patch(url, {"routing": "prefix"}).status_code == 200
    assert AuditEvent.objects.filter(action="endpoint.update").count() == 1  # no change, no audit row
    with pytest.raises(ValidationError, match="cannot be changed here"):
        from endpoints.services import endpoint_update

        endpoint_update(endpoint=Endpoint.objects.get(pk=plain["id"]), user=operator, replicas=3)


@pytest.mark.django_db
def test_launch_form_takes_routing(as_operator, as_viewer, cpu_node, tiny_artifact):
    page = as_operator.get("/endpoints/launch").content.decode()
    assert 'name="routing"' in page and 'value="prefix"' in page
    bad = as_operator.post(
        "/endpoints/launch", {"name": "f-bad", "artifact": tiny_artifact.pk, "node": cpu_node.pk, "routing": "sticky"}
    )
    assert bad.status_code == 400 and "Choose least-outstanding or prefix" in bad.content.decode()
    ok = as_operator.post(
        "/endpoints/launch",
        {"name": "f-ok", "artifact": tiny_artifact.pk, "node": cpu_node.pk, "routing": "prefix", "replicas": "1"},
    )
    assert ok.status_code == 302, ok.content.decode()[-2000:]
    endpoint = Endpoint.objects.get(name="f-ok")
    assert endpoint.routing == "prefix"
    page = as_operator.get(f"/endpoints/{endpoint.pk}/").content.decode()
    assert 'id="endpoint-routing">prefix-aware' in page and 'id="routing-form"' in page
    # Changed later from the page: a bad value changes nothing; a good one is audited.
    refused = as_operator.post(f"/endpoints/{endpoint.pk}/routing", {"routing": "random"}, follow=True)
    assert "routing: Choose least-outstanding or prefix" in refused.content.decode()
    assert Endpoint.objects.get(pk=endpoint.pk).routing == "prefix"
    assert as_viewer.post(f"/endpoints/{endpoint.pk}/routing", {"routing": "least-outstanding"}).status_code == 403
    as_operator.post(f"/endpoints/{endpoint.pk}/routing", {"routing": "least-outstanding"})
    assert Endpoint.objects.get(pk=endpoint.pk).routing == "least-outstanding"
    assert AuditEvent.objects.filter(action="endpoint.update", object_id=str(endpoint.pk)).count() == 1


def pair(node=None):
    blue = make_endpoint("c-blue", [], model="tiny", node=node)
    green = make_endpoint("c-green", [], model="tiny", node=node)
    for i, ep in enumerate((blue, green)):
        Replica.objects.create(
            endpoint=ep, index=0, node=ep.node, state=Endpoint.State.READY, port=9100 + i, port_host=f"fake-{9100 + i}"
        )
    return blue, green


@pytest.mark.django_db
def test_canary_api_refuses_bad_input_and_switch_rollback_reset_it(operator, viewer, api_for, admin):
    blue, green = pair()
    api = api_for(operator)
    url = f"/api/v1/gateway/endpoints/{blue.pk}/canary"
    none = api.post(url, {"percent": 25})
    assert none.status_code == 400 and "staged" in none.json()["errors"], none.content
    services.stage(endpoint=blue, staged=green, actor=admin)
    for body, status, field in [
        ({"percent": 100}, 400, "percent"),
        ({"percent": -1}, 400, "percent"),
        ({"percent": "lots"}, 422, "percent"),
        ({}, 422, "percent"),
        ({"percent": 5, "share": 1}, 422, "share"),
    ]:
        refused = api.post(url, body)
        assert refused.status_code == status and field in refused.content.decode(), (body, refused.content)
    assert GatewayEndpoint.objects.get(endpoint=blue).canary_percent == 0
    assert not AuditEvent.objects.filter(action="gateway.canary").exists()
    assert api_for(viewer).post(url, {"percent": 25}).status_code == 403

    Replica.objects.filter(endpoint=green).update(state=Endpoint.State.STARTING)
    cold = api.post(url, {"percent": 25})
    assert cold.status_code == 400 and "c-green has no ready replica" in cold.json()["detail"]
    Replica.objects.filter(endpoint=green).update(state=Endpoint.State.READY)

    set_ = api.post(url, {"percent": 25})
    assert set_.status_code == 200 and set_.json()["canary_percent"] == 25 and set_.json()["serving"] == "live"
    audit = AuditEvent.objects.get(action="gateway.canary")
    assert audit.changes == {"staged": "c-green", "canary_percent": [0, 25]} and audit.actor == operator
    table = routing_table()
    assert table.canary == {"tiny": 25}
    sides = {b.endpoint_name: (b.staged, b.canary_percent) for b in table.backends["tiny"]}
    assert sides == {"c-blue": (False, 0), "c-green": (True, 25)}

    # Switch: all traffic to the staged side, the share ends.
    switched = api.post(f"/api/v1/gateway/endpoints/{blue.pk}/switch").json()
    assert switched["serving"] == "staged" and switched["canary_percent"] == 0
    refused = api.post(url, {"percent": 10})
    assert refused.status_code == 400 and "percent" in refused.json()["errors"]
    assert [b.endpoint_name for b in routing_table().backends["tiny"]] == ["c-green"]
    api.post(f"/api/v1/gateway/endpoints/{blue.pk}/rollback")

    # Rollback during a canary aborts it: the live side takes all, the staged side stops after the drain.
    assert api.post(url, {"percent": 40}).json()["canary_percent"] == 40
    rolled = api.post(f"/api/v1/gateway/endpoints/{blue.pk}/rollback")
    assert rolled.status_code == 200 and rolled.json()["canary_percent"] == 0 and rolled.json()["stop_idle_at"]
    assert AuditEvent.objects.filter(action="gateway.rollback").order_by("pk").last().changes["canary_percent"] == [
        40,
        0,
    ]
    assert [b.endpoint_name for b in routing_table().backends["tiny"]] == ["c-blue"]
    assert routing_table().canary == {}
    # 0 ends a canary without a rollback (the staged side idle again, still running).
    api.post(url, {"percent": 30})
    assert api.post(url, {"percent": 0}).json()["canary_percent"] == 0
    assert Endpoint.objects.get(pk=green.pk).desired_state == "running"


@pytest.mark.django_db
def test_routing_table_reads_a_fixed_number_of_queries_however_many_replicas(django_assert_num_queries):
    """The gateway reads it every second and its rows carry only the columns it uses: a field it reads
    but left out would cost a query per replica (and this count would grow)."""
    from workers.models import Device

    blue, green = pair()
    Endpoint.objects.filter(pk=green.pk).update(routing=Endpoint.Routing.PREFIX, served_model_name="other")
    for i in (1, 2):
        Replica.objects.create(
            endpoint=blue,
            index=i,
            node=blue.node,
            state=Endpoint.State.READY,
            port=9200 + i,
            port_host=f"fake-{9200 + i}",
            devices=[i],
        )
    Endpoint.objects.filter(pk=blue.pk).update(replicas=3)
    Device.objects.create(node=blue.node, index=2, kind="npu", health="Alarm")  # replica 2's device: not routed
    with django_assert_num_queries(7):  # pairs, names, endpoints, replicas, unhealthy devices, members, adapters
        table = routing_table()
    assert {
        (b.endpoint_name, b.replica_index, b.url, b.node_name, b.prefix) for bs in table.backends.values() for b in bs
    } == {
        ("c-blue", 0, "http://127.0.0.1:9100", "gw-node", False),
        ("c-blue", 1, "http://127.0.0.1:9201", "gw-node", False),
        ("c-green", 0, "http://127.0.0.1:9101", "gw-node", True),
    }
    assert table.known == {"tiny": {"c-blue"}, "other": {"c-green"}} and table.prefix == {"other"}
    first = table.backends["tiny"][0]
    assert first.api_key == Replica(pk=Replica.objects.get(endpoint=blue, index=first.replica_index).pk).api_key


@pytest.mark.django_db
def test_canary_from_the_endpoint_page(as_operator, admin):
    blue, green = pair()
    page = as_operator.get(f"/endpoints/{blue.pk}/").content.decode()
    assert 'id="canary-form"' not in page and 'id="canary-charts"' not in page
    services.stage(endpoint=blue, staged=green, actor=admin)
    page = as_operator.get(f"/endpoints/{blue.pk}/").content.decode()
    assert 'id="canary-form"' in page and 'id="canary-charts"' in page
    # Live and staged charted side by side: the same gateway metrics for each side's endpoint.
    for side, ep in (("live", blue), ("staged", green)):
        for chart in ("latency", "ttft", "errors"):
            assert f'id="chart-canary-{side}-{chart}"' in page
        assert page.count(f'data-endpoint="{ep.pk}"') >= 3
    url = f"/gateway/endpoints/{blue.pk}/bluegreen"
    refused = as_operator.post(url, {"action": "canary", "percent": "150"}, follow=True).content.decode()
    assert "percent must be a whole number from 1 to 99" in refused
    refused = as_operator.post(url, {"action": "canary", "percent": "a quarter"}, follow=True).content.decode()
    assert "Canary share (%): Enter a whole number." in refused
    assert GatewayEndpoint.objects.get(endpoint=blue).canary_percent == 0
    as_operator.post(url, {"action": "canary", "percent": "25"})
    assert GatewayEndpoint.objects.get(endpoint=blue).canary_percent == 25
    assert 'id="canary-percent">25 %<' in as_operator.get(f"/endpoints/{blue.pk}/").content.decode()


# --- a real gateway in front of fake replicas --------------------------------------------------------


def served_by(response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"].removeprefix("hello from ")


@pytest.mark.django_db(transaction=True)
def test_prefix_routing_sticks_conversations_to_a_replica(fakes, gateway, admin, api_for, operator):
    from workers.models import Node

    fs = [fakes(f"r{i}") for i in range(3)]
    ep = make_endpoint("ep-prefix", fs[:1], model="tiny")
    Endpoint.objects.filter(pk=ep.pk).update(replicas=3)  # the gateway routes to replicas below the count
    for i, f in enumerate(fs[1:], start=1):
        node = Node.objects.create(name=f"pfx-node-{i}", address="127.0.0.1")
        Replica.objects.create(
            endpoint=ep, index=i, node=node, state=Endpoint.State.READY, port=f.port, port_host=f"fake-{f.port}"
        )
    assert api_for(operator).patch(f"/api/v1/endpoints/{ep.pk}", {"routing": "prefix"}).status_code == 200
    _, raw = services.key_create(name="app", actor=admin)
    gw = gateway()
    gw.wait_routes("tiny", 3)  # the gateway started after the PATCH: the table that has the replicas has the policy

    system = "You are a support agent for a bakery. Answer in one sentence. " * 2
    owners = {}
    for c in range(12):
        seen = {
            served_by(
                gw.post(
                    "/v1/chat/completions",
                    raw,
                    {
                        "model": "tiny",
                        "max_tokens": 4,
                        "messages": conversation(system, f"Customer {c}: my order is late", t),
                    },
                )
            )
            for t in range(1, 5)
        }
        assert len(seen) == 1, (c, seen)  # every turn of one conversation on one replica
        owners[c] = seen.pop()
    assert len(set(owners.values())) >= 2, owners  # different conversations spread

    # Least outstanding (the default) for comparison: one conversation's turns go round the replicas.
    api_for(operator).patch(f"/api/v1/endpoints/{ep.pk}", {"routing": "least-outstanding"})

    def spread():  # its turns on two replicas or more: the gateway's routes refresh has the new policy
        seen = {
            served_by(
                gw.post(
                    "/v1/chat/completions",
                    raw,
                    {
                        "model": "tiny",
                        "max_tokens": 4,
                        "messages": conversation(system, "Customer 0: my order is late", t),
                    },
                )
            )
            for t in range(1, 13)
        }
        return seen if len(seen) >= 2 else None

    wait_for(spread, timeout=10, interval=0.1, what="one conversation's turns spread over the replicas")


@pytest.mark.django_db(transaction=True)
def test_a_25_percent_canary_takes_about_a_quarter_and_each_side_is_charted(fakes, gateway, admin, api_for, operator):
    from concurrent.futures import ThreadPoolExecutor

    from workers.telemetry.models import Series

    blue_fake, green_fake = fakes("blue"), fakes("green")
    blue = make_endpoint("ep-live", [blue_fake], model="tiny")
    green = make_endpoint("ep-canary", [green_fake], model="tiny")
    api = api_for(operator)
    assert api.post(f"/api/v1/gateway/endpoints/{blue.pk}/stage", {"staged": green.pk}).status_code == 200
    assert api.post(f"/api/v1/gateway/endpoints/{blue.pk}/canary", {"percent": 25}).status_code == 200
    _, raw = services.key_create(name="app", actor=admin)
    gw = gateway()
    gw.wait_routes("tiny", 2)

    n = 400
    with ThreadPoolExecutor(4) as pool:
        sides = Counter(
            pool.map(
                lambda i: served_by(
                    gw.post(
                        "/v1/chat/completions",
                        raw,
                        {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": f"q{i}"}]},
                    )
                ),
                range(n),
            )
        )
    # Binomial(400, 0.25): 100 expected, sd 8.7; within 4 sd (a false alarm about once in 15 000 runs).
    assert sides["blue"] + sides["green"] == n and abs(sides["green"] - 100) <= 4 * math.sqrt(n * 0.25 * 0.75), sides

    # Per side in the telemetry: the staged side is its own endpoint.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not (
        Series.objects.filter(key=f"e{green.pk}.gw.p50_s").exists()
        and Series.objects.filter(key=f"e{blue.pk}.gw.p50_s").exists()
    ):
        time.sleep(0.3)
    for ep in (blue, green):
        for metric in ("gw.qps", "gw.p50_s", "gw.error_rate"):
            assert Series.objects.filter(key=f"e{ep.pk}.{metric}", endpoint_id=ep.pk).exists(), (ep.name, metric)
        # Answers sent whole have no first token to time: no TTFT figure (a P99 latency would read as one).
        assert not Series.objects.filter(key__contains=".gw.ttft_").exists()
    # Streamed answers give each side its TTFT.
    with ThreadPoolExecutor(4) as pool:
        streamed = list(
            pool.map(
                lambda i: gw.post(
                    "/v1/chat/completions",
                    raw,
                    {
                        "model": "tiny",
                        "max_tokens": 4,
                        "stream": True,
                        "messages": [{"role": "user", "content": f"s{i}"}],
                    },
                ),
                range(60),
            )
        )
    assert all(r.status_code == 200 and "hello" in r.text for r in streamed)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and Series.objects.filter(key__contains=".gw.ttft_p50_s").count() < 2:
        time.sleep(0.3)
    for ep in (blue, green):
        assert Series.objects.filter(key=f"e{ep.pk}.gw.ttft_p50_s", endpoint_id=ep.pk).exists(), ep.name

    # The staged side's replica goes away: the live side takes every request, none fails.
    green_fake.stop()
    codes = Counter(
        gw.post("/v1/completions", raw, {"model": "tiny", "prompt": f"x{i}"}).status_code for i in range(60)
    )
    assert codes == {200: 60}, codes
