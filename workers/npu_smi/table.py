"""``npu-smi info``'s default table -> chips and processes (``parse_info``)."""

from __future__ import annotations

import re
from typing import Any

from .errors import NpuSmiParseError
from .headers import _DEVICE_COLUMNS, _PROCESS_COLUMNS, _Header, _is_header_row, _norm, _split_row
from .values import _BUS_RE, _is_null, _num, _pair, _text

CHIP_KEYS = (
    "npu",
    "chip",
    "device_id",
    "name",
    "health",
    "power_w",
    "temp_c",
    "aicore_pct",
    "hugepages_used",
    "hugepages_total",
    "memory_used_mb",
    "memory_total_mb",
    "hbm_used_mb",
    "hbm_total_mb",
    "bus_id",
)
PROCESS_KEYS = ("npu", "chip", "pid", "name", "memory_mb")

_SEPARATOR_RE = re.compile(r"\+[-=+]*\+?")
_NO_PROC_RE = re.compile(r"no running process", re.I)
_VERSION_RE = re.compile(r"Version:\s*(\S+)", re.I)
_SMI_VERSION_RE = re.compile(r"npu-smi\s+v?(\d\S*)", re.I)


def _looks_like_health(value: str | None) -> bool:
    return bool(value) and not _is_null(value) and bool(re.fullmatch(r"[A-Za-z][A-Za-z ]*", value.strip()))


def _empty_chip() -> dict[str, Any]:
    return dict.fromkeys(CHIP_KEYS)


def parse_info(text: str) -> dict[str, Any]:
    """Parse the default ``npu-smi info`` table (see the module docstring)."""
    if not isinstance(text, str):
        raise NpuSmiParseError("npu-smi output must be text")
    version: str | None = None
    chips: list[dict[str, Any]] = []
    processes: list[dict[str, Any]] = []
    saw_device_header = False

    headers: list[_Header] = []  # header rows of the current table
    kind: str | None = None  # "device", "process" or None (unknown table)
    prev_was_header = False
    first_in_group = True
    npu_ctx: dict[str, str] | None = None
    npu_chip_rows = 0

    def finish_npu() -> None:
        # An NPU row never followed by a chip row still describes one chip.
        nonlocal npu_ctx, npu_chip_rows
        if npu_ctx is not None and npu_chip_rows == 0:
            chips.append(_build_chip(npu_ctx, {}, 0))
        npu_ctx = None
        npu_chip_rows = 0

    for line in text.splitlines():
        stripped = line.strip()
        if not stripped:
            continue
        if _SEPARATOR_RE.fullmatch(stripped):
            first_in_group = True
            prev_was_header = False
            continue
        blocks = _split_row(line)
        if blocks is None:
            continue
        joined = " ".join(b.strip() for b in blocks).strip()
        if not joined:
            continue
        if _NO_PROC_RE.search(joined):
            first_in_group = False
            prev_was_header = False
            continue
        if len([b for b in blocks if b.strip()]) == 1 and (_VERSION_RE.search(joined) or _SMI_VERSION_RE.match(joined)):
            m = _VERSION_RE.search(joined) or _SMI_VERSION_RE.match(joined)
            version = version or m.group(1)
            continue
        if _is_header_row(blocks):
            if not prev_was_header:
                finish_npu()
                headers = []
            headers.append(_Header(blocks))
            kind = _table_kind(headers)
            if kind == "device":
                saw_device_header = True
            prev_was_header = True
            first_in_group = True
            continue
        prev_was_header = False

        if kind == "process":
            vals = headers[0].values(blocks, _PROCESS_COLUMNS)
            for extra in headers[1:]:
                for k, v in extra.values(blocks, _PROCESS_COLUMNS).items():
                    vals.setdefault(k, v)
            pid = _num(vals.get("pid"))
            npu = _num(vals.get("npu"))
            if pid is None and npu is None:
                continue
            chip = _num(vals.get("chip"))
            processes.append(
                {
                    "npu": npu,
                    "chip": chip if chip is not None else 0,
                    "pid": pid,
                    "name": _text(vals.get("name")),
                    "memory_mb": _num(vals.get("memory_mb")),
                }
            )
        elif kind == "device":
            if len(headers) == 1:
                vals = headers[0].values(blocks, _DEVICE_COLUMNS)
                if _num(vals.get("npu")) is None and not vals.get("name"):
                    continue
                chips.append(_build_chip(vals, {}, 0))
            else:
                row1 = headers[0].values(blocks, _DEVICE_COLUMNS)
                health = row1.get("health")
                if npu_ctx is None:
                    is_npu_row = True
                elif first_in_group:
                    # First row after a separator is an NPU row unless it is
                    # clearly a chip row (bus id under Health, or no NPU id).
                    is_npu_row = _num(row1.get("npu")) is not None and not (
                        health and _BUS_RE.fullmatch(health.strip())
                    )
                else:
                    is_npu_row = _looks_like_health(health)
                if is_npu_row:
                    finish_npu()
                    npu_ctx = row1
                else:
                    row2 = headers[1].values(blocks, _DEVICE_COLUMNS)
                    chips.append(_build_chip(npu_ctx, row2, npu_chip_rows))
                    npu_chip_rows += 1
        first_in_group = False

    finish_npu()
    if not saw_device_header:
        snippet = text.strip().splitlines()[0][:120] if text.strip() else "(empty)"
        raise NpuSmiParseError(
            "not `npu-smi info` output: no device table header with an NPU column and "
            f"Health/Bus-Id/Power columns was found (first line: {snippet!r})"
        )
    return {"version": version, "chips": chips, "processes": processes}


def _table_kind(headers: list[_Header]) -> str | None:
    fields_dev = {_DEVICE_COLUMNS.get(_norm(n)) for h in headers for n in h.names()}
    fields_proc = {_PROCESS_COLUMNS.get(_norm(n)) for h in headers for n in h.names()}
    if "pid" in fields_proc or "memory_mb" in fields_proc:
        return "process"
    if "npu" in fields_dev and fields_dev & {"health", "bus_id", "power_w", "temp_c", "hbm", "memory", "aicore_pct"}:
        return "device"
    return None


def _build_chip(npu_vals: dict[str, str], chip_vals: dict[str, str], index: int) -> dict[str, Any]:
    vals = dict(npu_vals)
    for k, v in chip_vals.items():
        # The chip row's own values win except for the NPU id and name.
        if k in ("npu",) and k in vals:
            continue
        vals[k] = v
    chip = _empty_chip()
    chip["npu"] = _num(vals.get("npu"))
    chip_no = _num(chip_vals.get("chip")) if "chip" in chip_vals else _num(npu_vals.get("chip"))
    chip["chip"] = chip_no if chip_no is not None else index
    chip["device_id"] = _num(vals.get("device_id"))
    chip["name"] = _text(vals.get("name"))
    chip["health"] = _text(vals.get("health"))
    chip["power_w"] = _num(vals.get("power_w"))
    chip["temp_c"] = _num(vals.get("temp_c"))
    chip["aicore_pct"] = _num(vals.get("aicore_pct"))
    chip["hugepages_used"], chip["hugepages_total"] = _pair(vals.get("hugepages"))
    chip["memory_used_mb"], chip["memory_total_mb"] = _pair(vals.get("memory"))
    chip["hbm_used_mb"], chip["hbm_total_mb"] = _pair(vals.get("hbm"))
    chip["bus_id"] = _text(vals.get("bus_id"))
    return chip
