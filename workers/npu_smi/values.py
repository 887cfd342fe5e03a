"""One npu-smi cell or ``key : value`` value -> a number, a string or None."""

from __future__ import annotations

import re
from typing import Any

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
