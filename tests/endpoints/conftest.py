"""Fixtures of the serving tests: fake OpenAI replicas and real gateway processes, stopped after each test."""

import pytest

from endpoints.gateway import services
from tests.support.gateway import FakeReplica, GatewayProc, make_endpoint


@pytest.fixture
def fakes():
    made = []

    def make(name, delay=0.0):
        made.append(FakeReplica(name, delay))
        return made[-1]

    yield make
    for f in made:
        f.stop()


@pytest.fixture(params=["rust", pytest.param("python", marks=pytest.mark.python_dataplane)])
def gateway(request, worker_env):
    """Starts real gateways: each test runs with both data paths, the compiled one (built by `make dataplane`)
    and the Python one. Their rules are the same code (endpoints/gateway/asgi.py); their HTTP is not, and it
    does not touch the database: the PostgreSQL pass runs the compiled path only (python_dataplane)."""
    started = []

    def start(**extra):
        started.append(GatewayProc(worker_env, {"GATEWAY_DATAPLANE": request.param, **extra}))
        return started[-1]

    yield start
    for g in started:
        g.stop()


@pytest.fixture
def serving(gateway, admin):
    """serving(upstream, name): `upstream` (an in-test replica) as the ready endpoint `name` of the model "tiny"
    behind a started gateway, and an application key: (key, raw key, gateway). The upstream stops after the test."""
    upstreams = []

    def serve(upstream, name):
        upstreams.append(upstream)
        make_endpoint(name, [upstream], model="tiny")
        key, raw = services.key_create(name="app", actor=admin)
        gw = gateway()
        gw.wait_routes("tiny", 1)
        return key, raw, gw

    yield serve
    for upstream in upstreams:
        upstream.stop()
