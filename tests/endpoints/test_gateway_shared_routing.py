"""Several gateways route as one (endpoints/gateway/shared_routing.py): outstanding counts and prefix homes shared
through a real Redis, in-process and with two real gateway processes in front of FakeReplicas; Redis unreachable,
each routes on its own counts."""

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from endpoints.gateway import routing, services
from endpoints.gateway.asgi import Gateway
from endpoints.gateway.selectors import Backend
from endpoints.gateway.shared_routing import STALE_SECONDS, Load, SharedRouting
from endpoints.models import Endpoint, Replica
from tests.support.gateway import free_port, make_endpoint

U1, U2 = "http://10.0.0.1:8000", "http://10.0.0.2:8000"


def test_counts_are_summed_across_gateways_and_a_silent_gateway_drops_out(redis_conn):
    async def run():
        a, b = SharedRouting(name="a", stale_seconds=0.5), SharedRouting(name="b", stale_seconds=0.5)
        try:
            await a.sync({U1: 3, U2: 0})
            await b.sync({U2: 1})
            await a.sync({U1: 3})
            assert a.up and b.up
            assert a.others == {U2: 1} and b.others == {U1: 3}  # each reads the others', not its own
            view = Load({U1: 1}, b)
            assert view.get(U1) == 4 and view.get(U2) == 0 and view[U1] == 4 and set(view) == {U1}
            assert Load({U1: 1}, None).get(U1) == 1
            # a stops publishing (killed): after the staleness cut-off its counts are no one's.
            await asyncio.sleep(0.7)
            await b.sync({U2: 1})
            assert b.others == {}
            assert set(await b.redis.hkeys("gw:routing:load")) == {b"b"}
        finally:
            await a.close()
            await b.close()

    asyncio.run(run())


def test_the_first_gateways_home_is_every_gateways_while_that_replica_is_routable(redis_conn):
    async def run():
        a, b = SharedRouting(name="a"), SharedRouting(name="b")
        key = routing.digest(b"a conversation")
        try:
            assert await a.claim_home(key, U1, [U1, U2]) == U1
            assert await b.claim_home(key, U2, [U1, U2]) == U1  # b would have chosen U2: it takes a's
            # U1 left the routing table: the next claim's choice replaces it, for everyone.
            assert await b.claim_home(key, U2, [U2]) == U2
            assert await a.claim_home(key, U1, [U1, U2]) == U2
        finally:
            await a.close()
            await b.close()

    asyncio.run(run())
    ttl = redis_conn.pttl("gw:routing:home:" + routing.digest(b"a conversation").hex())
    assert routing.HOME_IDLE_SECONDS * 1000 < ttl <= (routing.HOME_IDLE_SECONDS + 60) * 1000


def backend(url, **kw):
    return Backend(url=url, endpoint_id=1, endpoint_name="ep1", replica_index=0, queue_depth=100, **kw)


def shared_gateway(url=None) -> Gateway:
    gw = Gateway()
    gw.shared = SharedRouting(url)
    gw.load = Load(gw.outstanding, gw.shared)
    return gw


def test_a_gateway_picks_by_every_gateways_counts_and_takes_the_agreed_home(redis_conn):
    async def run():
        gw, other = shared_gateway(), SharedRouting(name="other")
        a, b = backend("http://a", prefix=True), backend("http://b", prefix=True)
        try:
            await other.sync({"http://a": 2})  # the other gateway runs 2 requests on a
            await gw.sync_routing()
            assert all(gw.pick([a, b], set()) == b for _ in range(20))  # least outstanding over both gateways
            # A prefix the other gateway homed on a: this gateway, seeing it first, takes that home although b is
            # less loaded (within the bound: ceil(1.25 * 3 / 2) + 8).
            key = routing.digest(b"homed elsewhere")
            assert await other.claim_home(key, "http://a", ["http://a", "http://b"]) == "http://a"
            await gw.agree_home([a, b], staged=None, key=key)
            assert gw.prefix_homes.home_of(key) == "http://a" and gw.pick([a, b], set(), key=key) == a
            assert gw.prefix_homes.keys_of == {"http://a": 1}
            # A new prefix: this gateway's choice (least loaded: b) is recorded for the others.
            new = routing.digest(b"new here")
            await gw.agree_home([a, b], staged=None, key=new)
            assert gw.prefix_homes.home_of(new) == "http://b"
            assert await other.claim_home(new, "http://a", ["http://a", "http://b"]) == "http://b"
            # The bounded load reads the shared counts: 30 on b elsewhere sends b's prefix to a.
            await other.sync({"http://b": 30})
            await gw.sync_routing()
            assert gw.pick([a, b], set(), key=new) == a and gw.prefix_homes.home_of(new) == "http://b"
        finally:
            await gw.shared.close()
            await other.close()

    asyncio.run(run())


