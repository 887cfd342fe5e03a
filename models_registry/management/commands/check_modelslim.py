"""`manage.py check_modelslim DIR`: would vllm-ascend (the pinned v0.23.0) load this ModelSlim checkpoint?
Prints one line per finding and exits non-zero when there is any."""

from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from models_registry.quantize.modelslim_check import check


class Command(BaseCommand):
    help = "Check a ModelSlim checkpoint directory against vllm-ascend v0.23.0's loader rules."

    def add_arguments(self, parser):
        parser.add_argument("directory", type=Path)

    def handle(self, *args, directory: Path, **options):
        if not directory.is_dir():
            raise CommandError(f"{directory} is not a directory")
        findings = check(directory)
        for finding in findings:
            self.stdout.write(str(finding))
        if findings:
            raise CommandError(f"{len(findings)} finding(s): vllm-ascend would not load {directory} as written")
        self.stdout.write(f"{directory}: no findings, vllm-ascend v0.23.0's loader rules hold")
