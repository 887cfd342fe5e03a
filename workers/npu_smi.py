"""Parse the output of Huawei's ``npu-smi`` tool and run it safely.

This parser is hand-written because no library parses npu-smi output: the tool
only prints human-oriented tables and ``key : value`` lists, and there is no
JSON/XML mode or Python binding for it.  The code here is pure Python (no
Django imports) so agents and tests can use it anywhere.

Public API
----------
``parse_info(text) -> dict``
    The default ``npu-smi info`` table.  Returns exactly::

        {"version": str | None,
         "chips": [{"npu", "chip", "device_id", "name", "health", "power_w",
                    "temp_c", "aicore_pct", "hugepages_used", "hugepages_total",
                    "memory_used_mb", "memory_total_mb", "hbm_used_mb",
                    "hbm_total_mb", "bus_id"}, ...],
         "processes": [{"npu", "chip", "pid", "name", "memory_mb"}, ...]}

    Columns are located by their header names, never by fixed offsets, so
    reordered/extra columns, ``Chip Device``/``Chip Phy-ID``/plain ``Chip``
    second rows, tables without an HBM column (310/310P), 310P duo cards (one
    row pair per chip), Ascend 950 layouts (``NPU ID`` / ``NPU Util(%)`` in
    their own ``|`` blocks), process tables with a ``Process id in container``
    column, a missing version line and pasted output without the ``+---+``
    separator lines are all understood.  ``NA`` and ``-`` become ``None``.
    Numbers are ``int`` when written without a decimal point, else ``float``
    (``70.0`` stays ``70.0``).  ``chip`` is 0 when the layout has no chip
    column.  Text that is not npu-smi output raises :class:`NpuSmiParseError`.

``parse_key_values(text) -> dict``
    ``npu-smi info -t usages|common|board|... -i N [-c C]``.  Keys are the
    npu-smi labels in snake_case with the unit appended (``%`` -> ``pct``)::

        "HBM Capacity(MB)"        -> "hbm_capacity_mb"
        "HBM Usage Rate(%)"       -> "hbm_usage_rate_pct"
        "DDR Capacity(MB)"        -> "ddr_capacity_mb"
        "DDR Usage Rate(%)"       -> "ddr_usage_rate_pct"
        "Memory Usage Rate(%)"    -> "memory_usage_rate_pct"
        "Aicore Usage Rate(%)"    -> "aicore_usage_rate_pct"
        "Aicore curFreq(MHZ)"     -> "aicore_cur_freq_mhz"
        "Temperature(C)"          -> "temperature_c"
        "NPU Real-time Power(W)"  -> "npu_real_time_power_w"
        "PCIe Bus Info"           -> "pcie_bus_info"

    Values: integers/decimals become numbers, ``NA``/``-`` become ``None``,
    everything else (``0x02``, ``7.1.0.4.218``, bus ids) stays a string.
    Result shape::

        {"npu_id": 0, "chip_count": 1,           # header keys, when printed
         "chips": [{"chip_id": 0, ...}, ...],    # one dict per chip
         "mcu": {"chip_name": "mcu", ...} | None}

    Keys that belong to no chip (e.g. ``-t power`` without ``Chip ID``) are
    put at the top level.  Use ``parse_npu_list`` for ``-l`` (it repeats
    ``NPU ID``).  ``Chip ID`` is accepted both before the chip's
    values (``-t common``) and after them (``-t usages`` prints it last).

``parse_chip_map(text) -> list[dict]``
    ``npu-smi info -m``: ``[{"npu", "chip", "logic_id", "name"}]``; MCU rows
    have ``logic_id`` ``None`` (npu-smi prints ``-``).

``parse_npu_list(text) -> list[dict]``
    ``npu-smi info -l``: ``[{"npu": 0, "chip_count": 1}, ...]``.

``run_npu_smi(args, *, timeout, binary=None) -> str``
    Runs npu-smi with an argv list (never a shell).  Raises
    :class:`NpuSmiUnavailable` when the binary is missing, exits non-zero or
    runs past ``timeout`` (its whole process group is killed).

``collect(*, timeout=8.0, binary=None) -> dict``
    Runs ``info`` and ``info -m`` concurrently, then ``info -t usages -i N``
    for every NPU, all within one deadline.  Returns ``parse_info``'s dict
    where every chip also has ``logic_id`` (from ``-m``, else ``None``) and
    ``usage`` (that chip's ``-t usages`` dict without ``chip_id``, else
    ``None``), plus ``chip_map`` (list) and ``errors``
    (``[{"command": "npu-smi info", "error": "..."}]``).  Never raises for a
    missing/hung/broken npu-smi; never blocks much longer than ``timeout``.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

__all__ = [
    "NpuSmiError",
    "NpuSmiParseError",
    "NpuSmiUnavailable",
    "parse_info",
    "parse_key_values",
    "parse_chip_map",
    "parse_npu_list",
    "run_npu_smi",
    "collect",
    "CHIP_KEYS",
    "PROCESS_KEYS",
]


class NpuSmiError(Exception):
    """Base class for npu-smi problems."""


class NpuSmiParseError(NpuSmiError, ValueError):
    """The text is not npu-smi output of the expected kind."""


class NpuSmiUnavailable(NpuSmiError):
    """npu-smi could not be run: missing, timed out, or exited non-zero."""


CHIP_KEYS = (
    "npu", "chip", "device_id", "name", "health", "power_w", "temp_c", "aicore_pct",
    "hugepages_used", "hugepages_total", "memory_used_mb", "memory_total_mb",
    "hbm_used_mb", "hbm_total_mb", "bus_id",
)
PROCESS_KEYS = ("npu", "chip", "pid", "name", "memory_mb")

# --------------------------------------------------------------------------- values

_NULLS = {"", "na", "n/a", "-", "--"}
_INT_RE = re.compile(r"[+-]?\d+")
_FLOAT_RE = re.compile(r"[+-]?(?:\d+\.\d*|\.\d+)")
_BUS_RE = re.compile(r"[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-9A-Fa-f]")


def _is_null(s: str | None) -> bool:
    return s is None or s.strip().lower() in _NULLS


def _num(s: str | None) -> int | float | None:
    """'30' -> 30, '88.2' -> 88.2, 'NA'/'-'/'' -> None, non-numbers -> None."""
    if _is_null(s):
        return None
    s = s.strip()
    if _INT_RE.fullmatch(s):
        return int(s)
    if _FLOAT_RE.fullmatch(s):
        return float(s)
    return None


def _text(s: str | None) -> str | None:
    if _is_null(s):
        return None
    return s.strip()


def _pair(s: str | None) -> tuple[int | float | None, int | float | None]:
    """'2654 / 32768' -> (2654, 32768); 'NA' -> (None, None)."""
    if _is_null(s):
        return None, None
    if "/" in s:
        used, _, total = s.partition("/")
        return _num(used), _num(total)
    return _num(s), None


def _kv_value(s: str) -> Any:
    """Value of a ``key : value`` line: number, None, or the stripped string."""
    if _is_null(s):
        return None
    n = _num(s)
    return n if n is not None else s.strip()


# --------------------------------------------------------------------------- headers

def _norm(name: str) -> str:
    """Header name -> comparison key: 'Bus-Id' -> 'busid', 'NPU Util(%)' -> 'npuutil(%)'."""
    return re.sub(r"[\s_\-]+", "", name.lower())


# Default-table columns (normalised header name -> internal field).
_DEVICE_COLUMNS = {
    "npu": "npu", "npuid": "npu", "npuidx": "npu",
    "chip": "chip", "chipid": "chip", "chipidx": "chip",
    "device": "device_id", "deviceid": "device_id", "phyid": "device_id", "phy": "device_id",
    "name": "name", "chipname": "name",
    "health": "health",
    "power(w)": "power_w", "power": "power_w", "pwr(w)": "power_w",
    "temp(c)": "temp_c", "temp": "temp_c", "temperature(c)": "temp_c", "temperature": "temp_c",
    "aicore(%)": "aicore_pct", "aicore": "aicore_pct", "npuutil(%)": "aicore_pct",
    "npuutil": "aicore_pct", "aicoreutil(%)": "aicore_pct",
    "hugepagesusage(page)": "hugepages", "hugepagesusage": "hugepages",
    "hugepages(page)": "hugepages", "hugepages": "hugepages",
    "memoryusage(mb)": "memory", "memoryusage": "memory", "memory(mb)": "memory",
    "hbmusage(mb)": "hbm", "hbmusage": "hbm", "hbm(mb)": "hbm",
    "busid": "bus_id", "bus": "bus_id", "pcibusid": "bus_id",
}
# Process-table columns.
_PROCESS_COLUMNS = {
    "npu": "npu", "npuid": "npu",
    "chip": "chip", "chipid": "chip",
    "processid": "pid", "pid": "pid",
    "processname": "name",
    "processmemory(mb)": "memory_mb", "processmemory": "memory_mb",
    "processidincontainer": "container_pid",
}
_KNOWN_NAMES = set(_DEVICE_COLUMNS) | set(_PROCESS_COLUMNS)
# Multi-word header names, longest first, used to split single-spaced headers.
_KNOWN_PHRASES = sorted(
    {
        "NPU ID", "Chip ID", "Chip Name", "NPU Util(%)", "AICore Util(%)",
        "Process id in container", "Process id", "Process name", "Process memory(MB)",
        "Process memory", "PCI Bus-Id",
    },
    key=lambda p: -len(p.split()),
)
_KNOWN_PHRASE_NORMS = {(_norm(p), len(p.split())) for p in _KNOWN_PHRASES}
_PHRASE_MAX_WORDS = max(len(p.split()) for p in _KNOWN_PHRASES)

_WORD_RE = re.compile(r"\S+")
_CHUNK_RE = re.compile(r"\S+(?: \S+)*")  # runs separated by 2+ spaces
# A value token: an "N / M" pair (kept as ONE token, also '26838/ 32768') or any word.
_VALUE_TOKEN_RE = re.compile(
    r"(?<!\S)(?:\d+(?:\.\d+)?|NA|-)\s*/\s*(?:\d+(?:\.\d+)?|NA|-)(?!\S)|\S+"
)
_NUMERIC_TOKEN_RE = re.compile(r"[+-]?\d+(?:\.\d+)?(?:\s*/\s*\S+)?")


def _split_header_block(block: str) -> list[tuple[str, int]]:
    """Split one ``|`` block of a header row into (column name, offset) pairs.

    Columns are separated by 2+ spaces; within a single-spaced run, known
    names (``NPU ID``, ``Process id``...) are matched greedily, a word that
    ends in ``)`` or contains ``-`` closes a name (``Power(W) Temp(C)``), and
    other words are joined (``Process id in container``-style names).
    """
    names: list[tuple[str, int]] = []
    for chunk in _CHUNK_RE.finditer(block):
        words = [(m.group(), chunk.start() + m.start()) for m in _WORD_RE.finditer(chunk.group())]
        cur: list[tuple[str, int]] = []

        def flush() -> None:
            if cur:
                names.append((" ".join(w for w, _ in cur), cur[0][1]))
                cur.clear()

        i = 0
        while i < len(words):
            matched = 0
            for n in range(min(_PHRASE_MAX_WORDS, len(words) - i), 1, -1):
                phrase = _norm(" ".join(w for w, _ in words[i:i + n]))
                if (phrase, n) in _KNOWN_PHRASE_NORMS:
                    matched = n
                    break
            if matched:
                flush()
                names.append((" ".join(w for w, _ in words[i:i + matched]), words[i][1]))
                i += matched
                continue
            word, off = words[i]
            if _norm(word) in _KNOWN_NAMES:
                flush()
                names.append((word, off))
            else:
                cur.append((word, off))
                if word.endswith(")") or "-" in word:
                    flush()
            i += 1
        flush()
    return names


def _split_row(line: str) -> list[str] | None:
    """'| a | b |' -> [' a ', ' b ']; None for lines that are not table rows."""
    s = line.strip()
    if not s.startswith("|"):
        return None
    inner = s[1:]
    if inner.endswith("|"):
        inner = inner[:-1]
    return inner.split("|")


_SEPARATOR_RE = re.compile(r"\+[-=+]*\+?")
_NO_PROC_RE = re.compile(r"no running process", re.I)
_VERSION_RE = re.compile(r"Version:\s*(\S+)", re.I)
_SMI_VERSION_RE = re.compile(r"npu-smi\s+v?(\d\S*)", re.I)


class _Header:
    """One header row: per block, the list of (name, offset)."""

    def __init__(self, blocks: list[str]):
        self.blocks = [_split_header_block(b) for b in blocks]

    def names(self) -> list[str]:
        return [n for block in self.blocks for n, _ in block]

    def values(self, blocks: list[str], columns: dict[str, str]) -> dict[str, str]:
        """Match a data row's blocks to this header; returns {field: raw text}."""
        out: dict[str, str] = {}
        for idx, header in enumerate(self.blocks):
            if not header or idx >= len(blocks):
                continue
            raw = blocks[idx]
            if len(header) == 1:
                pieces = [raw.strip()]
            else:
                pieces = _assign_tokens(header, raw)
            for (name, _), value in zip(header, pieces):
                field = columns.get(_norm(name))
                if field and value is not None and value != "" and field not in out:
                    out[field] = value
        return out


