"""Child processes of a job (a vLLM server for a serving check, ATC, a benchmark or load client): they end
with the job, however it ends.

RQ runs each job in a work horse that leads its own process group (``os.setpgrp()``), and stops a job by
SIGKILL to that whole group: a Cancel (``send_stop_job_command``), the job's timeout, the worker's cold
shutdown (rq 2.12 ``rq/worker/worker_classes.py`` ``Worker.kill_horse``). A child started in a session of
its own (``start_new_session``) escapes that kill and runs on, unseen, holding the model's memory or a port:
so a job's children stay in its group, and the job stops one of them by its process tree, never by the
group, which is the job's own.
"""

from __future__ import annotations

import contextlib
import subprocess
import time

import psutil


def start_job_child(argv: list[str], **popen_kwargs) -> subprocess.Popen:
    """``subprocess.Popen(argv, **popen_kwargs)`` in the job's process group (a new session is refused)."""
    if popen_kwargs.get("start_new_session") or popen_kwargs.get("process_group") is not None:
        raise ValueError("a job's child stays in the job's process group, which RQ kills with the job")
    return subprocess.Popen(argv, **popen_kwargs)


def stop_job_child(proc: subprocess.Popen, *, grace: float) -> None:
    """SIGTERM the child and every process below it (vLLM's engine core, a client's workers), SIGKILL what is
    left after ``grace`` seconds, and reap the child. The tree is read before the first signal: a process
    that exits hands its children to init, out of reach."""
    if proc.poll() is not None:
        return
    try:
        below = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        below = []
    started = time.monotonic()
    for process in below:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.terminate()
    proc.terminate()
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    _, alive = psutil.wait_procs(below, timeout=max(0.0, grace - (time.monotonic() - started)))
    for process in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    psutil.wait_procs(alive, timeout=5)
