"""Replica log files: rotation before each start, copy-and-truncate while running, the last lines."""

import logging
import os
import shutil
from pathlib import Path

log = logging.getLogger("console.agent")


def tail_lines(path: str, count: int = 200) -> str:
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - 256 * 1024))
            # NUL bytes (a log's tail after a power loss) go: PostgreSQL's text columns refuse them.
            return b"\n".join(handle.read().replace(b"\x00", b"").splitlines()[-count:]).decode(errors="replace")
    except OSError:
        return ""


def _shift(live: Path, keep: int) -> None:
    for n in range(keep - 1, 0, -1):
        older = live.with_name(f"{live.name}.{n}")
        if older.exists():
            older.replace(live.with_name(f"{live.name}.{n + 1}"))


def rotate_log(path: Path, keep: int) -> None:
    """replica.log -> replica.log.1 -> … -> .keep (oldest dropped). Called before each start."""
    if not path.exists():
        return
    _shift(path, keep)
    path.replace(path.with_name(f"{path.name}.1"))


def rotate_if_large(path: str, *, max_bytes: int, keep: int) -> None:
    """Copy-and-truncate a running process's log past max_bytes: the process keeps its
    descriptor (opened for append), so the live file must stay where it is."""
    try:
        if not path or os.path.getsize(path) <= max_bytes:
            return
        live = Path(path)
        _shift(live, keep)
        shutil.copyfile(live, live.with_name(f"{live.name}.1"))
        with open(live, "r+b") as handle:
            handle.truncate(0)
    except OSError as exc:
        log.warning("log rotation of %s failed: %s", path, exc)
