import os
import socket

from django.conf import settings
from django.core.management.base import BaseCommand
from django.db import connections
from rq import Queue

from workers.jobs.queues import redis_connection
from workers.jobs.worker import JobWorker


class Command(BaseCommand):
    help = (
        "Run an RQ worker on the given queues plus this host's own queue (node-NODE_NAME), where "
        "work that must run on this host is sent."
    )

    def add_arguments(self, parser):
        parser.add_argument("queues", nargs="*", default=["default"])
        parser.add_argument("--burst", action="store_true")

    def handle(self, *args, queues, burst, **options):
        conn = redis_connection()
        names = list(dict.fromkeys([*queues, settings.NODE_QUEUE]))
        worker = JobWorker(
            [Queue(n, connection=conn) for n in names],
            connection=conn,
            name=f"{socket.gethostname()}.{os.getpid()}.{'-'.join(queues)}",
        )
        self.stdout.write(f"worker on queues: {', '.join(names)}")
        # Each job runs in a forked work horse: it must not share this process's database
        # connection (as django-rq's rqworker does, close it before forking).
        connections.close_all()
        worker.work(burst=burst, with_scheduler=False)
