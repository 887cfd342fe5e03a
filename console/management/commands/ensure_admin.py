import os
import secrets
from pathlib import Path

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.password_validation import validate_password
from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError

from console.audit import audit_log
from console.env import env_secret
from console.roles import ADMIN, set_role

GENERATED_FILE = "initial_admin_password"


def _keep_generated(password: str) -> Path:
    """The generated password in DATA_DIR/initial_admin_password, 0600 (a link there is not followed): the
    command's output is kept by `make run`'s terminal, docker and kubectl logs, so it names the file only."""
    path = Path(settings.DATA_DIR) / GENERATED_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    os.fchmod(fd, 0o600)  # one left by an earlier run with other bits
    with os.fdopen(fd, "w") as file:
        file.write(password + "\n")
    return path


class Command(BaseCommand):
    help = (
        "Create the first Admin account if no user exists. Password from CONSOLE_ADMIN_PASSWORD "
        "(or the file named by CONSOLE_ADMIN_PASSWORD_FILE), else generated into DATA_DIR/initial_admin_password."
    )

    def add_arguments(self, parser):
        parser.add_argument("--username", default="admin")

    def handle(self, *args, username, **options):
        User = get_user_model()
        if User.objects.exists():
            self.stdout.write("Accounts exist already: no admin created.")
            return
        source = (
            "CONSOLE_ADMIN_PASSWORD_FILE" if os.environ.get("CONSOLE_ADMIN_PASSWORD_FILE") else "CONSOLE_ADMIN_PASSWORD"
        )
        password = env_secret("CONSOLE_ADMIN_PASSWORD")
        generated = not password
        if generated:
            password = secrets.token_urlsafe(12)
        try:
            validate_password(password, User(username=username))  # AUTH_PASSWORD_VALIDATORS
        except ValidationError as exc:
            raise CommandError(f"{source} is refused: " + " ".join(exc.messages)) from None
        user = User.objects.create_user(username=username, password=password)
        set_role(user, ADMIN)
        audit_log(actor=None, action="user.create", obj=user, via="cli", changes={"role": ADMIN, "first_admin": True})
        if generated:
            path = _keep_generated(password)
            self.stdout.write(
                self.style.WARNING(
                    f"Created the Admin account {username!r}; its generated password is in {path} (mode 0600): "
                    f"log in with it, then delete the file (CONSOLE_ADMIN_PASSWORD_FILE chooses the password)."
                )
            )
        else:
            self.stdout.write(f"Created the Admin account {username!r} (password from {source}).")
