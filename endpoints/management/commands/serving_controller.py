import signal
import time

from django.conf import settings
from django.core.management.base import BaseCommand
from django.db import close_old_connections

from endpoints.gateway.controller import run_once


class Command(BaseCommand):
    help = (
        "The serving controller, in a loop: every SERVING_CONTROLLER_INTERVAL_SECONDS, each evaluator "
        "(SLO-gated rollouts, autoscaling) reads the stored telemetry and applies its decisions: a canary's "
        "next share, its promotion (switch) or its rollback; an endpoint's replica count; an ended tuning's "
        "stopped trial replicas deleted. Several may run: a decision is applied once."
    )

    def add_arguments(self, parser):
        parser.add_argument("--once", action="store_true", help="one pass, then exit")
        parser.add_argument(
            "--interval",
            type=float,
            default=None,
            help="seconds between passes (default SERVING_CONTROLLER_INTERVAL_SECONDS)",
        )

    def handle(self, *args, once, interval, **options):
        interval = settings.SERVING_CONTROLLER_INTERVAL_SECONDS if interval is None else interval
        verbose = options.get("verbosity", 1) > 1
        self.stopping = False

        def _stop(signum, frame):
            self.stopping = True

        signal.signal(signal.SIGTERM, _stop)
        signal.signal(signal.SIGINT, _stop)
        while True:
            for name, decisions in run_once().items():
                for subject, decision, applied in decisions:
                    if applied or verbose:
                        # A rollout decides for a GatewayEndpoint pair, autoscaling for an Endpoint.
                        endpoint = getattr(subject, "endpoint", subject)
                        self.stdout.write(
                            f"{name}: {endpoint.name}: {decision.action}"
                            f"{'' if applied else ' (not applied)'}: {decision.reason}"
                        )
            if once or self.stopping:
                return
            deadline = time.monotonic() + interval
            while time.monotonic() < deadline and not self.stopping:
                time.sleep(0.2)
            if self.stopping:
                return
            close_old_connections()  # drop a connection the database closed meanwhile
