"""Roles are Django groups, ordered: Viewer < Operator < Admin. A superuser is an Admin.

Every view and API route says the least role it needs; `require_role` is the one
place that decides, so pages and the API agree."""

from functools import wraps

from django.core.exceptions import PermissionDenied

VIEWER, OPERATOR, ADMIN = "Viewer", "Operator", "Admin"
ROLES = (VIEWER, OPERATOR, ADMIN)
_RANK = {name: rank for rank, name in enumerate(ROLES, start=1)}


def user_role(user) -> str | None:
    """The highest role a user holds, or None (logged in but no role: sees nothing)."""
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


def has_role(user, role: str) -> bool:
    held = user_role(user)
    return held is not None and _RANK[held] >= _RANK[role]


def check_role(user, role: str) -> None:
    if not has_role(user, role):
        raise PermissionDenied(f"This needs the {role} role.")


def require_role(role: str):
    """View decorator: 403 unless the user holds `role` or higher."""

    def decorator(view):
        @wraps(view)
        def wrapped(request, *args, **kwargs):
            check_role(request.user, role)
            return view(request, *args, **kwargs)

        wrapped.required_role = role
        return wrapped

    return decorator


def role_for_groups(groups, mapping: dict[str, str]) -> str | None:
    """The highest role that an identity provider's groups give through `mapping` (group name → role), or None."""
    return max((mapping[g] for g in groups if g in mapping), key=_RANK.get, default=None)


def set_role(user, role: str | None) -> None:
    from django.contrib.auth.models import Group

    user.groups.remove(*Group.objects.filter(name__in=ROLES))
    if role:
        user.groups.add(Group.objects.get_or_create(name=role)[0])
    user._console_role = False
