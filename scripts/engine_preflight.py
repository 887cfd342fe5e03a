"""Checks an Ascend host before `make engine` builds vLLM and vllm-ascend from source.

The Makefile runs this file with the system python (no venv, no Django, standard library only).
It stops at the first missing piece with ONE message that names it and the section of upstream's
installation page to follow, instead of letting pip or CMake fail halfway with a traceback.

What it checks mirrors vllm-ascend's installation page (docs/source/installation.md at the pinned tag):
the driver answers `npu-smi info`; Python is in the release's range; the CANN toolkit of the
release's version is installed and its set_env.sh has been sourced (ASCEND_TOOLKIT_HOME /
ASCEND_HOME_PATH, LD_LIBRARY_PATH, ASCEND_OPP_PATH); the ops (kernels) package is installed;
NNAL's set_env.sh has been sourced (ATB_HOME_PATH, for libatb.so); the build tools are on PATH.
"""
import argparse
import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

INSTALL_PAGE = "https://github.com/vllm-project/vllm-ascend/blob/{tag}/docs/source/installation.md"
CANN_DOWNLOAD = "https://www.hiascend.com/cann/download"
# Section anchors of the installation page.
HARDWARE = "#configure-hardware-environment"
SOFTWARE = "#configure-software-environment"
REQUIREMENTS = "#requirements"
PYTHON_SETUP = "#set-up-using-python"

DEFAULT_TOOLKIT_HOME = "/usr/local/Ascend/ascend-toolkit/latest"
TOOLKIT_INFO = "ascend_toolkit_install.info"
# Where the ops (kernels) package puts the compiled operator binaries, below ASCEND_OPP_PATH.
KERNEL_DIR = Path("built-in") / "op_impl" / "ai_core" / "tbe" / "kernel"
# installation.md, "Set up using Python": apt-get install -y gcc g++ cmake libnuma-dev wget git.
BUILD_TOOLS = ("git", "gcc", "g++", "cmake")


@dataclass(frozen=True)
class Missing:
    piece: str
    detail: str
    section: str

    def message(self, *, tag: str) -> str:
        return (f"make engine stopped: {self.piece} is missing. {self.detail}\n"
                f"Follow {INSTALL_PAGE.format(tag=tag)}{self.section}")


def _toolkit_version(home: Path) -> str | None:
    candidates = [home / f"{platform.machine()}-linux" / TOOLKIT_INFO, home / TOOLKIT_INFO,
                  *sorted(home.glob(f"*-linux/{TOOLKIT_INFO}"))]
    for path in candidates:
        if path.is_file():
            for line in path.read_text(errors="replace").splitlines():
                if line.startswith("version="):
                    return line.split("=", 1)[1].strip()
    return None


def _same_dir(a: str | Path, b: str | Path) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def _nnal_set_env(home: Path) -> Path | None:
    """NNAL installs beside the toolkit (…/Ascend/nnal/atb/set_env.sh); look in home's parents."""
    for parent in home.resolve().parents:
        candidate = parent / "nnal" / "atb" / "set_env.sh"
        if candidate.is_file():
            return candidate
    return None


def _check_driver(env, which, run) -> Missing | None:
    npu_smi = which("npu-smi", path=env.get("PATH", ""))
    if not npu_smi:
        return Missing("the Ascend driver and firmware (npu-smi)",
                       "npu-smi is not on PATH: install the Ascend HDK driver and firmware.", HARDWARE)
    try:
        result = run([npu_smi, "info"], capture_output=True, text=True, timeout=60, env=dict(env))
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Missing("a working Ascend driver", f"`npu-smi info` did not run: {exc}.", HARDWARE)
    if result.returncode != 0:
        said = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no output"]
        return Missing("a working Ascend driver",
                       f"`npu-smi info` exited {result.returncode}: {said[0]}", HARDWARE)
    return None


def _check_toolkit(env, cann_version: str) -> tuple[Missing | None, Path | None]:
    set_home = env.get("ASCEND_TOOLKIT_HOME") or env.get("ASCEND_HOME_PATH")
    if not set_home:
        if Path(DEFAULT_TOOLKIT_HOME).is_dir():
            set_env = Path(DEFAULT_TOOLKIT_HOME).parent / "set_env.sh"
            return Missing("the CANN environment",
                           f"ASCEND_TOOLKIT_HOME and ASCEND_HOME_PATH are unset: run `source {set_env}` "
                           "in this shell, then make engine again.", SOFTWARE), None
        return Missing(f"the CANN {cann_version} toolkit",
                       f"ASCEND_TOOLKIT_HOME is unset and {DEFAULT_TOOLKIT_HOME} does not exist: install "
                       f"Ascend-cann-toolkit_{cann_version} ({CANN_DOWNLOAD}).", SOFTWARE), None
    home = Path(set_home)
    if not home.is_dir():
        return Missing(f"the CANN {cann_version} toolkit",
                       f"ASCEND_TOOLKIT_HOME/ASCEND_HOME_PATH points at {home}, which does not exist.",
                       SOFTWARE), None
    found = _toolkit_version(home)
    if found is None:
        return Missing(f"the CANN {cann_version} toolkit",
                       f"{home} has no {TOOLKIT_INFO}: the toolkit install is incomplete; reinstall "
                       f"Ascend-cann-toolkit_{cann_version}.", SOFTWARE), None
    if found.upper() != cann_version.upper() and not found.upper().startswith(cann_version.upper() + "."):
        return Missing(f"CANN {cann_version}",
                       f"{home} holds CANN {found}; this vllm-ascend release is built for CANN {cann_version} "
                       f"(install Ascend-cann-toolkit_{cann_version} and source its set_env.sh).",
                       REQUIREMENTS), None
    return None, home


