import os
import socket
from datetime import timedelta

from django.conf import settings
from django.core.management.base import BaseCommand
from django.db import connections
from rq import Queue, Worker
from rq.utils import now

from workers.jobs.queues import redis_connection


class JobWorker(Worker):
    """SIGTERM (or SIGINT) stops the running job with the worker: RQ's cold shutdown, which kills the job's
    process group and so its children (workers.jobs.children), instead of RQ's warm shutdown, which waits
    for the job to end. A supervisor waits seconds, not hours: supervisord's stopwaitsecs, systemd's
    TimeoutStopSec, Kubernetes' grace period, then it kills the worker alone, and the work horse (its own
    process group: rq 2.12 worker_classes.py ``os.setpgrp()``) ran on unseen after the console stopped. The
    reaper marks the job failed (no heartbeat) and removes its staging directory; Retry runs it again."""

    def request_stop(self, signum, frame):
        self._shutdown_requested_date = now() - timedelta(seconds=2)  # not "a second signal within 1 s"
        self.request_force_stop(signum, frame)


class Command(BaseCommand):
    help = ("Run an RQ worker on the given queues plus this host's own queue (node-NODE_NAME), where "
            "work that must run on this host is sent.")

    def add_arguments(self, parser):
        parser.add_argument("queues", nargs="*", default=["default"])
        parser.add_argument("--burst", action="store_true")

    def handle(self, *args, queues, burst, **options):
        conn = redis_connection()
        names = list(dict.fromkeys([*queues, settings.NODE_QUEUE]))
        worker = JobWorker([Queue(n, connection=conn) for n in names], connection=conn,
                           name=f"{socket.gethostname()}.{os.getpid()}.{'-'.join(queues)}")
        self.stdout.write(f"worker on queues: {', '.join(names)}")
        # Each job runs in a forked work horse: it must not share this process's database
        # connection (as django-rq's rqworker does, close it before forking).
        connections.close_all()
        worker.work(burst=burst, with_scheduler=False)
