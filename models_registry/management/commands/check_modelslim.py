"""`manage.py check_modelslim DIR`: would vllm-ascend (the pinned release, settings.VLLM_ASCEND_VERSION) load this
ModelSlim checkpoint? Prints one line per finding (warnings marked) and exits non-zero when there is an error."""

from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from models_registry.quantize.modelslim_check import check, errors, pinned_version


class Command(BaseCommand):
    help = "Check a ModelSlim checkpoint directory against the pinned vllm-ascend's loader rules."

    def add_arguments(self, parser):
        parser.add_argument("directory", type=Path)
        parser.add_argument("--vllm-ascend", default=None, help="the release to check for (default: the pinned one)")

    def handle(self, *args, directory: Path, vllm_ascend: str | None = None, **options):
        if not directory.is_dir():
            raise CommandError(f"{directory} is not a directory")
        version = (vllm_ascend or pinned_version()).removeprefix("v")
        findings = check(directory, version=version)
        for finding in findings:
            self.stdout.write(str(finding))
        failed = errors(findings)
        if failed:
            raise CommandError(f"{len(failed)} error(s): vllm-ascend v{version} would not load {directory} as written")
        warned = len(findings) - len(failed)
        self.stdout.write(
            f"{directory}: no errors, vllm-ascend v{version}'s loader rules hold"
            + (f" ({warned} warning(s))" if warned else "")
        )
