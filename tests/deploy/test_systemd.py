"""deploy/systemd, checked by systemd's own tools: `systemd-analyze verify` (syntax, dependencies, the
commands exist), `systemd-analyze security --offline` (the hardening each unit really ends up with, its
drop-ins included) and `systemd-sysusers` (the service user)."""

import json
import shutil
from pathlib import Path

import pytest

from tests.deploy.tools import DEPLOY, assert_clean, assert_refused, run, systemd_tool
from tests.support import ROOT

UNITS = DEPLOY / "systemd"
CONSOLE_UNITS = [
    "llm-console-web.service",
    "llm-console-worker@1.service",
    "llm-console-convert@1.service",
    "llm-console-bench.service",
    "llm-console-reaper.service",
    "llm-console-telemetry.service",
    "llm-console-gateway.service",
    "llm-console-migrate.service",
    "llm-console-controller.service",
]
AGENT = "llm-console-agent.service"


@pytest.fixture
def installed(tmp_path) -> Path:
    """The units as installed for this checkout: /opt/llm-console (where docs/deploy.md installs the code) is
    this repository, whose .venv has the python and gunicorn the units start, so verify's check that each
    command exists is a real one."""
    units = tmp_path / "units"
    shutil.copytree(UNITS, units)
    for path in units.rglob("*"):
        if path.suffix in {".service", ".conf", ".target"}:
            path.write_text(path.read_text().replace("/opt/llm-console", str(ROOT)))
    return units


def verify(units: Path, *names: str):
    # Units are named by path: verify then also finds their drop-in folders and each other beside them.
    return run([systemd_tool("systemd-analyze"), "verify", "--man=no", *(str(units / n) for n in names)], cwd=units)


def test_every_unit_and_the_target_pass_systemd_analyze_verify(installed):
    assert {p.name for p in UNITS.glob("*.service")} >= {AGENT, "llm-console-worker@.service"}
    assert_clean(verify(installed, "llm-console.target", *CONSOLE_UNITS, AGENT))


def test_the_agent_unit_alone_passes_verify(installed):
    """An inference host installs the agent without the console's other units nor the target."""
    alone = installed.parent / "agent-only"
    alone.mkdir()
    for name in (AGENT, "llm-console-.service.d"):
        (shutil.copytree if (installed / name).is_dir() else shutil.copy)(installed / name, alone / name)
    assert_clean(verify(alone, AGENT))


@pytest.mark.parametrize(
    "change, named",
    [
        (("ExecStart=" + str(ROOT) + "/.venv/bin/gunicorn", "ExecStart=/nowhere/gunicorn"), "/nowhere/gunicorn"),
        (("ExecReload=", "ExecRelaod="), "ExecRelaod"),
    ],
)
def test_verify_refuses_a_broken_unit(installed, change, named):
    web = installed / "llm-console-web.service"
    web.write_text(web.read_text().replace(*change))
    assert_refused(verify(installed, "llm-console-web.service"), named)


def security(units: Path, name: str, *options: str):
    return run([systemd_tool("systemd-analyze"), "security", "--offline=yes", *options, str(units / name)], cwd=units)


def checks(units: Path, name: str) -> dict[str, bool]:
    done = security(units, name, "--json=short")
    assert done.returncode == 0, done.stderr
    return {check["json_field"]: check["set"] for check in json.loads(done.stdout)}


HARDENED = [
    "UserOrDynamicUser",
    "NoNewPrivileges",
    "ProtectSystem",
    "ProtectHome",
    "PrivateTmp",
    "ProtectKernelTunables",
    "ProtectKernelModules",
    "ProtectControlGroups",
    "AmbientCapabilities",
]


@pytest.mark.parametrize("name", CONSOLE_UNITS)
def test_console_units_are_hardened(installed, name):
    found = checks(installed, name)
    assert [check for check in HARDENED + ["PrivateDevices"] if not found[check]] == []
    exposure = security(installed, name, "--threshold=30")  # 3.0 of 10 at most
    assert exposure.returncode == 0, exposure.stdout[-600:]


def test_the_agent_is_hardened_but_sees_the_npus(installed):
    found = checks(installed, AGENT)
    assert [check for check in HARDENED if not found[check]] == []
    # /dev/davinci* must stay visible, and the HwHiAiUser group opens them.
    assert found["PrivateDevices"] is False and found["SupplementaryGroups"] is False
    assert security(installed, AGENT, "--threshold=35").returncode == 0  # 3.5 of 10
    assert "KillMode=process" in (installed / AGENT).read_text()  # replicas outlive an agent restart


def test_hardening_comes_from_the_shared_drop_in(installed):
    """The negative control of the two above: without llm-console-.service.d the same unit is exposed."""
    shutil.rmtree(installed / "llm-console-.service.d")
    found = checks(installed, "llm-console-gateway.service")
    assert not found["UserOrDynamicUser"] and not found["ProtectSystem"]
    assert security(installed, "llm-console-gateway.service", "--threshold=30").returncode != 0


def test_sysusers_makes_the_service_user(tmp_path):
    (tmp_path / "etc").mkdir()  # an empty root: sysusers writes its passwd and group
    done = run([systemd_tool("systemd-sysusers"), f"--root={tmp_path}", str(UNITS / "llm-console.sysusers.conf")])
    assert done.returncode == 0, done.stderr
    user = next(line for line in (tmp_path / "etc/passwd").read_text().splitlines() if line.startswith("llm-console:"))
    name, _, uid, _, _, home, shell = user.split(":")
    assert int(uid) < 1000 and home == "/var/lib/llm-console" and shell.endswith("nologin")
