"""Constructed CANN installs for the Ascend host checks (scripts/engine_preflight.py, manage.py doctor):
the directory layout and the variables set_env.sh exports, with the fake npu-smi first on PATH."""

import os
import platform
import subprocess
import sys
from pathlib import Path

from tests.support import FAKE_NPU_SMI
from workers.cann import KERNEL_DIR

CANN = "9.1.0"  # the release vllm-ascend v0.23.0 (the Makefile's pin) is built for


def cann_tree(root: Path, *, version: str = CANN, info: bool = True, kernels: bool = True, nnal: bool = True) -> Path:
    """An installed CANN layout: …/Ascend/ascend-toolkit/{set_env.sh,latest/…}, nnal/atb beside it."""
    ascend = root / "Ascend"
    home = ascend / "ascend-toolkit" / "latest"
    arch_dir = home / f"{platform.machine()}-linux"
    arch_dir.mkdir(parents=True)
    if info:
        (arch_dir / "ascend_toolkit_install.info").write_text(
            f"package_name=Ascend-cann-toolkit\nversion={version}\narch={platform.machine()}\nos=linux\n"
        )
    (home / "lib64").mkdir()
    (ascend / "ascend-toolkit" / "set_env.sh").write_text("# stand-in\n")
    (home / "opp").mkdir()
    if kernels:
        (home / "opp" / KERNEL_DIR / "ascend910b").mkdir(parents=True)
    if nnal:
        (ascend / "nnal" / "atb" / "latest").mkdir(parents=True)
        (ascend / "nnal" / "atb" / "set_env.sh").write_text("# stand-in\n")
    return home


def tools_dir(root: Path, names=("git", "gcc", "g++", "cmake")) -> Path:
    """A PATH folder with the build tools and python3 (the fake npu-smi's interpreter), nothing else."""
    folder = root / "bin"
    folder.mkdir()
    for name in names:
        tool = folder / name
        tool.write_text("#!/bin/sh\nexit 0\n")
        tool.chmod(0o755)
    (folder / "python3").symlink_to(os.path.realpath(sys.executable))
    return folder


def sourced_env(home: Path, bin_dir: Path) -> dict:
    """The variables ascend-toolkit/set_env.sh and nnal/atb/set_env.sh export (those checked here)."""
    return {
        "PATH": f"{FAKE_NPU_SMI}:{bin_dir}",
        "ASCEND_TOOLKIT_HOME": str(home),
        "ASCEND_HOME_PATH": str(home),
        "LD_LIBRARY_PATH": f"{home}/lib64:{home}/lib64/plugin/opskernel:/usr/local/Ascend/driver/lib64",
        "ASCEND_OPP_PATH": str(home / "opp"),
        "ATB_HOME_PATH": str(home.parent.parent / "nnal" / "atb" / "latest"),
    }


# The vllm-ascend v0.23.0 row of workers/data/vllm_ascend_compatibility_matrix.md.
ENGINE_ROW = {"vllm": "0.23.0", "vllm-ascend": "0.23.0", "torch": "2.10.0", "torch-npu": "2.10.0.post4"}


def ascend_engine(root: Path, **versions: str) -> Path:
    """An engine environment as `make engine` builds it on an Ascend host, for a machine that cannot
    install torch-npu: a real venv whose package metadata says vLLM / vllm-ascend / torch / torch-npu
    (versions: ENGINE_ROW with `torch_npu="2.9.0"`-style overrides), and stand-in torch and torch_npu
    modules that import and count 8 NPUs. Returns its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    python = root / "bin" / "python"
    purelib = Path(
        subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    wanted = {**ENGINE_ROW, **{name.replace("_", "-"): v for name, v in versions.items()}}
    for name, version in wanted.items():
        dist = purelib / f"{name.replace('-', '_')}-{version}.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (purelib / "torch").mkdir()
    (purelib / "torch" / "__init__.py").write_text("npu = None  # torch_npu sets it on import, as the real one does\n")
    (purelib / "torch_npu").mkdir()
    (purelib / "torch_npu" / "__init__.py").write_text(
        "import types\nimport torch\n"
        f"__version__ = {wanted['torch-npu']!r}\n"
        "torch.npu = types.SimpleNamespace(device_count=lambda: 8)\n"
    )
    return python
