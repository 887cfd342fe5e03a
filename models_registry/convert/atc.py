"""Ascend ATC (CANN toolkit): ONNX -> OM."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

from console.env import child_environment
from models_registry.convert.common import ConversionError, first_line
from workers.jobs.children import start_job_child, stop_job_child


class AtcNotFound(ConversionError):
    """The Ascend ATC tool (CANN toolkit) is not installed on this node."""


ATC_NOT_FOUND_MESSAGE = "ATC not found on this node: install the CANN toolkit"

# Ascend SoC names accepted by ATC's --soc_version (npu-smi shows the part after "Ascend").
ATC_SOC_VERSIONS = (
    "Ascend310",
    "Ascend310B1",
    "Ascend310B2",
    "Ascend310B3",
    "Ascend310B4",
    "Ascend310P1",
    "Ascend310P3",
    "Ascend310P5",
    "Ascend310P7",
    "Ascend910",
    "Ascend910A",
    "Ascend910B",
    "Ascend910ProA",
    "Ascend910ProB",
    "Ascend910PremiumA",
    "Ascend910B1",
    "Ascend910B2",
    "Ascend910B2C",
    "Ascend910B3",
    "Ascend910B4",
    "Ascend910B4-1",
    "Ascend910_9391",
    "Ascend910_9392",
    "Ascend910_9381",
    "Ascend910_9382",
    "Ascend910_9372",
    "Ascend910_9362",
)
ATC_PRECISION_MODES = ("force_fp16", "allow_mix_precision", "allow_fp32_to_fp16", "must_keep_origin_dtype")
ATC_DEFAULT_PATHS = (
    "/usr/local/Ascend/ascend-toolkit/latest/bin/atc",
    "/usr/local/Ascend/ascend-toolkit/latest/atc/bin/atc",
    "/usr/local/Ascend/latest/bin/atc",
    "/usr/local/Ascend/cann/bin/atc",
    "~/Ascend/ascend-toolkit/latest/bin/atc",
    "~/Ascend/ascend-toolkit/latest/atc/bin/atc",
)

# ----------------------------------------------------------------------------------------------
# 5. ATC (ONNX -> Ascend OM)
# ----------------------------------------------------------------------------------------------


def find_atc() -> str | None:
    """Path of the ATC executable: on PATH, under $ASCEND_TOOLKIT_HOME / $ASCEND_HOME_PATH, or in the
    CANN toolkit's default install locations; None when absent."""
    found = shutil.which("atc")
    if found:
        return found
    candidates = []
    for var in ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH", "ASCEND_HOME"):
        home = os.environ.get(var)
        if home:
            candidates += [Path(home) / "bin" / "atc", Path(home) / "atc" / "bin" / "atc"]
    candidates += [Path(p).expanduser() for p in ATC_DEFAULT_PATHS]
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    return None


def normalize_soc(soc_version: str) -> str:
    text = re.sub(r"\s+", "", str(soc_version or ""))
    if not text.lower().startswith("ascend"):
        text = "Ascend" + text
    by_lower = {s.lower(): s for s in ATC_SOC_VERSIONS}
    soc = by_lower.get(text.lower())
    if soc is None:
        raise ConversionError(
            f"Invalid SoC version {soc_version!r}: use the chip name npu-smi shows, e.g. "
            f"Ascend910B4 or Ascend310P3 (known: {', '.join(ATC_SOC_VERSIONS)})."
        )
    return soc


_INPUT_SHAPE_RE = re.compile(r"^[A-Za-z0-9_./-]+:-?\d+(,-?\d+)*(;[A-Za-z0-9_./-]+:-?\d+(,-?\d+)*)*$")


def _tail(text: str, lines: int = 20) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def run_atc(
    onnx_path: Path,
    out_prefix: Path,
    *,
    soc_version: str,
    precision_mode: str = "force_fp16",
    input_shape: str | None = None,
    timeout: float = 3600,
) -> dict:
    """Run ``atc --framework=5 --model=X.onnx --output=PREFIX --soc_version=AscendNNN --precision_mode=...``.

    ATC writes ``PREFIX.om``.  Raises :class:`AtcNotFound` when the CANN toolkit is not installed,
    :class:`ConversionError` on invalid options, a timeout, or ATC failing (with its last lines).
    """
    soc = normalize_soc(soc_version)
    if precision_mode not in ATC_PRECISION_MODES:
        raise ConversionError(
            f"Invalid precision mode {precision_mode!r}: choose one of {', '.join(ATC_PRECISION_MODES)}."
        )
    if input_shape is not None and not _INPUT_SHAPE_RE.match(input_shape):
        raise ConversionError(f"Invalid input shape {input_shape!r}: expected 'name:d1,d2;name2:d1,d2'.")
    try:
        timeout = float(timeout)
    except (TypeError, ValueError):
        timeout = -1.0
    if not timeout > 0:
        raise ConversionError(f"Invalid ATC timeout {timeout!r}: must be a positive number of seconds.")
    onnx_path = Path(onnx_path)
    if not onnx_path.is_file():
        raise ConversionError(f"ONNX model {onnx_path} does not exist.")
    if onnx_path.suffix.lower() != ".onnx":
        raise ConversionError(f"{onnx_path.name} is not an .onnx file.")
    out_prefix = Path(out_prefix)
    if out_prefix.suffix.lower() == ".om":
        out_prefix = out_prefix.with_suffix("")
    atc = find_atc()
    if atc is None:
        raise AtcNotFound(ATC_NOT_FOUND_MESSAGE)
    out_prefix.parent.mkdir(parents=True, exist_ok=True)
    argv = [
        atc,
        "--framework=5",
        f"--model={onnx_path}",
        f"--output={out_prefix}",
        f"--soc_version={soc}",
        f"--precision_mode={precision_mode}",
    ]
    if input_shape:
        argv.append(f"--input_shape={input_shape}")
    started = time.monotonic()
    try:
        # ATC writes fusion_result.json and kernel_meta/ into its working directory: the output's staging
        # folder, so they go with it and never land in the worker's own directory.
        proc = start_job_child(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            errors="replace",
            env=child_environment({}),
            cwd=out_prefix.parent,
        )
    except OSError as exc:
        raise ConversionError(f"Cannot start ATC ({atc}): {first_line(exc)}") from exc
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop_job_child(proc, grace=5)
        output, _ = proc.communicate()
        raise ConversionError(
            f"ATC timed out after {timeout:.0f} s and was stopped. Last output:\n{_tail(output or '')}"
        ) from None
    except BaseException:
        stop_job_child(proc, grace=0)
        raise
    seconds = time.monotonic() - started
    om_path = out_prefix.with_name(out_prefix.name + ".om")
    if proc.returncode != 0:
        hint = ""
        if shutil.which("atc") is None and "ASCEND_HOME_PATH" not in os.environ:
            hint = (
                "\n(hint: ATC was found outside PATH; source the toolkit's set_env.sh, e.g. "
                "/usr/local/Ascend/ascend-toolkit/set_env.sh, in the worker's environment)"
            )
        raise ConversionError(f"ATC failed with exit code {proc.returncode}:\n{_tail(output or '')}{hint}")
    if not om_path.is_file():
        raise ConversionError(f"ATC exited successfully but wrote no {om_path.name}:\n{_tail(output or '')}")
    return {
        "om_path": str(om_path),
        "size_bytes": om_path.stat().st_size,
        "argv": argv,
        "soc_version": soc,
        "precision_mode": precision_mode,
        "seconds": round(seconds, 3),
        "log_tail": _tail(output or ""),
    }
