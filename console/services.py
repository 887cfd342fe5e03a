"""Writes for accounts: users, roles, API tokens. Every one is audited."""

import secrets
from datetime import timedelta

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.password_validation import validate_password
from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.utils import timezone
from django.utils.text import slugify

from console.audit import audit_log
from console.models import ApiToken, ExternalIdentity, Team, TeamMembership, hash_token
from console.roles import ADMIN, ROLES, console_role, role_for_groups, set_role, user_role
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


def sso_account(*, provider: str, subject: str, username: str, email: str = ""):
    """The console account of an identity provider's user, made on the first login (no usable password: it logs
    in through the provider alone). None where the account is deactivated, or where the name is a local account's
    or another provider's: an identity provider never takes over an account it did not make."""
    identity = ExternalIdentity.objects.select_related("user").filter(provider=provider, subject=subject).first()
    if identity is not None:
        return identity.user if identity.user.is_active else None
    username = (username or "").strip()[:150]
    if not username or User.objects.filter(username__iexact=username).exists():
        return None
    try:
        with transaction.atomic():
            user = User(username=username, email=email[:254])
            user.set_unusable_password()
            user.save()
            ExternalIdentity.objects.create(provider=provider, subject=subject, user=user)
            audit_log(action="user.create", obj=user, via=provider, changes={"provider": provider})
    except IntegrityError:  # the same first login twice at once: the unique index decides
        return None
    return user


def _sso_team_roles(groups) -> dict[str, str]:
    """Team slug → the highest role the groups give in it (settings.SSO_GROUP_TEAMS)."""
    held: dict[str, list[str]] = {}
    for group in groups:
        if group in settings.SSO_GROUP_TEAMS:
            slug, role = settings.SSO_GROUP_TEAMS[group]
            held.setdefault(slug, []).append(role)
    team_roles: dict[str, str] = {}
    for slug, roles in held.items():
        best = role_for_groups(roles, {r: r for r in roles})
        assert best is not None  # every role maps to itself and `roles` is never empty
        team_roles[slug] = best
    return team_roles


def _sso_sync_teams(user, team_roles: dict[str, str]) -> dict:
    """The account's memberships of teams other than the default become exactly `team_roles`; returns what
    changed (slug → [old, new]). A team named by a slug that does not exist yet is made."""
    wanted = {}
    for slug, role in team_roles.items():
        team = Team.objects.get_or_create(slug=slug, defaults={"name": slug})[0]
        wanted[team.pk] = (slug, role)
    held = {
        m.team_id: m
        for m in TeamMembership.objects.filter(user=user).exclude(team__slug=Team.DEFAULT_SLUG).select_related("team")
    }
    changed = {}
    for team_id, membership in held.items():
        if team_id not in wanted:
            changed[membership.team.slug] = [membership.role, None]
            membership.delete()
    for team_id, (slug, role) in wanted.items():
        old = held[team_id].role if team_id in held else None
        if old != role:
            TeamMembership.objects.update_or_create(team_id=team_id, user=user, defaults={"role": role})
            changed[slug] = [old, role]
    user._team_role, user._team_ids = False, None
    return changed


def sso_login_sync(*, user, provider: str, groups, request=None) -> bool:
    """At each single sign-on login, the provider's groups decide the account's console role
    (settings.SSO_GROUP_ROLES) and its teams (settings.SSO_GROUP_TEAMS): raised, lowered or taken away. An account
    the groups give neither is refused, and its API tokens are revoked, so that removing someone from the
    provider's groups ends their access at their next login. Returns whether the login may go on."""
    groups = sorted({str(g) for g in groups})
    role = role_for_groups(groups, settings.SSO_GROUP_ROLES)
    team_roles = _sso_team_roles(groups)
    changes: dict[str, object] = {}
    with transaction.atomic():
        ExternalIdentity.objects.filter(user=user, provider=provider).update(
            groups=groups, last_login_at=timezone.now()
        )
        old = console_role(user)
        if old != role:
            set_role(user, role)
            changes["role"] = [old, role]
        if teams_changed := _sso_sync_teams(user, team_roles):
            changes["teams"] = teams_changed
        if role is None and not team_roles:
            revoked = user.api_tokens.filter(revoked_at__isnull=True).update(revoked_at=timezone.now())
            if revoked:
                changes["api_tokens_revoked"] = revoked
        if changes:
            changes["groups"] = groups
            audit_log(action="user.sso_sync", obj=user, request=request, via=provider, changes=changes)
    return role is not None or bool(team_roles)


def team_create(*, name: str, actor=None, request=None, via: str = "") -> Team:
    name = (name or "").strip()
    if not name or len(name) > 100:
        raise ValidationError({"name": "Give the team a name (1 to 100 characters)."})
    slug = slugify(name)[:50]
    if not slug:
        raise ValidationError({"name": "The name needs at least one letter or digit."})
    if Team.objects.filter(name__iexact=name).exists() or Team.objects.filter(slug=slug).exists():
        raise ValidationError({"name": f"A team named {name!r} already exists."})
    try:
        with transaction.atomic():
            team = Team.objects.create(name=name, slug=slug)
            audit_log(actor=actor, action="team.create", obj=team, request=request, via=via, changes={"name": name})
    except IntegrityError as exc:
        raise ValidationError({"name": f"A team named {name!r} already exists."}) from exc
    return team


def team_member_set(*, team: Team, username: str, role: str | None, actor=None, request=None, via: str = ""):
    """Give `username` `role` in `team` (None or "": take them out). The default team's roles are the console roles
    (console.roles.set_role): they change on the Users page, not here."""
    if team.slug == Team.DEFAULT_SLUG:
        raise ValidationError({"team": "The default team's roles are the console's: change them on the Users page."})
    if role not in (*ROLES, None, ""):
        raise ValidationError({"role": f"Choose a role: {', '.join(ROLES)} (or none, to take the user out)."})
    user = User.objects.filter(username=(username or "").strip()).first()
    if user is None:
        raise ValidationError({"user": f"No user named {username!r}."})
    with transaction.atomic():
        old = TeamMembership.objects.filter(team=team, user=user).values_list("role", flat=True).first()
        if role:
            TeamMembership.objects.update_or_create(team=team, user=user, defaults={"role": role})
        else:
            TeamMembership.objects.filter(team=team, user=user).delete()
        if old != (role or None):
            audit_log(
                actor=actor,
                action="team.member",
                obj=team,
                request=request,
                via=via,
                changes={"user": user.username, "role": [old, role or None]},
            )
    return user
