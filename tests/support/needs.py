"""What a test needs from the host that `make test` installs (the engine venv, Debian's chromium, systemd's
tools, the demo model's download from PyPI). Outside CI a missing one skips, saying how to get it; in CI
(`CI=true`, as `.ci/run` sets) it fails the run: a CI that silently skips the real-engine tests passes nothing.

tests/conftest.py applies the same rule to every skip (skipif markers included), so this module is the one
place that says what "in CI" means and the message a missing tool gives."""

import os
from typing import NoReturn

import pytest

IN_CI = os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def missing(why: str) -> NoReturn:
    """Skip with `why` here; fail with it in CI."""
    if IN_CI:
        pytest.fail(f"CI=true and a test's requirement is missing: {why}", pytrace=False)
    pytest.skip(why)
