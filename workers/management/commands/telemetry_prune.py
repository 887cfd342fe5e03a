import signal
import time

from django.conf import settings
from django.core.management.base import BaseCommand
from django.db import close_old_connections

from workers.telemetry.services import evaluate_alerts, rollup_and_prune


class Command(BaseCommand):
    help = (
        "Telemetry housekeeping, in a loop: roll raw points up into 1-minute min/avg/max, prune raw "
        "points and rollups past their retention (every TELEMETRY_PRUNE_INTERVAL_SECONDS) and evaluate "
        "alert rules, POSTing changes to the webhook (every TELEMETRY_ALERT_INTERVAL_SECONDS)."
    )

    def add_arguments(self, parser):
        parser.add_argument("--once", action="store_true", help="one rollup/prune and one alert pass, then exit")
        parser.add_argument("--no-alerts", action="store_true", help="only roll up and prune")

    def handle(self, *args, once, no_alerts, **options):
        self.stopping = False

        def _stop(signum, frame):
            self.stopping = True

        signal.signal(signal.SIGTERM, _stop)
        signal.signal(signal.SIGINT, _stop)
        next_prune = next_alerts = 0.0
        while not self.stopping:
            now = time.monotonic()
            if now >= next_prune:
                next_prune = now + settings.TELEMETRY_PRUNE_INTERVAL_SECONDS
                try:
                    result = rollup_and_prune()
                    if any(result.values()):
                        self.stdout.write(f"telemetry: {result}")
                except Exception as exc:  # database down for a moment: keep going
                    self.stderr.write(f"telemetry rollup/prune: {type(exc).__name__}: {exc}")
            if not no_alerts and now >= next_alerts:
                next_alerts = now + settings.TELEMETRY_ALERT_INTERVAL_SECONDS
                try:
                    for alert in evaluate_alerts():
                        self.stdout.write(f"alert {alert.state}: {alert.rule.name} {alert.label}")
                except Exception as exc:
                    self.stderr.write(f"telemetry alerts: {type(exc).__name__}: {exc}")
            if once:
                return
            deadline = min(next_prune, next_alerts if not no_alerts else next_prune)
            while time.monotonic() < deadline and not self.stopping:
                time.sleep(0.2)
            close_old_connections()  # drop a connection the database closed meanwhile
