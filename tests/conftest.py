"""Shared test set-up: personas (admin, operator, viewer, outsider), clients logged in as
each, API tokens, model roots in a temporary directory, and the real Redis and RQ."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import django_rq
import pytest
from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import connection
from django.test import Client
from rq import Queue, SimpleWorker

from console.roles import ADMIN, OPERATOR, VIEWER, set_role
from console.services import api_token_create

ROOT = Path(__file__).resolve().parent.parent
PASSWORD = "correct horse battery staple 42"


def make_user(username, role):
    user = get_user_model().objects.create_user(username=username, password=PASSWORD)
    if role:
        set_role(user, role)
    return user


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

        return self.client.post(path, data=json.dumps(data or {}), content_type="application/json",
                                headers=self._headers(), **kw)

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


def run_queued_jobs(*queues):
    """Run what is queued with a real RQ worker in this process (a forked worker would not
    see the test database's uncommitted rows; tests using this need transactional_db).
    Without names: every queue that holds work, per-node queues included."""
    conn = django_rq.get_connection("default")
    selected = [Queue(n, connection=conn) for n in queues] if queues else Queue.all(connection=conn)
    if selected:
        SimpleWorker(selected, connection=conn).work(burst=True)


@pytest.fixture
def worker_env():
    """Environment for a real worker subprocess that must use the test database."""
    db = connection.settings_dict
    env = dict(os.environ)
    env["DJANGO_SETTINGS_MODULE"] = "tests.settings"
    if db["ENGINE"].endswith("sqlite3"):
        env["DATABASE_URL"] = f"sqlite:///{db['NAME']}"
    else:
        env["DATABASE_URL"] = (f"postgres://{db['USER'] or ''}:{db['PASSWORD'] or ''}@"
                               f"{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}")
    return env


def start_worker(env, *queues, extra_env=None):
    env = {**env, **(extra_env or {})}
    return subprocess.Popen(
        [sys.executable, "manage.py", "rqworker", "--worker-class", "rq.Worker", *queues],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )


@pytest.fixture(autouse=True)
def _clean_artifact_store(settings):
    yield
    store = Path(settings.ARTIFACT_STORE)
    if "test" in str(store):
        shutil.rmtree(store, ignore_errors=True)