def _assign_tokens(header: list[tuple[str, int]], raw: str) -> list[str | None]:
    """Split a value block into one string per header column.

    Tokens are zipped with the column names when the counts agree; otherwise
    each token goes to the column whose header starts nearest to it (so an
    empty cell or a value containing spaces still lands in the right column).
    """
    tokens = [(m.group(), m.start()) for m in _VALUE_TOKEN_RE.finditer(raw)]
    if len(tokens) == len(header):
        return [t for t, _ in tokens]
    result: list[list[str]] = [[] for _ in header]
    for tok, off in tokens:
        best = min(range(len(header)), key=lambda i: (abs(header[i][1] - off), i))
        result[best].append(tok)
    return [" ".join(parts) if parts else None for parts in result]


def _is_header_row(blocks: list[str]) -> bool:
    names = [n for b in blocks for n, _ in _split_header_block(b)]
    if not any(_norm(n) in _KNOWN_NAMES for n in names):
        return False
    # Data rows always carry some number (ids, usage); header rows never do.
    return not any(_NUMERIC_TOKEN_RE.fullmatch(t) for b in blocks for t in b.split())


def _looks_like_health(value: str | None) -> bool:
    return bool(value) and not _is_null(value) and bool(re.fullmatch(r"[A-Za-z][A-Za-z ]*", value.strip()))


