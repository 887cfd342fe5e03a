"""Teams over the API: `GET/POST /api/v1/teams` and `POST /api/v1/teams/{id}/members` (docs/sso-and-teams.md)."""

from ninja import Router, Schema
from pydantic import ConfigDict

from console import services
from console.api_auth import api_route
from console.models import Team
from console.roles import ADMIN, VIEWER
from console.teams import check_team_role, visible_team_ids

router = Router(tags=["teams"])


class TeamIn(Schema):
    model_config = ConfigDict(extra="forbid")

    name: str


class MemberIn(Schema):
    model_config = ConfigDict(extra="forbid")

    user: str
    role: str | None = None  # Viewer, Operator, Admin; null takes the user out of the team


def team_json(team: Team) -> dict:
    members = team.memberships.select_related("user").order_by("user__username")
    return {
        "id": team.pk,
        "name": team.name,
        "slug": team.slug,
        "members": [{"user": m.user.username, "role": m.role} for m in members],
    }


def teams_for(user):
    team_ids = visible_team_ids(user)
    return Team.objects.all() if team_ids is None else Team.objects.filter(pk__in=team_ids)


@api_route(router, "get", "/teams", role=VIEWER, response=list[dict])
def list_teams(request):
    return [team_json(t) for t in teams_for(request.user).prefetch_related("memberships")]


@api_route(router, "post", "/teams", role=ADMIN, whole_console=True, response={201: dict})
def create_team(request, payload: TeamIn):
    return 201, team_json(services.team_create(name=payload.name, actor=request.user, request=request))


@api_route(router, "post", "/teams/{team_id}/members", role=ADMIN, response=dict)
def set_member(request, team_id: int, payload: MemberIn):
    """The console Admin or the team's own Admin; another team is a 404."""
    team = teams_for(request.user).filter(pk=team_id).first()
    if team is None:
        raise Team.DoesNotExist
    check_team_role(request.user, team.pk, ADMIN)
    services.team_member_set(team=team, username=payload.user, role=payload.role, actor=request.user, request=request)
    return team_json(team)
