"""Writes for accounts: users, roles, API tokens. Every one is audited."""

import secrets
from datetime import timedelta

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.password_validation import validate_password
from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.utils import timezone

from console.audit import audit_log
from console.models import ApiToken, hash_token
from console.roles import ADMIN, ROLES, set_role, user_role
from console.validation import int_in_range

User = get_user_model()


def api_token_create(
    *, user, name: str, expires_days=None, minted_with: ApiToken | None = None, request=None, via: str = ""
) -> tuple[ApiToken, str]:
    """`minted_with`: the token the request came with, if any. The new token expires no later than it, so that
    a leaked short-lived token cannot be turned into a long-lived one."""
    name = (name or "").strip()
    if not name:
        raise ValidationError({"name": "Give the token a name (what will use it)."})
    if len(name) > 100:
        raise ValidationError({"name": "The name is too long (100 characters at most)."})
    # Blank is the default lifetime, as for `manage.py create_api_token`: a token that never expires is not offered.
    days = int_in_range(
        expires_days,
        "expires_days",
        low=1,
        high=3650,
        default=settings.API_TOKEN_DEFAULT_DAYS,
        message="Expiry must be a whole number of days, between 1 and 3650.",
    )
    expires_at = timezone.now() + timedelta(days=days)
    limit = minted_with.expires_at if minted_with is not None else None
    if limit is not None and expires_at > limit:
        if expires_days not in (None, ""):
            raise ValidationError(
                {
                    "expires_days": f"A token made with a token cannot outlive it: the one this "
                    f"request came with expires {limit:%Y-%m-%d %H:%M} UTC."
                }
            )
        expires_at = limit  # the default lifetime, cut to the minting token's
    raw = ApiToken.generate_raw()
    token = ApiToken.objects.create(
        user=user, name=name, prefix=raw[:10], token_hash=hash_token(raw), expires_at=expires_at
    )
    audit_log(
        actor=user,
        action="api_token.create",
        obj=token,
        request=request,
        via=via,
        changes={"name": name, "expires_at": expires_at.isoformat()},
    )
    return token, raw


def api_token_revoke(*, token: ApiToken, user, request=None) -> ApiToken:
    if token.revoked_at is None:
        token.revoked_at = timezone.now()
        token.save(update_fields=["revoked_at"])
        audit_log(actor=user, action="api_token.revoke", obj=token, request=request)
    return token


def user_create(*, username: str, role: str, password: str = "", actor=None, request=None, via: str = ""):
    """Create a user with a role; a blank password is generated and returned once."""
    username = (username or "").strip()
    if not username:
        raise ValidationError({"username": "Enter a username."})
    if role not in ROLES:
        raise ValidationError({"role": f"Choose a role: {', '.join(ROLES)}."})
    if User.objects.filter(username__iexact=username).exists():
        raise ValidationError({"username": f"A user named {username!r} already exists."})
    user = User(username=username)
    try:
        User._meta.get_field("username").run_validators(username)
    except ValidationError as exc:
        raise ValidationError({"username": f"Invalid username: {' '.join(exc.messages)}"}) from exc
    generated = ""
    if not password:
        generated = password = secrets.token_urlsafe(12)
    try:
        validate_password(password, user)
    except ValidationError as exc:
        raise ValidationError({"password": exc.messages}) from exc
    try:
        with transaction.atomic():
            user.set_password(password)
            user.save()
            set_role(user, role)
            audit_log(actor=actor, action="user.create", obj=user, request=request, via=via, changes={"role": role})
    except IntegrityError as exc:  # the same name created at the same moment: the unique index decides
        raise ValidationError({"username": f"A user named {username!r} already exists."}) from exc
    return user, generated


def user_update(*, target, role: str | None = None, active: bool | None = None, actor, request=None):
    """Every value is checked before anything is written: a refused part changes nothing."""
    if role is not None:
        if role not in ROLES:
            raise ValidationError({"role": f"Choose a role: {', '.join(ROLES)}."})
        if target.pk == actor.pk and role != ADMIN:
            raise ValidationError({"role": "You cannot remove your own Admin role."})
    if active is not None and target.pk == actor.pk and not active:
        raise ValidationError({"active": "You cannot deactivate yourself."})
    changes: dict[str, list] = {}  # field -> [before, after], for the audit row
    with transaction.atomic():
        old = user_role(target)
        if role is not None and old != role:
            set_role(target, role)
            changes["role"] = [old, role]
        if active is not None and target.is_active != active:
            changes["is_active"] = [target.is_active, active]
            target.is_active = active
            target.save(update_fields=["is_active"])
            if not active:
                target.api_tokens.filter(revoked_at__isnull=True).update(revoked_at=timezone.now())
        if changes:
            audit_log(actor=actor, action="user.update", obj=target, request=request, changes=changes)
    return target
