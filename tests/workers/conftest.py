import os
import sys

import pytest

from tests.support.fake_docker import install


@pytest.fixture
def docker(tmp_path, monkeypatch):
    """The stand-in `docker` (tests/support/fake_docker.py) first on PATH, its image played by this test
    run's python (no vLLM in it); returns its state directory."""
    state = tmp_path / "docker-state"
    install(tmp_path / "bin", state=state, image_python=sys.executable)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    return state