def _check_environment(env, home: Path) -> Missing | None:
    set_env = home.parent / "set_env.sh"
    lib64 = home / "lib64"
    paths = [p for p in env.get("LD_LIBRARY_PATH", "").split(":") if p]
    if not any(_same_dir(p, lib64) for p in paths):
        return Missing("the CANN environment",
                       f"LD_LIBRARY_PATH does not contain {lib64}: run `source {set_env}` in this shell.",
                       SOFTWARE)
    opp = env.get("ASCEND_OPP_PATH")
    if not opp or not Path(opp).is_dir():
        return Missing("the CANN environment",
                       f"ASCEND_OPP_PATH is {'unset' if not opp else opp + ', which does not exist'}: "
                       f"run `source {set_env}` in this shell.", SOFTWARE)
    return None


def _check_kernels(env, cann_version: str) -> Missing | None:
    kernels = Path(env["ASCEND_OPP_PATH"]) / KERNEL_DIR
    if not kernels.is_dir() or not any(kernels.iterdir()):
        return Missing("the CANN kernels (ops) package",
                       f"{kernels} is empty or absent: install the ops package for this chip, e.g. "
                       f"Ascend-cann-910b-ops_{cann_version} (Ascend-cann-kernels-* before CANN 8.5).",
                       SOFTWARE)
    return None


def _check_nnal(env, home: Path, cann_version: str) -> Missing | None:
    atb = env.get("ATB_HOME_PATH")
    if atb and Path(atb).is_dir():
        return None
    set_env = _nnal_set_env(home)
    if set_env:
        return Missing("the NNAL environment (libatb.so)",
                       f"ATB_HOME_PATH is unset: run `source {set_env}` in this shell.", SOFTWARE)
    return Missing(f"NNAL {cann_version} (libatb.so)",
                   f"no nnal/atb/set_env.sh beside {home}: install Ascend-cann-nnal_{cann_version}.", SOFTWARE)


def find_missing(*, env: Mapping[str, str], cann_version: str, python_version: tuple[int, int],
                 python_range: tuple[tuple[int, int], tuple[int, int]] = ((3, 10), (3, 13)),
                 which: Callable = shutil.which, run: Callable = subprocess.run) -> Missing | None:
    """The first missing piece, in the order upstream's installation page sets them up; None when ready."""
    problem = _check_driver(env, which, run)
    if problem:
        return problem
    low, high = python_range
    if not low <= python_version < high:
        shown = ".".join(map(str, python_version))
        return Missing(f"a supported Python (>= {low[0]}.{low[1]}, < {high[0]}.{high[1]})",
                       f"the engine venv would be built with Python {shown}: set PYTHON=python3.11.", REQUIREMENTS)
    problem, home = _check_toolkit(env, cann_version)
    if problem:
        return problem
    problem = (_check_environment(env, home) or _check_kernels(env, cann_version)
               or _check_nnal(env, home, cann_version))
    if problem:
        return problem
    absent = [tool for tool in BUILD_TOOLS if not which(tool, path=env.get("PATH", ""))]
    if absent:
        return Missing("build tools", f"{', '.join(absent)} not on PATH: apt-get install -y gcc g++ cmake "
                       "libnuma-dev git (yum install gcc g++ cmake numactl-devel git).", PYTHON_SETUP)
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cann", required=True, help="CANN version of the pinned vllm-ascend release")
    parser.add_argument("--vllm-ascend", required=True, help="vllm-ascend git tag (names the docs to follow)")
    args = parser.parse_args(argv)
    missing = find_missing(env=os.environ, cann_version=args.cann, python_version=sys.version_info[:2])
    if missing:
        print(missing.message(tag=args.vllm_ascend), file=sys.stderr)
        return 1
    print(f"Ascend host ready for vllm-ascend {args.vllm_ascend}: npu-smi answers, CANN {args.cann} "
          f"at {os.environ.get('ASCEND_TOOLKIT_HOME') or os.environ.get('ASCEND_HOME_PATH')}, kernels and NNAL set.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
