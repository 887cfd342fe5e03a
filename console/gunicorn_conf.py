"""gunicorn's settings file for the `web` process (deploy/supervisord.conf: --config python:console.gunicorn_conf);
its command-line flags live there too."""

import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

# Threads whose reads have deadlines: idle or trickling connections cannot hold them (console/gunicorn_worker.py).
worker_class = "console.gunicorn_worker.DeadlineThreadWorker"


def post_fork(server, worker):
    """A worker dies with its master. Otherwise kill -9 of the master (an OOM kill) leaves the worker holding the
    port while it waits, up to graceful_timeout, on browsers' keep-alive connections, and the master supervisord
    starts in its place cannot bind until then. Hand-written: prctl(2) through ctypes; python-prctl needs a C
    build for this one call."""
    prctl = getattr(ctypes.CDLL(None, use_errno=True), "prctl", None)
    if prctl is None:  # not Linux
        return
    if prctl(PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
        worker.log.warning("prctl(PR_SET_PDEATHSIG): %s", os.strerror(ctypes.get_errno()))
    elif os.getppid() != worker.ppid:  # the master died before the call
        os._exit(1)