def test_an_endpoints_queue_depth_counts_every_gateways_requests(redis_conn):
    """Queue depth 4 on an endpoint of two replicas: 3 requests in flight through another gateway and 1 through
    this one fill it, so this gateway picks neither replica (the request is answered "queue full"), while an
    endpoint with room beside it is still picked. Before, each gateway let a whole queue depth in."""

    async def run():
        gw, other = shared_gateway(), SharedRouting(name="other")
        a = Backend(url="http://a", endpoint_id=1, endpoint_name="ep1", replica_index=0, queue_depth=4)
        b = Backend(url="http://b", endpoint_id=1, endpoint_name="ep1", replica_index=1, queue_depth=4)
        c = Backend(url="http://c", endpoint_id=2, endpoint_name="ep2", replica_index=0, queue_depth=4)
        try:
            gw.outstanding["http://a"] = gw.ep_outstanding[1] = 1
            await other.sync({"http://a": 1, "http://b": 1})
            await gw.sync_routing()
            assert gw.full_endpoints([a, b, c]) == set() and gw.pick([a, b], set()) is not None
            await other.sync({"http://a": 1, "http://b": 2})
            await gw.sync_routing()
            assert gw.full_endpoints([a, b, c]) == {1}
            assert gw.pick([a, b], set()) is None and gw.pick([a, b, c], set()) == c
        finally:
            await gw.shared.close()
            await other.close()

    asyncio.run(run())


def test_a_gateway_alone_records_its_homes_without_waiting_for_redis(redis_conn):
    async def run():
        gw = shared_gateway()
        a, b = backend("http://a", prefix=True), backend("http://b", prefix=True)
        key = routing.digest(b"alone")
        try:
            await gw.sync_routing()
            assert gw.shared.up and gw.shared.peers == 0
            await gw.agree_home([a, b], staged=None, key=key)
            home = gw.prefix_homes.home_of(key)
            assert home is not None and len(gw.claims) == 1  # recorded off the request's path
            await asyncio.gather(*gw.claims)
            assert await SharedRouting(name="later").claim_home(key, "http://x", ["http://a", "http://b"]) == home
        finally:
            await gw.shared.close()

    asyncio.run(run())


def test_with_redis_unreachable_a_gateway_routes_on_its_own_counts():
    async def run():
        gw = shared_gateway(f"redis://127.0.0.1:{free_port()}/3")  # nothing listens there
        gw.shared.others = {"http://b": 50}  # what it read before Redis went away
        a, b = backend("http://a", prefix=True), backend("http://b", prefix=True)
        try:
            started = time.monotonic()
            await gw.sync_routing()
            assert not gw.shared.up and gw.shared.others == {}
            gw.outstanding["http://a"] = 1
            assert gw.pick([a, b], set()) == b  # its own counts only
            key = routing.digest(b"p")
            await gw.agree_home([a, b], staged=None, key=key)  # no claim: nothing to wait for
            assert gw.prefix_homes.home_of(key) is None and gw.pick([a, b], set(), key=key) == b
            assert time.monotonic() - started < 1
        finally:
            await gw.shared.close()

    asyncio.run(run())


def test_a_late_answer_keeps_the_last_counts_until_they_would_be_stale(redis_conn):
    """A publish that times out (Redis answering late on a host whose cores the replicas keep busy) is not Redis
    down: the other gateways' counts read last stand while fresher than the staleness cut-off; past it, they are
    dropped and this gateway routes on its own counts."""
    from redis.exceptions import TimeoutError as RedisTimeout

    async def late(**_):
        raise RedisTimeout("Timeout reading from 127.0.0.1:6379")

    async def run():
        a, b = SharedRouting(name="a"), SharedRouting(name="b")
        try:
            await b.sync({U2: 4})
            await a.sync({U1: 1})
            assert a.others == {U2: 4} and a.up
            a.sync_script = late
            await a.sync({U1: 1})
            assert a.others == {U2: 4} and a.up and a.late == 1
            a.last_ok -= STALE_SECONDS  # as if the last good publish were a cut-off ago
            await a.sync({U1: 1})
            assert a.others == {} and not a.up and a.late == 1
        finally:
            await a.close()
            await b.close()

    asyncio.run(run())


# --- two real gateways --------------------------------------------------------------------------------------------


def endpoint_of(fakes_, name):
    """One endpoint whose replicas are the given fakes (each on a node of its own)."""
    from workers.models import Node

    ep = make_endpoint(name, fakes_[:1], model="tiny")
    Endpoint.objects.filter(pk=ep.pk).update(replicas=len(fakes_))
    for i, f in enumerate(fakes_[1:], start=1):
        node = Node.objects.create(name=f"{name}-node-{i}", address="127.0.0.1")
        Replica.objects.create(
            endpoint=ep, index=i, node=node, state=Endpoint.State.READY, port=f.port, port_host=f"fake-{f.port}"
        )
    return ep


