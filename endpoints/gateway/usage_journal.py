"""The gateway's metered usage on its way to the database, kept on disk so that a killed gateway loses none of it
(docs/usage-and-budgets.md, "A gateway killed").

Each settled request is one line appended to this gateway's current segment file (one write(2): in the kernel's
page cache when the call returns, so a kill -9 of the process loses nothing; a power cut may lose what the kernel had
not written out). At each flush the gateway starts a new segment and stores the finished ones: a segment's usage and
the journal's mark (UsageJournalMark: its segments up to this number are stored) go in one database transaction, then
the file is deleted, so a segment is stored once whatever dies when. A gateway holds a lock (flock) on its journal
while it lives; at each flush a gateway looks for journals whose lock it can take (their gateway is dead: killed, or
its host restarted it) and stores their segments the same way. The journals of one host share one directory
(GATEWAY_USAGE_JOURNAL_DIR), so the gateway restarted in a killed one's place, or any other on that host, stores what
it had not.

A request sent to a replica is journaled too (`dispatched`, a line naming its ticket), and its settled line names the
ticket: the requests a killed gateway had in flight are the tickets its journal left open. The replica received
them, so they are stored as requests, counted as interrupted (their answer and tokens are unknown). Each new segment
starts with the tickets open at its start, so a journal's last segments say what was in flight whatever was
stored before.

Written by hand: a few lines over flock and O_APPEND; no library journals counters for exactly-once storage."""

from __future__ import annotations

import fcntl
import glob
import itertools
import json
import logging
import os
import re
from collections.abc import Iterator
from contextlib import suppress
from datetime import datetime
from pathlib import Path

from endpoints.gateway.stats import Stats

log = logging.getLogger("console.gateway")  # the gateway's logger (asgi.py)

SEGMENT = re.compile(r"^(?P<journal>.+)\.(?P<seq>\d{12})\.jsonl$")


def _segment_name(journal: str, seq: int) -> str:
    return f"{journal}.{seq:012d}.jsonl"


class UsageJournal:
    """One gateway's journal: `record` a settled request, `rotate` at a flush, `segments` to store
    (services.store_journal deletes each once stored), `close` at a stop."""

    def __init__(self, directory: Path, name: str):
        self.directory, self.name = Path(directory), name
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.lock_fd = os.open(self.directory / f"{name}.lock", os.O_CREAT | os.O_RDWR, 0o600)
        fcntl.flock(self.lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a name is one live gateway's
        self.seq = 0
        self.fd = -1
        self.tickets = itertools.count(1)
        self.open: dict[int, list] = {}  # tickets dispatched and not yet settled: their row, as journaled
        self.rotate()

    def ticket(self) -> int:
        """A number for one request, unique in this journal."""
        return next(self.tickets)

    def dispatched(self, ticket: int, *, row: tuple) -> None:
        """The request is on its way to a replica (again, on a retry: the row of the latest): in flight until it is
        settled (`record`) or `forget`-ten."""
        hour, *rest = row
        self.open[ticket] = [hour.isoformat(), *rest]
        self._write([{"open": ticket, "row": self.open[ticket]}])

    def record(self, *, row: tuple, status: int, prompt: int, completion: int, ticket: int | None = None) -> None:
        """One settled request: its UsageHour row (hour, team id, key id, key name, endpoint id, model, adapter) and
        counts, and the ticket it settles, as one line in one write."""
        if ticket is not None:  # None: never dispatched (refused before)
            self.open.pop(ticket, None)
        hour, *rest = row
        self._write([[hour.isoformat(), *rest, status, prompt, completion, ticket]])

    def forget(self, ticket: int) -> None:
        """The request ended without a settled line (an error raised in its relay, or its task cancelled by a
        shutdown): no longer in flight."""
        if self.open.pop(ticket, None) is not None:
            self._write([{"close": ticket}])

    def rotate(self) -> None:
        """Start a new segment, beginning with the tickets open now; the one before is finished (listed by `segments`
        until stored)."""
        if self.fd >= 0:
            os.close(self.fd)
        self.seq += 1
        path = self.directory / _segment_name(self.name, self.seq)
        self.fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_APPEND, 0o600)
        if self.open:
            self._write([{"open": ticket, "row": row} for ticket, row in self.open.items()])

    def _write(self, lines: list) -> None:
        os.write(self.fd, "".join(json.dumps(line) + "\n" for line in lines).encode())

    def segments(self) -> list[tuple[int, Path]]:
        """This journal's finished segments, oldest first."""
        return [(seq, path) for seq, path in segments_of(self.directory, self.name) if seq < self.seq]

    def close(self) -> None:
        """At a stop, after the last flush: an empty current segment goes, and the lock file with it once no segment
        is left; else the lock is only let go, and the next gateway's flush stores what is left (`orphans`)."""
        os.close(self.fd)
        path = self.directory / _segment_name(self.name, self.seq)
        if path.stat().st_size == 0:
            path.unlink()
        if not segments_of(self.directory, self.name):
            (self.directory / f"{self.name}.lock").unlink(missing_ok=True)
        os.close(self.lock_fd)


def segments_of(directory: Path, journal: str) -> list[tuple[int, Path]]:
    found = []
    for path in directory.glob(f"{glob.escape(journal)}.*.jsonl"):
        match = SEGMENT.match(path.name)
        if match and match["journal"] == journal:
            found.append((int(match["seq"]), path))
    return sorted(found)


def orphans(directory: Path, *, own: str) -> Iterator[tuple[str, int]]:
    """Journals in `directory` whose gateway is gone (their lock can be taken): (name, the lock's descriptor,
    held until `release`)."""
    for lock in sorted(Path(directory).glob("*.lock")):
        name = lock.name.removesuffix(".lock")
        if name == own:
            continue
        try:
            fd = os.open(lock, os.O_RDWR)
        except FileNotFoundError:  # another gateway stored it just now
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # its gateway lives
            os.close(fd)
            continue
        yield name, fd


def release(directory: Path, name: str, fd: int, *, done: bool) -> None:
    """Let go of an orphaned journal's lock; `done` (every segment stored): its lock file goes too."""
    if done:
        with suppress(FileNotFoundError):
            (Path(directory) / f"{name}.lock").unlink()
    os.close(fd)


def read_segment(path: Path, *, in_flight: dict[int, tuple] | None = None) -> Stats:
    """A segment's usage, summed per UsageHour row (a line cut short, by a power cut, is skipped and logged).
    `in_flight` (ticket -> row), carried from the journal's segments before: the tickets this one opens are added,
    those it settles taken out."""
    stats = Stats()
    in_flight = {} if in_flight is None else in_flight
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            try:
                entry = json.loads(line)
                if isinstance(entry, dict):
                    if "open" in entry:
                        in_flight[int(entry["open"])] = _row(entry["row"])
                    else:
                        in_flight.pop(int(entry["close"]), None)
                    continue
                # Ten fields: written by a gateway of the release before tickets, still on the host.
                *fields, status, prompt, completion, ticket = entry if len(entry) == 11 else [*entry, None]
                row = _row(fields)
            except (ValueError, TypeError, KeyError):
                log.warning("gateway: usage journal %s line %d is cut short; skipped", path.name, number)
                continue
            in_flight.pop(ticket, None)
            stats.record_usage(row=row, status=status, prompt=prompt, completion=completion)
    return stats


def _row(fields: list) -> tuple:
    hour, team_id, key_id, key_name, endpoint_id, model, adapter = fields
    return (datetime.fromisoformat(hour), team_id, key_id, key_name, endpoint_id, model, adapter)
