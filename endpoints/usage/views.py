"""The usage page (/usage/: one team's tokens, requests, errors and accelerator-hours, its budgets) and the budget
forms of a team and of a gateway key (the key's page loads its budgets from here: gateway.views knows nothing of
this package)."""

from datetime import timedelta

from django.contrib import messages
from django.core.exceptions import ValidationError
from django.http import Http404
from django.shortcuts import redirect, render
from django.utils import timezone
from django.views.decorators.http import require_GET, require_POST

from console.form_layout import bind_errors
from console.roles import ADMIN, VIEWER, require_role
from console.teams import team_role
from endpoints.gateway.selectors import key_get
from endpoints.usage import selectors, services
from endpoints.usage.forms import BudgetForm, UsageFilterForm


@require_role(VIEWER)
@require_GET
def usage_page(request):
    return _usage_page(request)


def _usage_page(request, *, team=None, form: BudgetForm | None = None):
    teams = list(selectors.visible_teams(user=request.user).order_by("name"))
    filters = UsageFilterForm(request.GET)
    filters.is_valid()
    wanted = filters.cleaned_data.get("team")
    days = filters.cleaned_data.get("days") or 7
    stack = filters.cleaned_data.get("stack") or "key"
    if team is None:
        if wanted is not None:
            team = selectors.team_get(wanted, user=request.user)
        elif teams:
            team = teams[0]
        else:
            raise Http404("Not found.")
    until = timezone.now()
    query = selectors.usage_query(
        user=request.user, team=team.pk, since=until - timedelta(days=days), until=until, group_by=f"hour,{stack}"
    )
    hourly = selectors.usage_rows(user=request.user, query=query)
    table_query = selectors.usage_query(
        user=request.user, team=team.pk, since=query.since, until=until, group_by="key,endpoint,model,adapter"
    )
    table = selectors.usage_rows(user=request.user, query=table_query)
    totals = selectors.usage_rows(
        user=request.user, query=selectors.usage_query(user=request.user, team=team.pk, since=query.since, until=until)
    )[0]
    accel = selectors.accelerator_hours(user=request.user, query=query)
    budgets = [selectors.budget_json(b) for b in selectors.team_budgets(team_id=team.pk)]
    can_manage = team_role(request.user, team.pk) == ADMIN
    csv_query = f"team={team.pk}&since={query.since.isoformat()}&group_by=day,key,endpoint,model,adapter"
    return render(
        request,
        "usage/usage.html",
        {
            "team": team,
            "teams": teams,
            "days": days,
            "stack": stack,
            "table": table,
            "totals": totals,
            "accel_total": round(sum(a["accelerator_hours"] for a in accel), 2),
            "replica_total": round(sum(a["replica_hours"] for a in accel), 2),
            "budgets": budgets,
            "can_manage": can_manage,
            "form": form or BudgetForm(initial={"period": "day", "mode": "hard"}),
            "csv_query": csv_query,
            "team_options": [(t.pk, t.name) for t in teams],
            "day_options": [(1, "1"), (7, "7"), (30, "30")],
            "stack_options": [("key", "key"), ("endpoint", "endpoint")],
            "chart": {"stack": stack, "hourly": hourly, "accelerator_hours": accel},
        },
        status=400 if form is not None else 200,
    )


@require_role(ADMIN)
@require_POST
def team_budget_set(request, team_id: int):
    """A refused budget is shown again on the usage page with its errors beside the fields (400)."""
    team = selectors.team_get(team_id, user=request.user, role=ADMIN)
    form = BudgetForm(request.POST)
    if form.is_valid():
        try:
            services.budget_set(team=team, **form.cleaned_data, actor=request.user, request=request)
        except ValidationError as exc:
            bind_errors(form, exc)
        else:
            messages.success(request, f"Budget per {form.cleaned_data['period']} saved.")
            return redirect(f"/usage/?team={team.pk}")
    return _usage_page(request, team=team, form=form)


@require_role(ADMIN)
@require_POST
def team_budget_delete(request, team_id: int, period: str):
    team = selectors.team_get(team_id, user=request.user, role=ADMIN)
    budget = selectors.budget_for_period(team_id=team.pk, period=period)
    services.budget_delete(budget=budget, actor=request.user, request=request)
    messages.success(request, f"Budget per {period} removed.")
    return redirect(f"/usage/?team={team.pk}")


@require_role(ADMIN)
@require_GET
def key_budgets(request, key_id: int):
    """The key's budgets with their usage and the form (a fragment of the key's page, loaded by htmx)."""
    key = key_get(key_id, user=request.user)
    return _key_budgets(request, key, template="usage/_key_budgets.html")


def _key_budgets(request, key, *, template: str, form: BudgetForm | None = None, status: int = 200):
    budgets = [selectors.budget_json(b) for b in selectors.key_budgets(key_id=key.pk)]
    form = form or BudgetForm(initial={"period": "day", "mode": "hard"})
    return render(request, template, {"key": key, "budgets": budgets, "form": form}, status=status)


@require_role(ADMIN)
@require_POST
def key_budget_set(request, key_id: int):
    """A refused budget is shown on a page of the key's budgets with the errors beside the fields (400)."""
    key = key_get(key_id, user=request.user)
    form = BudgetForm(request.POST)
    if form.is_valid():
        try:
            services.budget_set(key=key, **form.cleaned_data, actor=request.user, request=request)
        except ValidationError as exc:
            bind_errors(form, exc)
        else:
            messages.success(request, f"Budget per {form.cleaned_data['period']} saved.")
            return redirect("gateway_key_detail", key_id=key.pk)
    return _key_budgets(request, key, template="usage/key_budgets_page.html", form=form, status=400)


@require_role(ADMIN)
@require_POST
def key_budget_delete(request, key_id: int, period: str):
    key = key_get(key_id, user=request.user)
    budget = selectors.budget_for_period(key_id=key.pk, period=period)
    services.budget_delete(budget=budget, actor=request.user, request=request)
    messages.success(request, f"Budget per {period} removed.")
    return redirect("gateway_key_detail", key_id=key.pk)
