import signal
import time

from django.core.management.base import BaseCommand
from django.db import close_old_connections

from workers.jobs.services import reap_jobs


class Command(BaseCommand):
    help = "Mark jobs whose worker died as failed and remove half-written outputs, every few seconds."

    def add_arguments(self, parser):
        parser.add_argument("--interval", type=float, default=10.0)
        parser.add_argument("--once", action="store_true")

    def handle(self, *args, interval, once, **options):
        self.stopping = False

        def _stop(signum, frame):
            self.stopping = True

        signal.signal(signal.SIGTERM, _stop)
        signal.signal(signal.SIGINT, _stop)
        while True:
            close_old_connections()
            try:
                reaped = reap_jobs()
            except Exception as exc:  # database down for a moment: keep going
                self.stderr.write(f"reaper: {type(exc).__name__}: {exc}")
                reaped = []
            if reaped:
                self.stdout.write(f"reaped jobs {reaped}")
            if once or self.stopping:
                return
            deadline = time.monotonic() + interval
            while time.monotonic() < deadline and not self.stopping:
                time.sleep(0.2)
            if self.stopping:
                return
