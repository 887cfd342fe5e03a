"""Which teams' objects a user sees, and what they may do to one: the one place that decides (docs/sso-and-teams.md).

A team owns models, artifacts, endpoints, gateway keys, benchmarks and profiles (console.models.TeamOwned). Its
members see its objects in the role their membership gives; the console Admin sees every team's. Each app's
selectors read through `visible` and `visible_get`, so that lists, pages and API answers agree, and an object of
another team is a 404 (its existence is not told), never a 403."""

from django.core.exceptions import PermissionDenied, ValidationError
from django.db.models import Q, QuerySet
from django.http import Http404

from console.models import Team, TeamMembership
from console.roles import ADMIN, OPERATOR, VIEWER, at_least, console_role


def visible_team_ids(user) -> set[int] | None:
    """The teams whose objects `user` sees; None: every team's (the console Admin)."""
    if console_role(user) == ADMIN:
        return None
    if not user or not user.is_authenticated or not user.is_active:
        return set()
    cached = getattr(user, "_team_ids", None)
    if cached is None:
        cached = user._team_ids = set(TeamMembership.objects.filter(user=user).values_list("team_id", flat=True))
    return cached


def visible(queryset: QuerySet, user, *, field: str = "team") -> QuerySet:
    """`queryset` narrowed to the teams `user` sees (`field`: the path to the team, e.g. "endpoint__team")."""
    team_ids = visible_team_ids(user)
    return queryset if team_ids is None else queryset.filter(**{f"{field}_id__in": team_ids})


def team_role(user, team_id: int) -> str | None:
    if console_role(user) == ADMIN:
        return ADMIN
    if not user or not user.is_authenticated or not user.is_active:
        return None
    return TeamMembership.objects.filter(user=user, team_id=team_id).values_list("role", flat=True).first()


def check_team_role(user, team_id: int, role: str) -> None:
    """403 unless `user` holds `role` or higher in the team (a member seeing the object, so no 404 to keep)."""
    held = team_role(user, team_id)
    if not at_least(held, role):
        raise PermissionDenied(f"This needs the {role} role in the object's team.")


def visible_get(queryset: QuerySet, user, *, role: str = VIEWER, **lookup):
    """The one object of `queryset` matching `lookup` that `user` sees: 404 when there is none or it is another
    team's; 403 when it is theirs to see but their role in its team is below `role`."""
    obj = visible(queryset, user).filter(**lookup).first()
    if obj is None:
        raise Http404("Not found.")
    if role != VIEWER:
        check_team_role(user, obj.team_id, role)
    return obj


def team_for_new(user, team_id: int | None, *, role: str = OPERATOR) -> int:
    """The team a new object of `user`'s goes to: `team_id` where they hold `role` there; none given, the default
    team where they are its member (or the console Admin), else the first of theirs where they hold `role`. Without
    a user (the system: a management command), `team_id` or the default team."""
    if user is None:
        return team_id if team_id is not None else Team.default_id()
    if team_id is not None:
        if not Team.objects.filter(pk=team_id).exists() or not at_least(team_role(user, team_id), role):
            raise ValidationError({"team": f"No team {team_id} where you hold the {role} role."})
        return team_id
    default_id = Team.default_id()
    if at_least(team_role(user, default_id), role):
        return default_id
    mine = TeamMembership.objects.filter(user=user).order_by("team__name").values_list("team_id", "role")
    for candidate, held in mine:
        if at_least(held, role):
            return candidate
    raise ValidationError({"team": f"You hold the {role} role in no team."})


def visible_or_shared(queryset: QuerySet, user) -> QuerySet:
    """Rows whose team may be none (audit rows, jobs): those of another team are left out; those of no team's
    object (users, nodes, logins, a node's jobs) stay, as before teams."""
    team_ids = visible_team_ids(user)
    if team_ids is None:
        return queryset
    return queryset.filter(Q(team__isnull=True) | Q(team_id__in=team_ids))


def visible_or_shared_get(queryset: QuerySet, user, *, role: str = VIEWER, **lookup):
    """As visible_get, for rows whose team may be none: one of no team needs `role` of the console only (the
    route's own check)."""
    obj = visible_or_shared(queryset, user).filter(**lookup).first()
    if obj is None:
        raise Http404("Not found.")
    if role != VIEWER and obj.team_id is not None:
        check_team_role(user, obj.team_id, role)
    return obj


def visible_audit(events: QuerySet, user) -> QuerySet:
    """Audit rows: those about another team's objects (a gateway key, an endpoint, ...) are left out; rows about
    no team's object (users, nodes, logins) stay, as before teams."""
    return visible_or_shared(events, user)


def team_options(user, *, role: str = OPERATOR) -> list[tuple[int, str]]:
    """The teams a new object of `user`'s may go to, for a form's team field: those where they hold `role` (every
    team for the console Admin), by name. team_for_new checks the one posted."""
    if console_role(user) == ADMIN:
        return list(Team.objects.order_by("name").values_list("pk", "name"))
    held = TeamMembership.objects.filter(user=user).select_related("team").order_by("team__name")
    return [(m.team_id, m.team.name) for m in held if at_least(m.role, role)]


def default_team_for(user, *, role: str = OPERATOR) -> int | None:
    """The team a form's team field starts at: where a new object goes when none is chosen (team_for_new)."""
    try:
        return team_for_new(user, None, role=role)
    except ValidationError:
        return None
