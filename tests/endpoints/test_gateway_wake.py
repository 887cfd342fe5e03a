"""Scale to zero, the gateway's part: a request for an endpoint scaled to zero wakes it (one scale event,
audited as the system user via the gateway), is held until a replica is ready, then answered; past
GATEWAY_WAKE_TIMEOUT_SECONDS a 503 with Retry-After. A real `manage.py gateway` subprocess in front of
FakeReplica; the test plays the agent (it marks the woken replica READY on a fake's port)."""

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from console.models import AuditEvent
from endpoints.autoscale import parse_settings
from endpoints.gateway import services
from endpoints.models import Endpoint, EndpointEvent, Replica
from tests.support.gateway import HEALTH_TOKEN, chat, make_endpoint
from workers.telemetry.models import Point


def asleep(name, model):
    """An autoscaled endpoint (min_replicas 0) scaled to zero: no replica wanted."""
    endpoint = make_endpoint(name, [], model=model)
    Endpoint.objects.filter(pk=endpoint.pk).update(
        replicas=0,
        state=Endpoint.State.PENDING,
        autoscale=parse_settings({"min_replicas": 0, "max_replicas": 1}).as_json(),
    )
    return Endpoint.objects.get(pk=endpoint.pk)


def held(gw) -> int:
    return gw.client.get("/healthz", headers={"Authorization": f"Bearer {HEALTH_TOKEN}"}).json()["held"]


def wait_for(condition, timeout=10.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"{what}: not within {timeout} s")


@pytest.mark.django_db(transaction=True)
def test_a_request_wakes_an_endpoint_scaled_to_zero_and_is_answered_once_a_replica_is_ready(fakes, gateway, admin):
    endpoint = asleep("sleepy", "sleepy")
    _, raw = services.key_create(name="app", actor=admin)
    _, other_raw = services.key_create(name="other-app", models=["other"], actor=admin)
    fake = fakes("z")
    gw = gateway(GATEWAY_WAKE_TIMEOUT_SECONDS="30")

    # A key that may not use the model: refused before anything wakes.
    denied = gw.post("/v1/chat/completions", other_raw, chat("sleepy"))
    assert denied.status_code == 404  # out of its scope: as a model that does not exist
    assert (
        Endpoint.objects.get(pk=endpoint.pk).replicas == 0
        and not AuditEvent.objects.filter(action="endpoint.scale").exists()
    )

    with ThreadPoolExecutor(4) as pool:
        answers = [pool.submit(gw.post, "/v1/chat/completions", raw, chat("sleepy")) for _ in range(4)]
        wait_for(lambda: Endpoint.objects.get(pk=endpoint.pk).replicas == 1, what="the wake")
        wait_for(lambda: held(gw) == 4, what="4 requests held")
        # The agent's start, meanwhile the gateway flushes its queue (every 1 s here) with the held requests in it.
        waiting = Point.objects.filter(series__key=f"e{endpoint.pk}.gw.waiting", value__gte=1)
        wait_for(waiting.exists, what="the held requests flushed as the endpoint's gateway queue")
        assert not any(a.done() for a in answers)
        Replica.objects.filter(endpoint=endpoint, index=0).update(
            state=Endpoint.State.READY, port=fake.port, port_host=f"fake-{fake.port}"
        )
        results = [a.result(timeout=20) for a in answers]
    assert [r.status_code for r in results] == [200] * 4, [r.text for r in results]
    assert {r.json()["choices"][0]["message"]["content"] for r in results} == {"hello from z"} and fake.served == 4
    assert held(gw) == 0

    [woken] = EndpointEvent.objects.filter(endpoint=endpoint, kind="autoscale")
    assert "scaled up 0 → 1: woken by a request through the gateway" in woken.message and "waiting" in woken.message
    [audit] = AuditEvent.objects.filter(action="endpoint.scale")
    assert audit.actor is None and audit.via == "gateway" and audit.changes["replicas"] == [0, 1]
    # The held requests were flushed as the endpoint's gateway queue (what the controller adds to vLLM's).
    assert Point.objects.filter(series__key=f"e{endpoint.pk}.gw.waiting", value__gte=1).exists()


@pytest.mark.django_db(transaction=True)
def test_a_wake_that_takes_too_long_answers_503_and_an_endpoint_not_autoscaled_answers_at_once(gateway, admin):
    endpoint = asleep("sleepy", "sleepy")
    make_endpoint("plain", [], model="plain")  # not autoscaled, no replica ready
    _, raw = services.key_create(name="app", actor=admin)
    gw = gateway(GATEWAY_WAKE_TIMEOUT_SECONDS="3")

    started = time.monotonic()
    plain = gw.post("/v1/chat/completions", raw, chat("plain"))
    assert plain.status_code == 503 and "No replica of 'plain' is ready" in plain.json()["error"]["message"]
    assert time.monotonic() - started < 1.5 and int(plain.headers["retry-after"]) > 0

    # A client that gives up while held just leaves: nothing stays held.
    with pytest.raises(httpx.ReadTimeout):
        gw.client.post(
            "/v1/chat/completions", json=chat("sleepy"), headers={"Authorization": f"Bearer {raw}"}, timeout=0.8
        )
    wait_for(lambda: held(gw) == 0, timeout=2, what="the gone client released")
    assert Endpoint.objects.get(pk=endpoint.pk).replicas == 1  # woken all the same (the replica starts)

    started = time.monotonic()
    late = gw.post("/v1/chat/completions", raw, chat("sleepy"))
    assert late.status_code == 503 and int(late.headers["retry-after"]) > 0
    assert "'sleepy' is starting" in late.json()["error"]["message"] and time.monotonic() - started >= 2.9
    assert held(gw) == 0
    assert AuditEvent.objects.filter(action="endpoint.scale").count() == 1
