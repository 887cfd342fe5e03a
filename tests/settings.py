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

from console.settings import *  # noqa: E402,F401,F403

PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]  # fast logins in tests
STORAGES["staticfiles"] = {"BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"}  # noqa: F405
WHITENOISE_USE_FINDERS = True
STATIC_ROOT.mkdir(parents=True, exist_ok=True)  # noqa: F405
if DATABASES["default"]["ENGINE"].endswith("sqlite3"):  # noqa: F405
    # One test database file per test run, so runs side by side don't share (and delete) it.
    DATABASES["default"]["TEST"] = {"NAME": str(DATA_DIR / f"test-console-{os.getpid()}.sqlite3")}  # noqa: F405
