"""In CI (CI=true: .ci/run) a skipped test fails the run, whatever skipped it; only `network` tests may skip
(tests/conftest.py, tests/support/needs.py). Run on a scratch test file in a pytest of its own."""

import os
import shutil
import subprocess
import sys

from tests.support import ROOT

SCRATCH = '''
import pytest

from tests.support.needs import missing


def test_needs_chromium():
    missing("no chromium here")


@pytest.mark.skipif(True, reason="no .venv-engine")
def test_needs_the_engine():
    pass


@pytest.mark.network
def test_asks_a_registry():
    pytest.skip("the index cannot be reached")
'''


def _run(ci: str) -> str:
    """The scratch file runs inside tests/ (so tests/conftest.py applies), in a folder removed afterwards."""
    scratch = ROOT / "tests" / f"ci_scratch_{os.getpid()}"
    scratch.mkdir()
    try:
        (scratch / "test_scratch.py").write_text(SCRATCH)
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rA", str(scratch / "test_scratch.py")],
            cwd=ROOT,
            env={**os.environ, "CI": ci},
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        shutil.rmtree(scratch)
    return done.stdout


def test_a_skip_fails_in_ci_except_a_network_one():
    outside = _run("")
    assert "3 skipped" in outside, outside
    inside = _run("true")
    assert "1 skipped" in inside and "the index cannot be reached" in inside, inside
    assert "FAILED" in inside and "no chromium here" in inside, inside
    assert "ERROR" in inside and "CI=true: a skipped test fails the run (Skipped: no .venv-engine)" in inside, inside
