"""Parse saved `npu-smi info` output and print it as JSON.

python manage.py parse_npu_smi FILE      # or '-' for stdin
"""

import json
import sys

from django.core.management.base import BaseCommand, CommandError

from workers.npu_smi import NpuSmiParseError, parse_info


class Command(BaseCommand):
    help = "Parse `npu-smi info` output (FILE, or - for stdin) and print it as JSON."
    requires_system_checks = []

    def add_arguments(self, parser):
        parser.add_argument("file", help="file holding `npu-smi info` output, or - for stdin")

    def handle(self, *args, **options):
        path = options["file"]
        if path == "-":
            text = sys.stdin.read()
            source = "stdin"
        else:
            try:
                with open(path, encoding="utf-8", errors="replace") as fh:
                    text = fh.read()
            except FileNotFoundError:
                raise CommandError(f"no such file: {path}") from None
            except OSError as exc:
                raise CommandError(f"cannot read {path}: {exc}") from exc
            source = path
        try:
            parsed = parse_info(text)
        except NpuSmiParseError as exc:
            raise CommandError(f"{source}: {exc}") from exc
        self.stdout.write(json.dumps(parsed, indent=2))
