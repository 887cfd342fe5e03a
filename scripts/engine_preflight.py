"""Checks an Ascend host before `make engine` builds vLLM and vllm-ascend from source.

The Makefile runs this file with the system python (no venv, no Django, standard library only).
It stops at the first missing piece with ONE message that names it and the section of upstream's
installation page to follow, instead of letting pip or CMake fail halfway with a traceback.

What it checks mirrors vllm-ascend's installation page (docs/source/installation.md at the pinned tag):
the driver answers `npu-smi info`; Python is in the release's range; the CANN toolkit of the
release's version is installed and its set_env.sh has been sourced (ASCEND_TOOLKIT_HOME /
ASCEND_HOME_PATH, LD_LIBRARY_PATH, ASCEND_OPP_PATH); the ops (kernels) package is installed;
NNAL's set_env.sh has been sourced (ATB_HOME_PATH, for libatb.so); the build tools are on PATH, and clang
where the Makefile installs triton-ascend (every chip but Atlas 300I / 310P).
The checks themselves live in workers/cann.py (standard library only), which `manage.py doctor` uses too.
"""

import argparse
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

# Run as a file (`python scripts/engine_preflight.py`), only scripts/ is on sys.path: add the checkout.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from workers.cann import PYTHON_SETUP, REQUIREMENTS, Missing, check_cann, check_driver  # noqa: E402

# installation.md, "Set up using Python": apt-get install -y gcc g++ cmake libnuma-dev wget git.
BUILD_TOOLS = ("git", "gcc", "g++", "cmake")
# triton-ascend compiles with clang: vllm-ascend's Dockerfile at tag v0.23.0, lines 24-29 ("Install clang-15 (for
# triton-ascend)": apt-get install clang-15, update-alternatives makes it `clang`; Dockerfile.a3 lines 26-31 and
# Dockerfile.openEuler lines 26-29 alike). installation.md does not list it; Dockerfile.310p installs neither clang
# nor triton-ascend (line 63 removes it), and the Makefile installs triton-ascend only off 310P.
TRITON_TOOLS = ("clang",)


def find_missing(
    *,
    env: Mapping[str, str],
    cann_version: str,
    python_version: tuple[int, int],
    python_range: tuple[tuple[int, int], tuple[int, int]] = ((3, 10), (3, 13)),
    which: Callable = shutil.which,
    run: Callable = subprocess.run,
) -> Missing | None:
    """The first missing piece, in the order upstream's installation page sets them up; None when ready."""
    problem = check_driver(env, which, run)
    if problem:
        return problem
    low, high = python_range
    if not low <= python_version < high:
        shown = ".".join(map(str, python_version))
        return Missing(
            f"a supported Python (>= {low[0]}.{low[1]}, < {high[0]}.{high[1]})",
            f"the engine venv would be built with Python {shown}: set PYTHON=python3.11.",
            REQUIREMENTS,
        )
    problem, _ = check_cann(env, cann_version)
    if problem:
        return problem
    absent = [tool for tool in BUILD_TOOLS if not which(tool, path=env.get("PATH", ""))]
    if absent:
        return Missing(
            "build tools",
            f"{', '.join(absent)} not on PATH: apt-get install -y gcc g++ cmake "
            "libnuma-dev git (yum install gcc g++ cmake numactl-devel git).",
            PYTHON_SETUP,
        )
    if not atlas_300i(env, which, run) and not all(which(tool, path=env.get("PATH", "")) for tool in TRITON_TOOLS):
        return Missing(
            "clang (for triton-ascend)",
            "clang not on PATH: apt-get install -y clang-15 && update-alternatives --install /usr/bin/clang clang "
            "/usr/bin/clang-15 20 (yum install clang), as vllm-ascend's Dockerfile does for triton-ascend.",
            PYTHON_SETUP,
        )
    return None


def atlas_300i(env: Mapping[str, str], which: Callable, run: Callable) -> bool:
    """Does `npu-smi info` name a 310P chip (Atlas 300I), where upstream runs no triton-ascend? The Makefile asks
    the same question (grep 310P) before installing triton-ascend."""
    npu_smi = which("npu-smi", path=env.get("PATH", ""))
    try:
        result = run([npu_smi, "info"], capture_output=True, text=True, timeout=60, env=dict(env))
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "310P" in (result.stdout or "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cann", required=True, help="CANN version of the pinned vllm-ascend release")
    parser.add_argument("--vllm-ascend", required=True, help="vllm-ascend git tag (names the docs to follow)")
    args = parser.parse_args(argv)
    missing = find_missing(env=os.environ, cann_version=args.cann, python_version=sys.version_info[:2])
    if missing:
        print(missing.message(tag=args.vllm_ascend), file=sys.stderr)
        return 1
    print(
        f"Ascend host ready for vllm-ascend {args.vllm_ascend}: npu-smi answers, CANN {args.cann} "
        f"at {os.environ.get('ASCEND_TOOLKIT_HOME') or os.environ.get('ASCEND_HOME_PATH')}, kernels and NNAL set."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
