"""scripts/engine_preflight.py: `make engine` on an Ascend host names the one missing piece and the
upstream page, before any pip. Tested with constructed CANN directories, the fake npu-smi (replaying a
real 910B4 sample) on PATH, and environment variations; then through `make` itself."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.engine_preflight import BUILD_TOOLS, TRITON_TOOLS, find_missing, main
from tests.support import FAKE_NPU_SMI, FIXTURES, ROOT
from tests.support.cann import CANN, cann_tree, sourced_env, tools_dir
from tests.support.npu_smi import FakeNpuSmi
from workers import cann as cann_checks

PAGE = "https://github.com/vllm-project/vllm-ascend/blob/v0.23.0/docs/source/installation.md"


@pytest.fixture
def host(tmp_path):
    home = cann_tree(tmp_path)
    return home, sourced_env(home, tools_dir(tmp_path, names=(*BUILD_TOOLS, *TRITON_TOOLS)))


def missing(env, **kwargs):
    return find_missing(env=env, cann_version=CANN, python_version=kwargs.pop("python_version", (3, 11)), **kwargs)


def test_a_ready_host_passes(host, monkeypatch, capsys):
    home, env = host
    assert missing(env) is None
    # ASCEND_HOME_PATH alone (what newer set_env.sh exports) is enough too.
    assert missing({k: v for k, v in env.items() if k != "ASCEND_TOOLKIT_HOME"}) is None
    monkeypatch.setattr(os, "environ", env)
    assert main(["--cann", CANN, "--vllm-ascend", "v0.23.0"]) == 0
    assert f"CANN {CANN} at {home}" in capsys.readouterr().out


def test_no_npu_smi_names_the_driver(host):
    _, env = host
    env["PATH"] = env["PATH"].split(":", 1)[1]
    problem = missing(env)
    assert problem.piece == "the Ascend driver and firmware (npu-smi)"
    assert problem.message(tag="v0.23.0").endswith(f"Follow {PAGE}#configure-hardware-environment")


def test_npu_smi_that_fails_names_the_driver_with_its_error(host, tmp_path):
    _, env = host
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "npu-smi").write_text("#!/bin/sh\necho 'dcmi module initialize failed. ret is -8005' >&2\nexit 8\n")
    (broken / "npu-smi").chmod(0o755)
    env["PATH"] = f"{broken}:{env['PATH'].split(':', 1)[1]}"
    problem = missing(env)
    assert problem.piece == "a working Ascend driver"
    assert "exited 8: dcmi module initialize failed. ret is -8005" in problem.detail


def test_python_outside_the_release_range(host):
    _, env = host
    problem = missing(env, python_version=(3, 13))
    assert problem.piece == "a supported Python (>= 3.10, < 3.13)" and "Python 3.13" in problem.detail
    assert problem.section == "#requirements"


def test_no_toolkit_anywhere(host, tmp_path, monkeypatch):
    _, env = host
    monkeypatch.setattr(cann_checks, "DEFAULT_TOOLKIT_HOME", str(tmp_path / "nowhere"))
    del env["ASCEND_TOOLKIT_HOME"], env["ASCEND_HOME_PATH"]
    problem = missing(env)
    assert problem.piece == "the CANN 9.1.0 toolkit"
    assert "install Ascend-cann-toolkit_9.1.0" in problem.detail and "#configure-software-environment" in (
        problem.message(tag="v0.23.0")
    )


def test_toolkit_installed_but_set_env_not_sourced(host, monkeypatch):
    home, env = host
    monkeypatch.setattr(cann_checks, "DEFAULT_TOOLKIT_HOME", str(home))
    bare = {"PATH": env["PATH"]}
    problem = missing(bare)
    assert problem.piece == "the CANN environment"
    assert f"source {home.parent / 'set_env.sh'}" in problem.detail


def test_toolkit_home_that_does_not_exist(host, tmp_path):
    _, env = host
    env["ASCEND_TOOLKIT_HOME"] = env["ASCEND_HOME_PATH"] = str(tmp_path / "gone")
    problem = missing(env)
    assert problem.piece == "the CANN 9.1.0 toolkit" and "does not exist" in problem.detail


def test_toolkit_without_its_install_info(tmp_path):
    home = cann_tree(tmp_path, info=False)
    problem = missing(sourced_env(home, tools_dir(tmp_path)))
    assert problem.piece == "the CANN 9.1.0 toolkit" and "ascend_toolkit_install.info" in problem.detail


def test_toolkit_of_another_cann_release(tmp_path):
    home = cann_tree(tmp_path, version="8.5.1")
    problem = missing(sourced_env(home, tools_dir(tmp_path)))
    assert problem.piece == "CANN 9.1.0" and "holds CANN 8.5.1" in problem.detail


@pytest.mark.parametrize(
    "variable, says",
    [("LD_LIBRARY_PATH", "LD_LIBRARY_PATH does not contain"), ("ASCEND_OPP_PATH", "ASCEND_OPP_PATH is unset")],
)
def test_environment_half_set(host, variable, says):
    home, env = host
    del env[variable]
    problem = missing(env)
    assert problem.piece == "the CANN environment" and says in problem.detail
    assert f"source {home.parent / 'set_env.sh'}" in problem.detail


def test_kernels_package_missing(tmp_path):
    home = cann_tree(tmp_path, kernels=False)
    problem = missing(sourced_env(home, tools_dir(tmp_path)))
    assert problem.piece == "the CANN kernels (ops) package" and "Ascend-cann-910b-ops_9.1.0" in problem.detail


def test_nnal_installed_but_not_sourced(host):
    home, env = host
    del env["ATB_HOME_PATH"]
    problem = missing(env)
    assert problem.piece == "the NNAL environment (libatb.so)"
    assert f"source {home.parent.parent / 'nnal' / 'atb' / 'set_env.sh'}" in problem.detail


def test_nnal_not_installed(tmp_path):
    home = cann_tree(tmp_path, nnal=False)
    env = sourced_env(home, tools_dir(tmp_path))
    del env["ATB_HOME_PATH"]
    problem = missing(env)
    assert problem.piece == "NNAL 9.1.0 (libatb.so)" and "Ascend-cann-nnal_9.1.0" in problem.detail


def test_build_tools_missing(tmp_path):
    home = cann_tree(tmp_path)
    problem = missing(sourced_env(home, tools_dir(tmp_path, names=("git", "gcc"))))
    assert problem.piece == "build tools" and problem.detail.startswith("g++, cmake not on PATH")
    assert problem.section == "#set-up-using-python"


def test_clang_missing_where_triton_ascend_is_installed(tmp_path):
    """vllm-ascend's Dockerfile (lines 24-29 at v0.23.0) installs clang-15 as clang "for triton-ascend"."""
    home = cann_tree(tmp_path)
    problem = missing(sourced_env(home, tools_dir(tmp_path, names=BUILD_TOOLS)))
    assert problem.piece == "clang (for triton-ascend)" and "apt-get install -y clang-15" in problem.detail