def _empty_chip() -> dict[str, Any]:
    return {k: None for k in CHIP_KEYS}


def parse_info(text: str) -> dict[str, Any]:
    """Parse the default ``npu-smi info`` table (see the module docstring)."""
    if not isinstance(text, str):
        raise NpuSmiParseError("npu-smi output must be text")
    version: str | None = None
    chips: list[dict[str, Any]] = []
    processes: list[dict[str, Any]] = []
    saw_device_header = False

    headers: list[_Header] = []     # header rows of the current table
    kind: str | None = None         # "device", "process" or None (unknown table)
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
        if len([b for b in blocks if b.strip()]) == 1 and (
            _VERSION_RE.search(joined) or _SMI_VERSION_RE.match(joined)
        ):
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
            processes.append({
                "npu": npu,
                "chip": chip if chip is not None else 0,
                "pid": pid,
                "name": _text(vals.get("name")),
                "memory_mb": _num(vals.get("memory_mb")),
            })
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


# --------------------------------------------------------------------------- key : value

_KV_LINE_RE = re.compile(r"^\s*([A-Za-z][^:|]*?)\s*:\s*(.*?)\s*$")
_HEADER_KEYS = {"npu_id", "chip_count", "total_count"}


def _snake_key(label: str) -> str:
    """'HBM Usage Rate(%)' -> 'hbm_usage_rate_pct', 'Aicore curFreq(MHZ)' -> 'aicore_cur_freq_mhz'."""
    unit = None
    m = re.match(r"^(.*?)\s*\(([^)]*)\)\s*$", label)
    base = label
    if m:
        base, unit = m.group(1), m.group(2)
    base = re.sub(r"(?<=[a-z])(?=[A-Z])", "_", base)
    key = re.sub(r"[^A-Za-z0-9]+", "_", base).strip("_").lower()
    if unit:
        unit_key = "pct" if unit.strip() == "%" else re.sub(r"[^A-Za-z0-9]+", "_", unit).strip("_").lower()
        if unit_key:
            key = f"{key}_{unit_key}"
    return key


