"""Running queued jobs in tests: in this process (SimpleWorker), or with a real worker subprocess."""

import subprocess
import sys

import django_rq
from rq import Queue, SimpleWorker

from tests.support import ROOT


def run_queued_jobs(*queues):
    """Run what is queued with a real RQ worker in this process (a forked worker would not
    see the test database's uncommitted rows; tests using this need transactional_db).
    Without names: every queue that holds work, per-node queues included."""
    conn = django_rq.get_connection("default")
    selected = [Queue(n, connection=conn) for n in queues] if queues else Queue.all(connection=conn)
    if selected:
        SimpleWorker(selected, connection=conn).work(burst=True)


def start_worker(env, *queues, extra_env=None):
    env = {**env, **(extra_env or {})}
    return subprocess.Popen(
        [sys.executable, "manage.py", "rqworker", "--worker-class", "rq.Worker", *queues],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def job_with_children(pid_file: str) -> None:
    """A job (run by a real RQ worker) whose child has a child of its own, all running until stopped: writes
    the work horse's, the child's and the grandchild's pids to pid_file."""
    import os
    import time
    from pathlib import Path

    from workers.jobs.children import start_job_child

    code = (
        "import subprocess, sys, time\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(300)\n"
    )
    child = start_job_child([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    grandchild = int(child.stdout.readline())
    Path(pid_file).write_text(f"{os.getpid()} {child.pid} {grandchild}")
    time.sleep(300)
