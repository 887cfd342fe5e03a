"""Create a gateway API key for an application; the key is printed alone on the last line."""

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError

from endpoints.gateway.services import key_create


class Command(BaseCommand):
    help = "Create a gateway API key (shown once; only its hash is stored)."

    def add_arguments(self, parser):
        parser.add_argument("--name", required=True, help="the application that will use it")
        parser.add_argument("--models", nargs="*", default=[], help="served model names it may use (default: all)")
        parser.add_argument("--endpoints", nargs="*", default=[], help="endpoint names it may use")
        parser.add_argument("--expires-days", type=float, default=None)
        parser.add_argument("--rpm", type=int, default=None, help="requests per minute")
        parser.add_argument("--tpm", type=int, default=None, help="tokens per minute")

    def handle(self, *args, name, models, endpoints, expires_days, rpm, tpm, **options):
        try:
            key, raw = key_create(
                name=name,
                models=models,
                endpoints=endpoints,
                expires_days=expires_days,
                rpm_limit=rpm,
                tpm_limit=tpm,
                via="cli",
            )
        except ValidationError as exc:
            raise CommandError(" ".join(exc.messages)) from exc
        self.stderr.write(f"Gateway key {key.pk} for {key.name} ({key.scope_text}). Shown once:")
        self.stdout.write(raw)
