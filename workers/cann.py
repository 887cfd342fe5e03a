"""The Ascend host's software stack as vllm-ascend's installation page sets it up: the driver answers
`npu-smi info`; the CANN toolkit is installed and its set_env.sh sourced (ASCEND_TOOLKIT_HOME /
ASCEND_HOME_PATH, LD_LIBRARY_PATH, ASCEND_OPP_PATH); the ops (kernels) package is installed; NNAL's
set_env.sh is sourced (ATB_HOME_PATH, for libatb.so).

Standard library only, no Django: `make engine` runs scripts/engine_preflight.py with the system
python before any venv exists, and the environment doctor (workers/doctor.py) uses the same checks.
Each check answers a Missing (what, how to fix it, the section of the installation page) or None.
"""

import os
import platform
import subprocess
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


@dataclass(frozen=True)
class Missing:
    piece: str
    detail: str
    section: str

    def page(self, *, tag: str) -> str:
        return INSTALL_PAGE.format(tag=tag) + self.section

    def message(self, *, tag: str) -> str:
        return f"make engine stopped: {self.piece} is missing. {self.detail}\nFollow {self.page(tag=tag)}"


def toolkit_home(env: Mapping[str, str]) -> str | None:
    """Where set_env.sh says the toolkit is (newer releases export only ASCEND_HOME_PATH)."""
    return env.get("ASCEND_TOOLKIT_HOME") or env.get("ASCEND_HOME_PATH") or None


def toolkit_version(home: Path) -> str | None:
    candidates = [
        home / f"{platform.machine()}-linux" / TOOLKIT_INFO,
        home / TOOLKIT_INFO,
        *sorted(home.glob(f"*-linux/{TOOLKIT_INFO}")),
    ]
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


def check_driver(env: Mapping[str, str], which: Callable, run: Callable) -> Missing | None:
    npu_smi = which("npu-smi", path=env.get("PATH", ""))
    if not npu_smi:
        return Missing(
            "the Ascend driver and firmware (npu-smi)",
            "npu-smi is not on PATH: install the Ascend HDK driver and firmware.",
            HARDWARE,
        )
    try:
        result = run([npu_smi, "info"], capture_output=True, text=True, timeout=60, env=dict(env))
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Missing("a working Ascend driver", f"`npu-smi info` did not run: {exc}.", HARDWARE)
    if result.returncode != 0:
        said = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no output"]
        return Missing("a working Ascend driver", f"`npu-smi info` exited {result.returncode}: {said[0]}", HARDWARE)
    return None


def check_toolkit(env: Mapping[str, str], cann_version: str | None) -> tuple[Missing | None, Path | None]:
    """The toolkit set_env.sh points at, and (when `cann_version` is given) that it is that release.
    Returns (problem, None) or (None, the toolkit's home)."""
    toolkit = f"the CANN {cann_version} toolkit" if cann_version else "the CANN toolkit"
    package = f"Ascend-cann-toolkit_{cann_version}" if cann_version else "the Ascend-cann-toolkit release"
    set_home = toolkit_home(env)
    if not set_home:
        if Path(DEFAULT_TOOLKIT_HOME).is_dir():
            set_env = Path(DEFAULT_TOOLKIT_HOME).parent / "set_env.sh"
            return Missing(
                "the CANN environment",
                f"ASCEND_TOOLKIT_HOME and ASCEND_HOME_PATH are unset: run `source {set_env}` "
                "in this shell, then make engine again.",
                SOFTWARE,
            ), None
        return Missing(
            toolkit,
            f"ASCEND_TOOLKIT_HOME is unset and {DEFAULT_TOOLKIT_HOME} does not exist: install "
            f"{package} ({CANN_DOWNLOAD}).",
            SOFTWARE,
        ), None
    home = Path(set_home)
    if not home.is_dir():
        return Missing(
            toolkit, f"ASCEND_TOOLKIT_HOME/ASCEND_HOME_PATH points at {home}, which does not exist.", SOFTWARE
        ), None
    found = toolkit_version(home)
    if found is None:
        return Missing(
            toolkit, f"{home} has no {TOOLKIT_INFO}: the toolkit install is incomplete; reinstall {package}.", SOFTWARE
        ), None
    if (
        cann_version
        and found.upper() != cann_version.upper()
        and not found.upper().startswith(cann_version.upper() + ".")
    ):
        return Missing(
            f"CANN {cann_version}",
            f"{home} holds CANN {found}; this vllm-ascend release is built for CANN {cann_version} "
            f"(install Ascend-cann-toolkit_{cann_version} and source its set_env.sh).",
            REQUIREMENTS,
        ), None
    return None, home


def check_environment(env: Mapping[str, str], home: Path) -> Missing | None:
    set_env = home.parent / "set_env.sh"
    lib64 = home / "lib64"
    paths = [p for p in env.get("LD_LIBRARY_PATH", "").split(":") if p]
    if not any(_same_dir(p, lib64) for p in paths):
        return Missing(
            "the CANN environment",
            f"LD_LIBRARY_PATH does not contain {lib64}: run `source {set_env}` in this shell.",
            SOFTWARE,
        )
    opp = env.get("ASCEND_OPP_PATH")
    if not opp or not Path(opp).is_dir():
        return Missing(
            "the CANN environment",
            f"ASCEND_OPP_PATH is {'unset' if not opp else opp + ', which does not exist'}: "
            f"run `source {set_env}` in this shell.",
            SOFTWARE,
        )
    return None


def check_kernels(env: Mapping[str, str], cann_version: str | None) -> Missing | None:
    kernels = Path(env["ASCEND_OPP_PATH"]) / KERNEL_DIR
    if not kernels.is_dir() or not any(kernels.iterdir()):
        release = cann_version or "<CANN version>"
        return Missing(
            "the CANN kernels (ops) package",
            f"{kernels} is empty or absent: install the ops package for this chip, e.g. "
            f"Ascend-cann-910b-ops_{release} (Ascend-cann-kernels-* before CANN 8.5).",
            SOFTWARE,
        )
    return None


def check_nnal(env: Mapping[str, str], home: Path, cann_version: str | None) -> Missing | None:
    atb = env.get("ATB_HOME_PATH")
    if atb and Path(atb).is_dir():
        return None
    set_env = _nnal_set_env(home)
    if set_env:
        return Missing(
            "the NNAL environment (libatb.so)",
            f"ATB_HOME_PATH is unset: run `source {set_env}` in this shell.",
            SOFTWARE,
        )
    release = cann_version or toolkit_version(home) or "<CANN version>"
    return Missing(
        f"NNAL {release} (libatb.so)",
        f"no nnal/atb/set_env.sh beside {home}: install Ascend-cann-nnal_{release}.",
        SOFTWARE,
    )


def check_cann(env: Mapping[str, str], cann_version: str | None) -> tuple[Missing | None, Path | None]:
    """Toolkit, its environment, kernels and NNAL, in the installation page's order: (the first problem
    or None, the toolkit's home when one was found)."""
    problem, home = check_toolkit(env, cann_version)
    if problem:
        return problem, None
    problem = check_environment(env, home) or check_kernels(env, cann_version) or check_nnal(env, home, cann_version)
    return problem, home