def served_by(response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"].removeprefix("hello from ")


@pytest.mark.django_db(transaction=True)
def test_two_gateways_do_not_pile_onto_one_replica(fakes, gateway, admin, redis_conn):
    """Gateway A sends a request (0.6 s of service) to one of two idle replicas; 0.25 s later gateway B sends one: B
    sees A's request in flight (published every 10 ms) and takes the other replica, every time. Each gateway alone
    sees two idle replicas and picks at random: all 8 rounds apart would happen once in 256 runs."""
    fs = [fakes("r0", delay=0.6), fakes("r1", delay=0.6)]
    endpoint_of(fs, "ep-pile")
    _, raw = services.key_create(name="app", actor=admin)
    gws = [gateway(), gateway()]
    for gw in gws:
        gw.wait_routes("tiny", 2)
    body = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    with ThreadPoolExecutor(1) as pool:
        for round_ in range(8):
            on_a = pool.submit(gws[0].post, "/v1/chat/completions", raw, body)
            time.sleep(0.25)
            on_b = served_by(gws[1].post("/v1/chat/completions", raw, body))
            served = [served_by(on_a.result()), on_b]
            assert sorted(served) == ["r0", "r1"], (round_, served)


@pytest.mark.django_db(transaction=True)
def test_a_prefix_stays_on_one_replica_whichever_gateway_receives_it(
    fakes, gateway, admin, api_for, operator, redis_conn
):
    """Gateway A has homed other conversations first (so its own choice for a new one differs from what B would
    choose alone); each conversation's first turn goes to one gateway, its later turns to the other: one replica."""
    fs = [fakes(f"r{i}") for i in range(3)]
    ep = endpoint_of(fs, "ep-prefix")
    assert api_for(operator).patch(f"/api/v1/endpoints/{ep.pk}", {"routing": "prefix"}).status_code == 200
    _, raw = services.key_create(name="app", actor=admin)
    gws = [gateway(), gateway()]
    for gw in gws:
        gw.wait_routes("tiny", 3)
    time.sleep(0.4)  # a refresh after the PATCH (the table is read every 0.3 s here)

    def turn(gw, c, t):
        messages = [{"role": "system", "content": "You answer for a bakery. " * 3}, {"role": "user", "content": c}]
        for k in range(1, t):
            messages += [{"role": "assistant", "content": f"answer {k}"}, {"role": "user", "content": f"more {k}"}]
        return served_by(gw.post("/v1/chat/completions", raw, {"model": "tiny", "max_tokens": 4, "messages": messages}))

    for c in range(5):
        turn(gws[0], f"warm-up {c}", 1)  # A's homes now differ from B's (A's new keys go where it has fewer)
    owners = {}
    for c in range(12):
        first, other = (gws[0], gws[1]) if c % 2 == 0 else (gws[1], gws[0])
        seen = {turn(first, f"customer {c}", 1), *(turn(other, f"customer {c}", t) for t in range(2, 5))}
        assert len(seen) == 1, (c, seen)
        owners[c] = seen.pop()
    assert len(set(owners.values())) >= 2, owners  # conversations still spread over the replicas


@pytest.mark.parametrize(
    "peers, others, own, period",
    [
        (0, {}, 2, 0.05),  # alone and busy: nobody to keep up to date
        (1, {}, 2, 0.01),  # another gateway publishes, this one has requests in flight
        (1, {"http://a": 1}, 0, 0.01),  # the other gateway has requests in flight
        (1, {}, 0, 0.05),  # nobody has
    ],
)
def test_the_routing_state_is_shared_every_period_only_while_another_gateway_publishes_and_one_is_busy(
    monkeypatch, peers, others, own, period
):
    """The sync loop's wait, read from the sleeps it asks for (no clock): every GATEWAY_SHARED_ROUTING_SECONDS while
    another gateway publishes and any gateway has a request in flight, IDLE_SYNC_FACTOR times that otherwise."""
    gw = Gateway()
    gw.shared = SharedRouting("redis://127.0.0.1:1/0")  # never reached: sync_routing is replaced below
    gw.shared.peers, gw.shared.others = peers, others
    gw.outstanding["http://a"] = own
    waits, synced = [], []

    async def sleep(seconds):
        waits.append(seconds)
        if len(waits) == 3:
            raise asyncio.CancelledError

    async def sync_routing():
        synced.append(True)

    monkeypatch.setattr(asyncio, "sleep", sleep)
    monkeypatch.setattr(gw, "sync_routing", sync_routing)

    async def run():
        with pytest.raises(asyncio.CancelledError):
            await gw._sync_loop(0.01)

    asyncio.run(run())
    assert waits == pytest.approx([period] * 3) and len(synced) == 2
