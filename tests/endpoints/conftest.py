"""Fixtures of the serving tests: fake OpenAI replicas and real gateway processes, stopped after each test."""
import pytest

from tests.support.gateway import FakeReplica, GatewayProc


@pytest.fixture
def fakes():
    made = []

    def make(name, delay=0.0):
        made.append(FakeReplica(name, delay))
        return made[-1]

    yield make
    for f in made:
        f.stop()


@pytest.fixture(params=["rust", "python"])
def gateway(request, worker_env):
    """Starts real gateways: each test runs with both data paths, the compiled one (built by `make dataplane`)
    and the Python one. Their rules are the same code (endpoints/gateway/asgi.py); their HTTP is not."""
    started = []

    def start(**extra):
        started.append(GatewayProc(worker_env, {"GATEWAY_DATAPLANE": request.param, **extra}))
        return started[-1]

    yield start
    for g in started:
        g.stop()
