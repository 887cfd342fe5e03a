"""Shared test set-up: personas (admin, operator, viewer, outsider), clients logged in as
each, API tokens, model roots in a temporary directory, and the real Redis and RQ."""

import os
import shutil
from pathlib import Path

import django_rq
import pytest
from django.db import connection
from django.test import Client
from django.utils import timezone

from console.roles import ADMIN, OPERATOR, VIEWER
from console.services import api_token_create
from models_registry.inspection import inspect_path
from models_registry.models import Artifact, Model
from tests.support import FIXTURES
from tests.support.accounts import PASSWORD, make_user  # noqa: F401 (PASSWORD: the personas' password)
from tests.support.jobs import run_queued_jobs, start_worker  # noqa: F401
from tests.support.needs import IN_CI
from tests.support.npu_smi import FakeNpuSmi
from tests.support.tiny_models import build_tiny_llama_hf
from workers.models import Device, Node
from workers.npu_smi import runner as npu_smi_runner

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def admin(db):
    return make_user("alice-admin", ADMIN)


@pytest.fixture
def operator(db):
    return make_user("oscar-operator", OPERATOR)


@pytest.fixture
def viewer(db):
    return make_user("vera-viewer", VIEWER)


@pytest.fixture
def outsider(db):
    """Logged in, but holds no role: must see nothing."""
    return make_user("nobody", None)


def _client_for(user):
    client = Client(enforce_csrf_checks=False)
    client.force_login(user)
    return client


@pytest.fixture
def as_admin(admin):
    return _client_for(admin)


@pytest.fixture
def as_operator(operator):
    return _client_for(operator)


@pytest.fixture
def as_viewer(viewer):
    return _client_for(viewer)


class ApiClient:
    """A Client that authenticates with a bearer token, as other tools do."""

    def __init__(self, user):
        self.user = user
        _, self.token = api_token_create(user=user, name="tests")
        self.client = Client()

    def _headers(self):
        return {"Authorization": f"Bearer {self.token}"}

    def get(self, path, **kw):
        return self.client.get(path, headers=self._headers(), **kw)

    def post(self, path, data=None, **kw):
        import json

        return self.client.post(
            path, data=json.dumps(data or {}), content_type="application/json", headers=self._headers(), **kw
        )

    def patch(self, path, data=None, **kw):
        import json

        return self.client.patch(
            path, data=json.dumps(data or {}), content_type="application/json", headers=self._headers(), **kw
        )

    def delete(self, path, **kw):
        return self.client.delete(path, headers=self._headers(), **kw)


@pytest.fixture
def api_for():
    return ApiClient


@pytest.fixture
def model_root(tmp_path, settings):
    root = tmp_path / "models"
    root.mkdir()
    settings.MODEL_ROOTS = [root.resolve()]
    settings.ARTIFACT_STORE = (tmp_path / "artifacts").resolve()
    return root.resolve()


@pytest.fixture
def redis_conn():
    conn = django_rq.get_connection("default")
    db_index = conn.connection_pool.connection_kwargs.get("db", 0)
    assert db_index != 0, "tests flush their Redis database: never run them on database 0"
    conn.flushdb()
    yield conn
    conn.flushdb()


@pytest.fixture
def worker_env(tmp_path):
    """Environment for a real worker subprocess that must use the test database (and the test's own gateway usage
    journals: a gateway a test killed leaves its journal to that test's other gateways only)."""
    db = connection.settings_dict
    env = dict(os.environ)
    env["GATEWAY_USAGE_JOURNAL_DIR"] = str(tmp_path / "gateway-usage")
    env["DJANGO_SETTINGS_MODULE"] = "tests.settings"
    if db["ENGINE"].endswith("sqlite3"):
        env["DATABASE_URL"] = f"sqlite:///{db['NAME']}"
    else:
        env["DATABASE_URL"] = (
            f"postgres://{db['USER'] or ''}:{db['PASSWORD'] or ''}@"
            f"{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}"
        )
    return env


@pytest.fixture(autouse=True)
def _clean_artifact_store(settings):
    yield
    store = Path(settings.ARTIFACT_STORE)
    if "test" in str(store):
        shutil.rmtree(store, ignore_errors=True)


# --- nodes, devices, a tiny artifact: shared by the endpoint, telemetry, fault and npu-smi tests -------


@pytest.fixture
def ascend_node(db):
    """An Ascend host with eight healthy 910B4 chips (32 GiB each)."""
    node = Node.objects.create(
        name="npu-host",
        hostname="npu-host",
        address="10.0.0.5",
        platform="ascend",
        engine_python="/opt/engine/bin/python",
        last_heartbeat=timezone.now(),
    )
    for index in range(8):
        Device.objects.create(
            node=node, index=index, kind="npu", name="910B4", memory_total_bytes=32768 * 1024**2, health="OK"
        )
    return node


@pytest.fixture
def cpu_node(db):
    return Node.objects.create(
        name="cpu-host",
        hostname="cpu-host",
        address="127.0.0.1",
        platform="cpu",
        engine_python="/opt/engine/bin/python",
        last_heartbeat=timezone.now(),
    )


@pytest.fixture
def tiny_artifact(model_root, operator):
    path = build_tiny_llama_hf(model_root / "tiny")
    model = Model.objects.create(name="tiny")
    return Artifact.objects.create(
        model=model, format="hf", dtype="float32", path=str(path), inspection=inspect_path(path)
    )


@pytest.fixture
def fake_npu_smi(monkeypatch, tmp_path):
    """The fake npu-smi first on PATH, replaying the real 8 x 910B4 sample; `.set(default=, map=, hang=)`
    changes its answers (tests/support/npu_smi.FakeNpuSmi)."""
    fake = FakeNpuSmi(tmp_path / "fake-npu-smi-bin", dir=FIXTURES / "npu-smi")
    monkeypatch.setenv("PATH", fake.path_first())
    monkeypatch.setattr(npu_smi_runner, "FALLBACK_PATHS", ())
    return fake


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """In CI (tests.support.needs.IN_CI) a skipped test fails the run, whatever skipped it (a skipif marker on a
    missing engine, a missing chromium or systemd-analyze, the demo model's download): the suite is run to
    exercise those parts. Only the `network` tests may skip there: they ask outside registries that a CI machine
    may not reach, and say so."""
    report = yield
    if IN_CI and report.skipped and not hasattr(report, "wasxfail") and item.get_closest_marker("network") is None:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"CI=true: a skipped test fails the run ({reason})"
    return report


#: The fixtures through which a test reaches the database (pytest-django's; `django_db_blocker` is every test's).
DATABASE_FIXTURES = frozenset({"db", "transactional_db", "django_db_setup", "live_server"})


def pytest_collection_modifyitems(config, items):
    """TEST_DATABASE_TESTS_ONLY=1 (the Makefile's PostgreSQL pass): only the tests that open the database run, the
    others' results cannot depend on the database and they ran in the SQLite pass (docs/ci.md)."""
    if os.environ.get("TEST_DATABASE_TESTS_ONLY") != "1":
        return
    kept, dropped = [], []
    for item in items:
        uses = item.get_closest_marker("django_db") or DATABASE_FIXTURES & set(getattr(item, "fixturenames", ()))
        (kept if uses else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
