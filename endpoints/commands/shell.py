"""The command as a shell line, for people to read (never run)."""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping

_SECRET_KEY_RE = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL", re.IGNORECASE)


def format_for_shell(argv: list[str], env: Mapping[str, str] | None = None, *, redact: bool = True) -> str:
    """``K=V ... python -m ...`` quoted with :func:`shlex.quote`, for display only.

    ``shlex.split`` of the result gives back ``["K=V", ..., *argv]``. With ``redact``
    (default) values of variables whose names look secret (KEY, TOKEN, ...) are shown as
    ``***``. Never pass the result to a shell: the console runs ``argv`` directly.
    """
    parts = []
    for key, value in (env or {}).items():
        shown = "***" if redact and _SECRET_KEY_RE.search(key) else value
        parts.append(f"{key}={shlex.quote(shown)}")
    parts += [shlex.quote(a) for a in argv]
    return " ".join(parts)