def test_atlas_300i_needs_no_clang(tmp_path):
    """Dockerfile.310p installs neither clang nor triton-ascend, and the Makefile installs no triton-ascend there."""
    home = cann_tree(tmp_path)
    env = sourced_env(home, tools_dir(tmp_path, names=BUILD_TOOLS))
    fake = FakeNpuSmi(tmp_path / "npu-310p", dir=FIXTURES / "npu-smi", default="info_310P3_v25.3.rc1.txt")
    env["PATH"] = fake.path_first(env["PATH"])
    assert missing(env) is None


def make_engine(tmp_path, env, *extra):
    return subprocess.run(
        ["make", "-B", f"ENGINE_VENV={tmp_path / 'engine-venv'}", f"PYTHON={sys.executable}", *extra, "engine"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.skipif(not shutil.which("make"), reason="make is not installed")
def test_make_engine_stops_with_one_message_before_any_pip(tmp_path, monkeypatch):
    """npu-smi on PATH makes `make engine` take the Ascend path; with no CANN here it stops at once."""
    if Path(cann_checks.DEFAULT_TOOLKIT_HOME).exists():
        pytest.skip("this machine has a CANN toolkit installed")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ASCEND_", "ATB_"))}
    env["PATH"] = f"{FAKE_NPU_SMI}:{env['PATH']}"
    result = make_engine(tmp_path, env)
    assert result.returncode != 0
    said = [line for line in result.stderr.splitlines() if not line.startswith(("make:", "make["))]
    assert said == [
        (
            "make engine stopped: the CANN 9.1.0 toolkit is missing. ASCEND_TOOLKIT_HOME is unset and "
            "/usr/local/Ascend/ascend-toolkit/latest does not exist: install Ascend-cann-toolkit_9.1.0 "
            "(https://www.hiascend.com/cann/download)."
        ),
        f"Follow {PAGE}#configure-software-environment",
    ]
    assert "Traceback" not in result.stderr + result.stdout and "pip" not in result.stdout
    assert not (tmp_path / "engine-venv").exists()


@pytest.mark.skipif(not shutil.which("make"), reason="make is not installed")
def test_make_engine_on_a_ready_host_follows_upstreams_source_build(host, tmp_path):
    """`make -n`: the commands a ready Ascend host runs, in upstream's order (nothing is installed)."""
    _, env = host
    env["PATH"] = f"{env['PATH']}:{os.environ['PATH']}"
    result = make_engine(tmp_path, env, "-n")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.replace("\\\n\t", "").splitlines()  # continuation lines joined
    order = [
        "scripts/engine_preflight.py --cann 9.1.0 --vllm-ascend v0.23.0",
        "-r requirements/engine-ascend.txt --extra-index-url https://download.pytorch.org/whl/cpu",
        "git clone --depth 1 --branch v0.23.0 https://github.com/vllm-project/vllm /",
        "VLLM_TARGET_DEVICE=empty ",
        "git clone --depth 1 --branch v0.23.0 https://github.com/vllm-project/vllm-ascend /",
        "submodule update --init --recursive",
        "triton-ascend==3.2.2",
    ]
    positions = [next(i for i, line in enumerate(lines) if step in line) for step in order]
    assert positions == sorted(positions)
