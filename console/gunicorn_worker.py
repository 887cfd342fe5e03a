"""The web console's gunicorn worker: gunicorn's threaded worker with read deadlines (docs/gateway-hardening.md,
"The web console").

gunicorn 25's gthread worker hands a new connection straight to a worker thread, which then blocks reading its
request (gunicorn/workers/gthread.py: accept -> enqueue_req -> handle -> next(conn.parser)), with no timeout: an
idle connection, or a head sent a byte at a time, holds one of the WEB_WORKERS x 4 threads for as long as the
client likes, and eight such connections stop the console. Here every read of a connection waits at most
CONSOLE_READ_TIMEOUT_SECONDS, and a request head must be in whole within CONSOLE_HEADER_TIMEOUT_SECONDS of the
thread taking it; the connection is then closed. Chosen over a buffering proxy in front because the same
gunicorn settings file (console/gunicorn_conf.py) is what every deployment mode runs (supervisord, systemd, the
container image, Kubernetes), where a proxy would be one more process to add to each.
"""

from __future__ import annotations

import os
import socket
import time

from gunicorn.http.errors import NoMoreData
from gunicorn.workers.gthread import ThreadWorker


def _seconds(name: str, default: float) -> float:
    return float(os.environ.get(name) or default)


class DeadlineSocket:
    """A client socket whose reads wait at most `read_timeout` each and, while `deadline` is set, no later than it."""

    def __init__(self, sock: socket.socket, read_timeout: float):
        self._sock, self.read_timeout, self.deadline = sock, read_timeout, None

    def recv(self, size: int, *flags) -> bytes:
        wait = self.read_timeout
        if self.deadline is not None:
            wait = min(wait, self.deadline - time.monotonic())
            if wait <= 0:
                raise NoMoreData()  # gunicorn closes the connection (logged at debug level, not as an error)
        self._sock.settimeout(wait)
        try:
            return self._sock.recv(size, *flags)
        except TimeoutError:
            raise NoMoreData() from None
        finally:
            self._sock.settimeout(None)

    def setblocking(self, flag: bool) -> None:
        self._sock.setblocking(flag)

    def __getattr__(self, name):
        return getattr(self._sock, name)


class DeadlineThreadWorker(ThreadWorker):
    """gunicorn's gthread worker, its connections' reads under deadlines (see the module's docstring)."""

    def handle(self, conn):
        if self.cfg.is_ssl:  # gunicorn wraps the socket itself for TLS: the console is served behind TLS termination
            return super().handle(conn)
        if not isinstance(conn.sock, DeadlineSocket):
            conn.sock = DeadlineSocket(conn.sock, _seconds("CONSOLE_READ_TIMEOUT_SECONDS", 15))
        conn.sock.deadline = time.monotonic() + _seconds("CONSOLE_HEADER_TIMEOUT_SECONDS", 10)
        return super().handle(conn)

    def handle_request(self, req, conn):
        if isinstance(conn.sock, DeadlineSocket):
            conn.sock.deadline = None  # the head is in: the body's reads have the per-read timeout only
        return super().handle_request(req, conn)