def _kv_records(text: str) -> list[dict[str, Any]]:
    """Group ``key : value`` lines into records (blank line or repeated key -> new record)."""
    records: list[dict[str, Any]] = []
    cur: dict[str, Any] = {}
    for line in text.splitlines():
        if not line.strip():
            if cur:
                records.append(cur)
                cur = {}
            continue
        m = _KV_LINE_RE.match(line)
        if not m:
            continue
        key = _snake_key(m.group(1))
        if not key:
            continue
        if key in cur:
            records.append(cur)
            cur = {}
        cur[key] = _kv_value(m.group(2))
    if cur:
        records.append(cur)
    return records


def parse_key_values(text: str) -> dict[str, Any]:
    """Parse ``npu-smi info -t usages|common|board|... -i N`` (see module docstring)."""
    if not isinstance(text, str):
        raise NpuSmiParseError("npu-smi output must be text")
    records = _kv_records(text)
    if not any(r.keys() & (_HEADER_KEYS | {"chip_id"}) for r in records):
        raise NpuSmiParseError(
            "not `npu-smi info -t ...` output: no 'NPU ID', 'Chip ID' or 'Chip Count' "
            "key : value lines found"
        )
    result: dict[str, Any] = {"chips": [], "mcu": None}
    for rec in records:
        header = {k: v for k, v in rec.items() if k in _HEADER_KEYS}
        rest = {k: v for k, v in rec.items() if k not in _HEADER_KEYS}
        for k, v in header.items():
            result.setdefault(k, v)
        if not rest:
            continue
        if "chip_id" in rest:
            result["chips"].append(rest)
        elif str(rest.get("chip_name") or "").lower() == "mcu":
            result["mcu"] = rest
        else:
            for k, v in rest.items():
                result.setdefault(k, v)
    return result


