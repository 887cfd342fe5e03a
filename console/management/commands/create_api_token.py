from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError

from console.services import api_token_create


class Command(BaseCommand):
    help = (
        "Create an API token for USERNAME and print it (alone, on the last line). It is shown only once, "
        "and expires after API_TOKEN_DEFAULT_DAYS days unless --expires-in says otherwise."
    )

    def add_arguments(self, parser):
        parser.add_argument("username")
        parser.add_argument("--name", default="cli")
        parser.add_argument(
            "--expires-in",
            dest="expires_days",
            metavar="DAYS",
            default=None,
            help="days until it expires (default: the API_TOKEN_DEFAULT_DAYS setting)",
        )
        parser.add_argument("--expires-days", dest="expires_days", help="the same as --expires-in")

    def handle(self, *args, username, name, expires_days, **options):
        if expires_days is None:
            expires_days = settings.API_TOKEN_DEFAULT_DAYS
        try:
            user = get_user_model().objects.get(username=username)
        except get_user_model().DoesNotExist:
            raise CommandError(f"No user named {username!r}.") from None
        if not user.is_active:
            raise CommandError(f"User {username!r} is inactive.")
        try:
            _, raw = api_token_create(user=user, name=name, expires_days=expires_days, via="cli")
        except ValidationError as exc:
            raise CommandError(" ".join(exc.messages)) from exc
        self.stderr.write(f"Token {name!r} for {username}; store it now, it is not shown again:")
        self.stdout.write(raw)
