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


@pytest.fixture
def gateway(worker_env):
    started = []

    def start(**extra):
        started.append(GatewayProc(worker_env, extra))
        return started[-1]

    yield start
    for g in started:
        g.stop()
