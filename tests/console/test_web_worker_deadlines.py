"""The web console's gunicorn (console/gunicorn_conf.py, the settings file every deployment mode runs) with idle and
trickling connections: they cannot hold its worker threads (issue 37: 2 workers x 4 threads were held by idle
sockets). A real gunicorn with one worker of two threads, on raw sockets."""

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tests.support import ROOT
from tests.support.gateway import free_port


@pytest.mark.django_db(transaction=True)
def test_idle_and_trickling_connections_do_not_hold_the_consoles_threads(worker_env):
    port = free_port()
    env = {**worker_env, "CONSOLE_HEADER_TIMEOUT_SECONDS": "2", "CONSOLE_READ_TIMEOUT_SECONDS": "2"}
    gunicorn = os.path.join(os.path.dirname(sys.executable), "gunicorn")
    proc = subprocess.Popen(
        [gunicorn, "console.wsgi", "--config", "python:console.gunicorn_conf", "--bind", f"127.0.0.1:{port}"]
        + ["--workers", "1", "--threads", "2", "--timeout", "60"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    held = []
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, "gunicorn did not start"
            time.sleep(0.3)
        # Both threads taken: one connection idle, one sending its head a byte at a time.
        idle = socket.create_connection(("127.0.0.1", port))
        trickle = socket.create_connection(("127.0.0.1", port))
        held += [idle, trickle]
        started = time.monotonic()
        for byte in b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: aaaaaaaaaaaaaaaaaaaa":
            try:
                trickle.sendall(bytes([byte]))
            except OSError:
                break
            time.sleep(0.3)
            # Meanwhile the console answers others, within the deadline and a margin.
            if time.monotonic() - started > 5:
                break
        answered = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=10)
        assert answered.status_code == 200
        assert time.monotonic() - started < 12
        idle.settimeout(5)
        assert idle.recv(100) == b""  # closed by the console
    finally:
        for sock in held:
            sock.close()
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