def parse_npu_list(text: str) -> list[dict[str, Any]]:
    """Parse ``npu-smi info -l``: ``[{"npu": 0, "chip_count": 1}, ...]``."""
    out: list[dict[str, Any]] = []
    for rec in _kv_records(text):
        if "npu_id" in rec:
            out.append({"npu": rec["npu_id"], "chip_count": rec.get("chip_count")})
    if not out:
        raise NpuSmiParseError("not `npu-smi info -l` output: no 'NPU ID' lines found")
    return out


# --------------------------------------------------------------------------- -m map

_MAP_COLUMNS = {
    "npuid": "npu", "npu": "npu",
    "chipid": "chip", "chip": "chip",
    "chiplogicid": "logic_id", "logicid": "logic_id",
    "chipname": "name", "name": "name",
}


def parse_chip_map(text: str) -> list[dict[str, Any]]:
    """Parse ``npu-smi info -m`` into ``[{"npu", "chip", "logic_id", "name"}]``."""
    if not isinstance(text, str):
        raise NpuSmiParseError("npu-smi output must be text")
    header: list[tuple[str, int]] | None = None
    rows: list[dict[str, Any]] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        cells = [(m.group(), m.start()) for m in _CHUNK_RE.finditer(line)]
        if header is None:
            fields = [_MAP_COLUMNS.get(_norm(c)) for c, _ in cells]
            if "npu" in fields and "logic_id" in fields:
                header = [(f, off) for (c, off), f in zip(cells, fields)]
            continue
        if len(cells) == len(header):
            pieces = [c for c, _ in cells]
        else:
            pieces = _assign_tokens([(f or "", off) for f, off in header], line)
        vals = {f: p for (f, _), p in zip(header, pieces) if f and p is not None}
        npu = _num(vals.get("npu"))
        if npu is None:
            continue
        chip = _num(vals.get("chip"))
        rows.append({
            "npu": npu,
            "chip": chip if chip is not None else 0,
            "logic_id": _num(vals.get("logic_id")),
            "name": _text(vals.get("name")),
        })
    if header is None:
        raise NpuSmiParseError(
            "not `npu-smi info -m` output: no 'NPU ID ... Chip Logic ID' header found"
        )
    return rows


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
        usage_futures = {
            npu: pool.submit(run, ["info", "-t", "usages", "-i", str(npu)]) for npu in npus
        }

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
