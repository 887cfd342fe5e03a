"""``npu-smi info -t ...``, ``-l`` and ``-m``: ``key : value`` lists and the chip map."""

from __future__ import annotations

import re
from typing import Any

from .errors import NpuSmiParseError
from .headers import _CHUNK_RE, _assign_tokens, _norm
from .values import _kv_value, _num, _text

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
            "not `npu-smi info -t ...` output: no 'NPU ID', 'Chip ID' or 'Chip Count' key : value lines found"
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
    "npuid": "npu",
    "npu": "npu",
    "chipid": "chip",
    "chip": "chip",
    "chiplogicid": "logic_id",
    "logicid": "logic_id",
    "chipphyid": "phy_id",
    "phyid": "phy_id",
    "slotid": "slot",
    "chipname": "name",
    "name": "name",
}
# Header names as npu-smi prints them, for a header written with single spaces.
_MAP_HEADER_RE = re.compile(r"NPU ID|Slot ID|Chip Logic ID|Chip Phy-ID|Chip ID|Chip Name", re.IGNORECASE)


def _map_header(line: str) -> list[tuple[str | None, int]] | None:
    """The (field, offset) columns of a ``-m`` header line, or None when the line is not one.

    Older layouts print ``NPU ID  Chip ID  Chip Logic ID  Chip Name``; the Ascend 950 prints
    ``NPU ID  Slot ID  Chip ID  Chip Phy-ID  Chip Name`` and no logic id."""
    for cells in (
        [(m.group(), m.start()) for m in _CHUNK_RE.finditer(line)],
        [(m.group(), m.start()) for m in _MAP_HEADER_RE.finditer(line)],
    ):
        fields = [_MAP_COLUMNS.get(_norm(c)) for c, _ in cells]
        if "npu" in fields and ("logic_id" in fields or "phy_id" in fields):
            return [(f, off) for (c, off), f in zip(cells, fields, strict=False)]
    return None


def parse_chip_map(text: str) -> list[dict[str, Any]]:
    """Parse ``npu-smi info -m`` into ``[{"npu", "chip", "logic_id", "name"}]`` (plus ``slot``
    and ``phy_id`` where the layout prints them)."""
    if not isinstance(text, str):
        raise NpuSmiParseError("npu-smi output must be text")
    header: list[tuple[str | None, int]] | None = None
    rows: list[dict[str, Any]] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        if header is None:
            header = _map_header(line)
            continue
        cells = [(m.group(), m.start()) for m in _CHUNK_RE.finditer(line)]
        if len(cells) == len(header):
            pieces = [c for c, _ in cells]
        else:
            pieces = _assign_tokens([(f or "", off) for f, off in header], line)
        vals = {f: p for (f, _), p in zip(header, pieces, strict=False) if f and p is not None}
        npu = _num(vals.get("npu"))
        if npu is None:
            continue
        chip = _num(vals.get("chip"))
        name = _text(vals.get("name"))
        row = {
            "npu": npu,
            "chip": chip if chip is not None else 0,
            "logic_id": _num(vals.get("logic_id")),
            "name": name,
        }
        columns = {f for f, _ in header}
        if "logic_id" not in columns and str(name or "").lower() != "mcu":
            # The 950 has one chip per NPU ID and vLLM/ACL number it by that id
            # (vllm-project/vllm-ascend issue 10463: "logical NPU ID should be derived from NPU ID").
            row["logic_id"] = npu
        for extra in ("slot", "phy_id"):
            if extra in columns:
                row[extra] = _num(vals.get(extra))
        rows.append(row)
    if header is None:
        raise NpuSmiParseError(
            "not `npu-smi info -m` output: no 'NPU ID ... Chip Logic ID' (or '... Chip Phy-ID') header found"
        )
    return rows
