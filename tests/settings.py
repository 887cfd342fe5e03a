"""The console's settings with test defaults: its own Redis database and data dir, so a
test run never flushes the Redis or touches the data of a console running on this host."""

import os
from pathlib import Path

_root = Path(__file__).resolve().parent.parent
os.environ.setdefault("REDIS_URL", "redis://127.0.0.1:6379/15")
os.environ.setdefault("DATA_DIR", str(_root / "var" / "test"))
os.environ.setdefault("SECRET_KEY", "test-secret-key-not-for-production-0123456789abcdef")
os.environ.setdefault("JOB_HEARTBEAT_SECONDS", "1")
os.environ.setdefault("JOB_STALE_SECONDS", "6")


def _worker_share(span: str, index: int, count: int) -> str:
    """The index-th of count equal slices of a "LOW-HIGH" port range."""
    low, high = (int(p) for p in span.split("-", 1))
    size = (high - low + 1) // count
    assert size >= 2, f"port range {span} is too small for {count} pytest-xdist workers"
    return f"{low + index * size}-{low + (index + 1) * size - 1}"


# Under pytest-xdist (`make test`'s fast tests: docs/ci.md) each worker gets its own Redis database (tests flush
# theirs), DATA_DIR and slice of the replica and cluster port ranges; set in the environment, so that the agents,
# RQ workers and gateways a test starts inherit them. Worker N of a pass whose base database is B takes B - 2N: the
# SQLite pass (15) and the PostgreSQL pass beside it (14) interleave. pytest-django gives each worker its own test
# database (a suffix on PostgreSQL; the SQLite file is per process below).
_worker = os.environ.get("PYTEST_XDIST_WORKER")
if _worker:
    from urllib.parse import urlsplit, urlunsplit

    _index, _count = int(_worker.removeprefix("gw")), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    _redis = urlsplit(os.environ["REDIS_URL"])
    _db = int(_redis.path.lstrip("/") or 0) - 2 * _index
    assert _db >= 1, f"pytest-xdist worker {_worker} would use Redis database {_db}: use fewer workers"
    os.environ["REDIS_URL"] = urlunsplit(_redis._replace(path=f"/{_db}"))
    os.environ["DATA_DIR"] = str(Path(os.environ["DATA_DIR"]) / _worker)
    for _name, _default in (("ENDPOINT_PORT_RANGE", "8200-8399"), ("ENDPOINT_CLUSTER_PORT_RANGE", "6400-6499")):
        os.environ[_name] = _worker_share(os.environ.get(_name, _default), _index, _count)

from console.settings import *  # noqa: E402,F401,F403

PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]  # fast logins in tests
STORAGES["staticfiles"] = {"BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"}  # noqa: F405
WHITENOISE_USE_FINDERS = True
# Files looked up when asked for, not indexed when the middleware is made: each test client makes it anew, and the
# index (a stat of every static file and its compressed forms) cost much of the tests' CPU (docs/ci.md).
WHITENOISE_AUTOREFRESH = True
STATIC_ROOT.mkdir(parents=True, exist_ok=True)  # noqa: F405
if DATABASES["default"]["ENGINE"].endswith("sqlite3"):  # noqa: F405
    # One test database file per test run, so runs side by side don't share (and delete) it.
    DATABASES["default"]["TEST"] = {"NAME": str(DATA_DIR / f"test-console-{os.getpid()}.sqlite3")}  # noqa: F405
