"""Where the deployment linters are and how tests/deploy run them. hadolint, kubectl, kubernetes-validate
and docker-compose come with requirements/dev.txt into the venv's bin; systemd-analyze from Debian's
systemd (`make systemd-analyze`)."""

import shutil
import subprocess
import sys
from pathlib import Path

from tests.support import ROOT
from tests.support.needs import missing

DEPLOY = ROOT / "deploy"
VENV_BIN = Path(sys.executable).parent


def tool(name: str) -> str:
    """The venv's pinned copy first (kubectl 1.37 there, whatever the host has), else the host's."""
    pinned = VENV_BIN / name
    found = str(pinned) if pinned.exists() else shutil.which(name)
    assert found, f"{name} not found: `make venv` installs it (requirements/dev.txt)"
    return found


def systemd_tool(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        missing(f"{name} not found: `make systemd-analyze` installs Debian's systemd package")
    return found


def run(argv: list[str], *, cwd: Path = ROOT, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def clean(done: subprocess.CompletedProcess) -> bool:
    """Exit 0 and nothing said: the linters print warnings (systemd's unknown keys, hadolint's infos) and
    some still exit 0, so a word on either stream counts as a finding too."""
    return done.returncode == 0 and not done.stdout.strip() and not done.stderr.strip()


def assert_clean(done: subprocess.CompletedProcess) -> None:
    assert clean(done), f"{done.args[0]} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"


def assert_refused(done: subprocess.CompletedProcess, *words: str) -> None:
    """The negative controls: the linter objects to a file broken on purpose, naming what is broken."""
    said = done.stdout + done.stderr
    assert not clean(done) and all(word in said for word in words), said
