"""Checks of single values for the vLLM command builder; each raises CommandSpecError naming
the field. Numbers go through the project's one parser (console.validation)."""

from __future__ import annotations

import ipaddress
import re
from typing import Any

from console.validation import NumberError, parse_float, parse_int

_MAX_PATH_LEN = 4096
_MAX_INT = 2**31 - 1


class CommandSpecError(ValueError):
    """A launch spec, extra flag or environment variable was rejected."""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _as_int(value: Any, what: str, lo: int, hi: int) -> int:
    """An int, or its decimal text (extra flags come as JSON strings or numbers)."""
    try:
        return parse_int(value, what, low=lo, high=hi)
    except NumberError as exc:
        raise CommandSpecError(str(exc)) from None


def _strict_int(value: Any, what: str, lo: int, hi: int) -> int:
    """Like _as_int but for spec fields: a real int (not a string or bool)."""
    try:
        return parse_int(value, what, low=lo, high=hi, accept_text=False)
    except NumberError as exc:
        raise CommandSpecError(str(exc)) from None


def _as_float(value: Any, what: str, lo: float, hi: float, *, lo_open=False) -> float:
    try:
        return parse_float(value, what, low=lo, high=hi, low_open=lo_open)
    except NumberError as exc:
        raise CommandSpecError(str(exc)) from None


def _as_bool(value: Any, what: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise CommandSpecError(f"{what} must be true or false, got {value!r}")


def _check_text(value: Any, what: str, *, max_len: int = _MAX_PATH_LEN) -> str:
    """A non-empty printable string that cannot be mistaken for a command-line flag."""
    if not isinstance(value, str) or not value.strip():
        raise CommandSpecError(f"{what} must be a non-empty string")
    if "\x00" in value or not value.isprintable():
        raise CommandSpecError(f"{what} must not contain NUL or control characters")
    if value != value.strip():
        raise CommandSpecError(f"{what} must not start or end with whitespace")
    if value.startswith("-"):
        raise CommandSpecError(f"{what} must not start with '-' (it would read as a flag)")
    if len(value) > max_len:
        raise CommandSpecError(f"{what} is longer than {max_len} characters")
    return value


_HOSTNAME_RE = re.compile(
    r"(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
    r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*"
)


def _check_host(value: Any, what: str) -> str:
    if isinstance(value, str):
        try:
            ipaddress.ip_address(value)
            return value
        except ValueError:
            if _HOSTNAME_RE.fullmatch(value):
                return value
    raise CommandSpecError(f"{what} must be an IP address or a host name, got {value!r}")


def _check_ip(value: Any, what: str) -> str:
    try:
        ipaddress.ip_address(value)
    except (ValueError, TypeError):
        raise CommandSpecError(f"{what} must be an IP address, got {value!r}") from None
    return value


def _check_port(value: Any, what: str = "port") -> int:
    if not _is_int(value) or not 1 <= value <= 65535:
        raise CommandSpecError(f"{what} must be an integer between 1 and 65535, got {value!r}")
    return value


def _split_host_port(value: Any, what: str) -> tuple[str, int]:
    if not isinstance(value, str):
        raise CommandSpecError(f"{what} must be 'host:port', got {value!r}")
    m = re.fullmatch(r"\[([0-9A-Fa-f:.]+)\]:([0-9]{1,5})|([^:\s]+):([0-9]{1,5})", value)
    if not m:
        raise CommandSpecError(f"{what} must be 'host:port', got {value!r}")
    host = m.group(1) or m.group(3)
    port = int(m.group(2) or m.group(4))
    _check_host(host, what)
    _check_port(port, f"{what} port")
    return host, port


_IFNAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:@-]{0,14}")  # Linux IFNAMSIZ is 16


def _check_ifname(value: Any, what: str) -> str:
    if not isinstance(value, str) or not _IFNAME_RE.fullmatch(value):
        raise CommandSpecError(f"{what} must be a network interface name like 'eth0', got {value!r}")
    return value


def _check_engine_python(engine_python: Any) -> str:
    _check_text(engine_python, "engine_python")
    if not engine_python.startswith("/"):
        raise CommandSpecError(f"engine_python must be an absolute path, got {engine_python!r}")
    return engine_python
