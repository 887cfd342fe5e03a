"""The first Admin's password (issue 39, probe finding): read from CONSOLE_ADMIN_PASSWORD or the file named by
CONSOLE_ADMIN_PASSWORD_FILE by `ensure_admin` alone; a generated one goes into a 0600 file, never to stdout
(which `make run`, the compose and Kubernetes logs keep); the console's long-running processes (`make run`'s
supervisord and every program under it) and their children never get either variable."""

import io
import os
import stat
import subprocess
import sys

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command

from console.env import child_environment
from tests.support import ROOT

ADMIN_VARIABLES = ("CONSOLE_ADMIN_PASSWORD", "CONSOLE_ADMIN_PASSWORD_FILE")


@pytest.mark.django_db
def test_a_generated_password_goes_to_a_private_file_not_to_stdout(monkeypatch, settings, tmp_path):
    for name in ADMIN_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    settings.DATA_DIR = tmp_path
    out = io.StringIO()
    call_command("ensure_admin", stdout=out)
    kept = tmp_path / "initial_admin_password"
    password = kept.read_text().strip()
    assert get_user_model().objects.get(username="admin").check_password(password)
    assert password not in out.getvalue() and str(kept) in out.getvalue()
    assert stat.S_IMODE(kept.stat().st_mode) == 0o600


@pytest.mark.django_db
def test_the_password_may_come_from_a_file(monkeypatch, settings, tmp_path):
    monkeypatch.delenv("CONSOLE_ADMIN_PASSWORD", raising=False)
    given = tmp_path / "admin_password"
    given.write_text("a long password from a file\n")
    monkeypatch.setenv("CONSOLE_ADMIN_PASSWORD_FILE", str(given))
    settings.DATA_DIR = tmp_path / "data"
    out = io.StringIO()
    call_command("ensure_admin", stdout=out)
    assert get_user_model().objects.get(username="admin").check_password("a long password from a file")
    assert "CONSOLE_ADMIN_PASSWORD_FILE" in out.getvalue() and "a long password" not in out.getvalue()
    assert not (tmp_path / "data" / "initial_admin_password").exists()


def test_child_processes_never_inherit_the_admin_password():
    base = {"PATH": "/usr/bin", "CONSOLE_ADMIN_PASSWORD": "secret", "CONSOLE_ADMIN_PASSWORD_FILE": "/etc/x"}
    assert child_environment({}, base=base) == {"PATH": "/usr/bin"}


def test_make_run_starts_supervisord_without_the_admin_password(tmp_path):
    """`make run` with the password in its environment (ensure_admin, in `make migrate`, reads it): supervisord,
    and so every program it starts, runs without it. A fake supervisord records what it was given."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    fake = venv / "bin" / "supervisord"
    fake.write_text('#!/bin/sh\nenv > "$DATA_DIR/supervisord.env"\n')
    fake.chmod(0o700)
    # `make run` writes the gateway pool's files first (manage.py gateway_pool): the real interpreter does that.
    python = venv / "bin" / "python"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o700)
    env = {**os.environ, "CONSOLE_ADMIN_PASSWORD": "first admin pw", "CONSOLE_ADMIN_PASSWORD_FILE": "/etc/pw"}
    data = tmp_path / "data"
    done = subprocess.run(
        ["make", "-s", "-o", "setup", "run", f"VENV={venv}", f"DATA_DIR={data}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    seen = dict(line.split("=", 1) for line in (data / "supervisord.env").read_text().splitlines() if "=" in line)
    assert seen["DATA_DIR"] == str(data)  # it did run, with the console's settings
    for name in ADMIN_VARIABLES:
        assert name not in seen, name


def test_supervisord_conf_passes_no_admin_password_to_its_programs():
    text = (ROOT / "deploy" / "supervisord.conf").read_text()
    lines = [line for line in text.splitlines() if line.strip().startswith("environment")]
    assert lines and not [line for line in lines if "ADMIN" in line], lines
