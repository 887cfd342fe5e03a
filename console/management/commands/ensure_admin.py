import secrets

from django.contrib.auth import get_user_model
from django.contrib.auth.password_validation import validate_password
from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError

from console.audit import audit_log
from console.env import env_secret
from console.roles import ADMIN, set_role


class Command(BaseCommand):
    help = (
        "Create the first Admin account if no user exists. Password from CONSOLE_ADMIN_PASSWORD "
        "(or CONSOLE_ADMIN_PASSWORD_FILE), else generated and printed once."
    )

    def add_arguments(self, parser):
        parser.add_argument("--username", default="admin")

    def handle(self, *args, username, **options):
        User = get_user_model()
        if User.objects.exists():
            self.stdout.write("Accounts exist already: no admin created.")
            return
        password = env_secret("CONSOLE_ADMIN_PASSWORD")
        generated = not password
        if generated:
            password = secrets.token_urlsafe(12)
        try:
            validate_password(password, User(username=username))  # AUTH_PASSWORD_VALIDATORS
        except ValidationError as exc:
            raise CommandError("CONSOLE_ADMIN_PASSWORD is refused: " + " ".join(exc.messages)) from None
        user = User.objects.create_user(username=username, password=password)
        set_role(user, ADMIN)
        audit_log(actor=None, action="user.create", obj=user, via="cli", changes={"role": ADMIN, "first_admin": True})
        if generated:
            self.stdout.write(
                self.style.WARNING(
                    f"Created the Admin account {username!r} with password: {password}\n"
                    f"(shown once; set CONSOLE_ADMIN_PASSWORD to choose it)"
                )
            )
        else:
            self.stdout.write(f"Created the Admin account {username!r} (password from CONSOLE_ADMIN_PASSWORD).")
