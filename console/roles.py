"""Roles are Django groups, ordered: Viewer < Operator < Admin. A superuser is an Admin.

Every view and API route says the least role it needs; `require_role` is the one
place that decides, so pages and the API agree."""

from functools import wraps

from django.core.exceptions import PermissionDenied

from console.models import Team, TeamMembership

VIEWER, OPERATOR, ADMIN = "Viewer", "Operator", "Admin"
ROLES = (VIEWER, OPERATOR, ADMIN)
_RANK = {name: rank for rank, name in enumerate(ROLES, start=1)}


def at_least(held: str | None, role: str) -> bool:
    return held is not None and _RANK[held] >= _RANK[role]


def console_role(user) -> str | None:
    """The role a user holds in the whole console (a Django group), or None. The console Admin sees every team."""
    if not user or not user.is_authenticated or not user.is_active:
        return None
    if user.is_superuser:
        return ADMIN
    cached = getattr(user, "_console_role", False)
    if cached is not False:
        return cached
    names = set(user.groups.values_list("name", flat=True))
    role = max((n for n in names if n in _RANK), key=_RANK.get, default=None)
    user._console_role = role
    return role


def user_role(user) -> str | None:
    """The highest role a user holds, in the console or in any of their teams, or None (logged in but no role:
    sees nothing). Which team's objects a role acts on is console.teams' to say."""
    role = console_role(user)
    if role == ADMIN or role is None and not getattr(user, "is_active", False):
        return role
    cached = getattr(user, "_team_role", False)
    if cached is False:
        roles = user.team_memberships.values_list("role", flat=True)
        cached = user._team_role = max(roles, key=_RANK.get, default=None)
    return max((r for r in (role, cached) if r), key=_RANK.get, default=None)


def is_console_admin(user) -> bool:
    return console_role(user) == ADMIN


def has_role(user, role: str) -> bool:
    held = user_role(user)
    return held is not None and _RANK[held] >= _RANK[role]


def check_role(user, role: str, *, whole_console: bool = False) -> None:
    """`whole_console`: the role in the console itself (users, nodes, teams), not one a team gives."""
    held = console_role(user) if whole_console else user_role(user)
    if not at_least(held, role):
        raise PermissionDenied(f"This needs the {role} role{' of the console' if whole_console else ''}.")


def require_role(role: str, *, whole_console: bool = False):
    """View decorator: 403 unless the user holds `role` or higher (in the console itself, if `whole_console`)."""

    def decorator(view):
        @wraps(view)
        def wrapped(request, *args, **kwargs):
            check_role(request.user, role, whole_console=whole_console)
            return view(request, *args, **kwargs)

        wrapped.required_role = role
        wrapped.whole_console = whole_console
        return wrapped

    return decorator


def role_for_groups(groups, mapping: dict[str, str]) -> str | None:
    """The highest role that an identity provider's groups give through `mapping` (group name → role), or None."""
    return max((mapping[g] for g in groups if g in mapping), key=_RANK.get, default=None)


def set_role(user, role: str | None) -> None:
    """The user's role in the console, which is also their role in the default team (console.models.Team):
    what the console had before teams keeps its meaning."""
    from django.contrib.auth.models import Group

    user.groups.remove(*Group.objects.filter(name__in=ROLES))
    default_team = Team.default_id()
    if role:
        user.groups.add(Group.objects.get_or_create(name=role)[0])
        TeamMembership.objects.update_or_create(team_id=default_team, user=user, defaults={"role": role})
    else:
        TeamMembership.objects.filter(team_id=default_team, user=user).delete()
    user._console_role = user._team_role = False
    user._team_ids = None
