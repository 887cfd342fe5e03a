"""Check this host the way an Ascend environment preparation guide does (workers/doctor.py).

    python manage.py doctor [--json] [--engine-python PATH]

Exits 1 when a check failed (warnings alone exit 0)."""

import json

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from django.db import DatabaseError

from workers.doctor import FAILED, host_report
from workers.models import Node

SHOWN = {"ok": "OK", "warning": "WARNING", "failed": "FAILED"}


class Command(BaseCommand):
    help = (
        "Check this host: npu-smi and chip health, driver and firmware, CANN and its environment, Python, "
        "vLLM/vllm-ascend against the compatibility matrix, torch-npu, disk, database, Redis, clock. "
        "Each check is ok, warning or failed with its fix; exits 1 on a failure."
    )

    def add_arguments(self, parser):
        parser.add_argument("--json", action="store_true", help="print the report as JSON")
        parser.add_argument(
            "--engine-python",
            default=settings.ENGINE_PYTHON,
            help="the engine environment's python (default: ENGINE_PYTHON)",
        )

    def handle(self, *args, engine_python: str, **options):
        # This host's node, when its agent has registered it: the engine runtime chosen on its page.
        try:
            node = Node.objects.filter(name=settings.NODE_NAME).first()
        except DatabaseError:
            node = None  # the database check below says why
        container = (
            {"runtime": node.engine_runtime, "image": node.engine_image()} if node and node.containerised else {}
        )
        report = host_report(engine_python=engine_python, **container)
        if options["json"]:
            self.stdout.write(json.dumps(report, indent=2))
        else:
            self.stdout.write(f"{report['hostname']} ({report['platform']}): {SHOWN[report['status']]}")
            for check in report["checks"]:
                self.stdout.write(f"  {SHOWN[check['status']]:<8}{check['name']}: {check['detail']}")
                if check["fix"]:
                    self.stdout.write(f"  {'':<8}fix: {check['fix']}")
        failed = [c["name"] for c in report["checks"] if c["status"] == FAILED]
        if failed:
            raise CommandError(f"{len(failed)} check(s) failed: {', '.join(failed)}", returncode=1)
