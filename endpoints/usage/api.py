"""Usage and budgets over the API (docs/usage.md): `GET /api/v1/usage` (and `/api/v1/usage.csv`), the budgets of a
team (`/api/v1/teams/{id}/budgets`) and of a gateway key (`/api/v1/gateway/keys/{id}/budgets`)."""

from datetime import datetime
from typing import Literal

from django.http import HttpResponse
from ninja import Query, Router, Schema
from pydantic import ConfigDict, Field

from console.api_auth import api_route
from console.roles import ADMIN, VIEWER
from endpoints.gateway.selectors import key_get
from endpoints.usage import selectors, services
from endpoints.usage.export import usage_csv

router = Router(tags=["usage"])


class BudgetIn(Schema):
    model_config = ConfigDict(extra="forbid")  # a misspelt field is refused, not dropped

    tokens: int = Field(ge=1)  # tokens per period (prompt + completion)
    period: Literal["day", "month"]  # UTC calendar day or month
    mode: Literal["hard", "queue", "soft"] = "hard"


@api_route(router, "GET", "/teams/{team_id}/budgets", role=VIEWER, response=list[dict])
def team_budget_list(request, team_id: int):
    team = selectors.team_get(team_id, user=request.user)
    return [selectors.budget_json(b) for b in selectors.team_budgets(team_id=team.pk)]


@api_route(router, "POST", "/teams/{team_id}/budgets", role=ADMIN, response={201: dict})
def team_budget_set(request, team_id: int, data: BudgetIn):
    """The team's budget for the period; a second one for the same period replaces it. The team's Admin or the
    console Admin; another team is a 404."""
    team = selectors.team_get(team_id, user=request.user, role=ADMIN)
    budget = services.budget_set(
        team=team, tokens=data.tokens, period=data.period, mode=data.mode, actor=request.user, request=request
    )
    return 201, selectors.budget_json(budget)


@api_route(router, "DELETE", "/teams/{team_id}/budgets/{period}", role=ADMIN, response={204: None})
def team_budget_delete(request, team_id: int, period: str):
    team = selectors.team_get(team_id, user=request.user, role=ADMIN)
    budget = selectors.budget_for_period(team_id=team.pk, period=period)
    services.budget_delete(budget=budget, actor=request.user, request=request)
    return 204, None


@api_route(router, "GET", "/gateway/keys/{key_id}/budgets", role=ADMIN, response=list[dict])
def key_budget_list(request, key_id: int):
    key = key_get(key_id, user=request.user)
    return [selectors.budget_json(b) for b in selectors.key_budgets(key_id=key.pk)]


@api_route(router, "POST", "/gateway/keys/{key_id}/budgets", role=ADMIN, response={201: dict})
def key_budget_set(request, key_id: int, data: BudgetIn):
    """The key's budget for the period (a second one replaces it): its team's Admin or the console Admin."""
    key = key_get(key_id, user=request.user)
    budget = services.budget_set(
        key=key, tokens=data.tokens, period=data.period, mode=data.mode, actor=request.user, request=request
    )
    return 201, selectors.budget_json(budget)


@api_route(router, "DELETE", "/gateway/keys/{key_id}/budgets/{period}", role=ADMIN, response={204: None})
def key_budget_delete(request, key_id: int, period: str):
    key = key_get(key_id, user=request.user)
    budget = selectors.budget_for_period(key_id=key.pk, period=period)
    services.budget_delete(budget=budget, actor=request.user, request=request)
    return 204, None


class UsageFilters(Schema):
    """The query parameters of `GET /usage` and `/usage.csv` (selectors.usage_query checks them against the user)."""

    team: int | None = None
    key: int | None = None
    endpoint: str = ""
    model: str = ""
    since: datetime | None = None
    until: datetime | None = None
    group_by: str = ""


@api_route(router, "GET", "/usage", role=VIEWER)
def usage(request, filters: Query[UsageFilters], format: Literal["json", "csv"] = "json"):
    """Metered usage summed per group (group_by: hour, day, team, key, endpoint, model, adapter, comma-separated;
    none: one row of totals) in [since, until) (default: the last 7 days), with the accelerator-hours per team and
    hour. Filtered to the caller's teams; a team or key of another team is a 404. format=csv: the rows as CSV."""
    query = selectors.usage_query(user=request.user, **filters.dict())
    rows = selectors.usage_rows(user=request.user, query=query)
    if format == "csv":
        return _csv(query, rows)
    return {
        "since": query.since.isoformat(),
        "until": query.until.isoformat(),
        "group_by": list(query.group_by),
        "rows": rows,
        "accelerator_hours": selectors.accelerator_hours(user=request.user, query=query),
    }


@api_route(router, "GET", "/usage.csv", role=VIEWER)
def usage_csv_route(request, filters: Query[UsageFilters]):
    """The same rows as `GET /usage`, as CSV (text cells that a spreadsheet would read as a formula made inert)."""
    query = selectors.usage_query(user=request.user, **filters.dict())
    return _csv(query, selectors.usage_rows(user=request.user, query=query))


def _csv(query, rows) -> HttpResponse:
    response = HttpResponse(usage_csv(selectors.usage_columns(query), rows), content_type="text/csv; charset=utf-8")
    response["Content-Disposition"] = 'attachment; filename="usage.csv"'
    return response
