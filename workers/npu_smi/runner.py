"""Run npu-smi safely (argv list, one deadline, process group killed on timeout) and collect its views."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from console.env import child_environment

from .errors import NpuSmiError, NpuSmiUnavailable
from .key_values import parse_chip_map, parse_key_values
from .table import parse_info

# --------------------------------------------------------------------------- running

#: Where npu-smi lives when it is not on PATH (the Ascend driver's default).
FALLBACK_PATHS: tuple[str, ...] = ("/usr/local/sbin/npu-smi", "/usr/local/bin/npu-smi")


def _find_binary(binary: str | None) -> str:
    if binary:
        if os.sep in binary:
            if os.path.isfile(binary) and os.access(binary, os.X_OK):
                return binary
            raise NpuSmiUnavailable(f"npu-smi not found at {binary}")
        found = shutil.which(binary)
        if found:
            return found
        raise NpuSmiUnavailable(f"{binary} not found on PATH")
    found = shutil.which("npu-smi")
    if found:
        return found
    for path in FALLBACK_PATHS:
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    raise NpuSmiUnavailable("npu-smi not found on PATH (is the Ascend driver installed?)")


def _tail(s: str, n: int = 300) -> str:
    s = (s or "").strip()
    return s if len(s) <= n else "..." + s[-n:]


def run_npu_smi(args: list[str], *, timeout: float, binary: str | None = None) -> str:
    """Run ``npu-smi *args`` (argv list, no shell) and return its stdout.

    Raises NpuSmiUnavailable if the binary is missing, exits non-zero, or runs
    longer than ``timeout`` seconds (then its process group is killed).
    """
    if isinstance(args, str):
        raise TypeError("args must be a list of strings, not a shell string")
    exe = _find_binary(binary)
    argv = [exe, *[str(a) for a in args]]
    shown = "npu-smi " + " ".join(str(a) for a in args)
    try:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            encoding="utf-8",
            errors="replace",
            env=child_environment({}),  # the host's paths and the driver's variables, none of the console's
            start_new_session=True,  # so a timeout can kill everything it started
        )
    except (FileNotFoundError, PermissionError, OSError) as exc:
        raise NpuSmiUnavailable(f"cannot run {shown}: {exc}") from exc
    try:
        out, err = proc.communicate(timeout=max(float(timeout), 0.01))
    except subprocess.TimeoutExpired:
        _kill(proc)
        raise NpuSmiUnavailable(f"{shown} timed out after {timeout:g}s (killed)") from None
    except BaseException:
        _kill(proc)
        raise
    if proc.returncode != 0:
        detail = _tail(err) or _tail(out) or "no output"
        raise NpuSmiUnavailable(f"{shown} exited with status {proc.returncode}: {detail}")
    return out


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError, OSError):
        try:
            proc.kill()
        except OSError:
            pass
    try:
        proc.communicate(timeout=2)
    except (subprocess.TimeoutExpired, OSError, ValueError):
        pass


def collect(*, timeout: float = 8.0, binary: str | None = None) -> dict[str, Any]:
    """Run npu-smi (info, info -m, info -t usages -i N) within ``timeout`` seconds.

    See the module docstring for the result shape.  Errors are reported in
    ``result["errors"]``; this function does not raise for npu-smi problems.
    """
    deadline = time.monotonic() + timeout
    errors: list[dict[str, str]] = []
    result: dict[str, Any] = {"version": None, "chips": [], "processes": []}
    chip_map: list[dict[str, Any]] = []

    def remaining() -> float:
        return deadline - time.monotonic()

    def run(args: list[str]) -> str:
        left = remaining()
        if left <= 0.05:
            raise NpuSmiUnavailable("npu-smi " + " ".join(args) + " not run: collect deadline reached")
        return run_npu_smi(args, timeout=left, binary=binary)

    def record(args: list[str], exc: Exception) -> None:
        errors.append({"command": "npu-smi " + " ".join(args), "error": str(exc)})

    with ThreadPoolExecutor(max_workers=8, thread_name_prefix="npu-smi") as pool:
        info_args, map_args = ["info"], ["info", "-m"]
        info_f = pool.submit(run, info_args)
        map_f = pool.submit(run, map_args)
        try:
            result = parse_info(info_f.result())
        except NpuSmiError as exc:
            record(info_args, exc)
        except Exception as exc:  # defensive: never let collection crash the caller
            record(info_args, NpuSmiError(f"unexpected error: {exc!r}"))

        npus = sorted({c["npu"] for c in result["chips"] if c["npu"] is not None})
        usage_futures = {npu: pool.submit(run, ["info", "-t", "usages", "-i", str(npu)]) for npu in npus}

        try:
            chip_map = parse_chip_map(map_f.result())
        except NpuSmiError as exc:
            record(map_args, exc)
        except Exception as exc:
            record(map_args, NpuSmiError(f"unexpected error: {exc!r}"))

        usages: dict[int, dict[str, Any]] = {}
        for npu, fut in usage_futures.items():
            args = ["info", "-t", "usages", "-i", str(npu)]
            try:
                usages[npu] = parse_key_values(fut.result())
            except NpuSmiError as exc:
                record(args, exc)
            except Exception as exc:
                record(args, NpuSmiError(f"unexpected error: {exc!r}"))

    logic = {(m["npu"], m["chip"]): m["logic_id"] for m in chip_map}
    for chip in result["chips"]:
        chip["logic_id"] = logic.get((chip["npu"], chip["chip"]))
        chip["usage"] = None
        u = usages.get(chip["npu"])
        if not u:
            continue
        per_chip = u.get("chips") or []
        match = next((c for c in per_chip if c.get("chip_id") == chip["chip"]), None)
        if match is None and len(per_chip) == 1 and chip["chip"] == 0:
            match = per_chip[0]
        if match is not None:
            chip["usage"] = {k: v for k, v in match.items() if k != "chip_id"}
    result["chip_map"] = chip_map
    result["errors"] = errors
    return result
