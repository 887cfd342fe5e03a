"""Tuning pages: watch one (started from the endpoint page, endpoints.views.endpoint_tuning_new), read the Pareto
chart and the advice, apply it."""

from django.contrib import messages
from django.core.exceptions import ValidationError
from django.shortcuts import redirect, render
from django.views.decorators.http import require_GET, require_POST

from console.exceptions import Conflict
from console.roles import OPERATOR, VIEWER, at_least, require_role
from console.teams import team_role
from console.validation import error_text
from endpoints.tuning import selectors, services
from endpoints.tuning.models import Tuning


def _tuning(request, tuning_id: int, *, role: str = VIEWER) -> Tuning:
    return selectors.tuning_get(tuning_id, user=request.user, role=role)


@require_role(VIEWER)
@require_GET
def tuning_detail(request, tuning_id: int):
    tuning = _tuning(request, tuning_id)
    read = selectors.analysis(tuning)
    return render(
        request,
        "tuning/tuning_detail.html",
        {
            "tuning": tuning,
            "trials": read["trials"],
            "pareto": read["pareto"],
            "chart": read["chart"],
            "is_operator": at_least(team_role(request.user, tuning.team_id), OPERATOR),
        },
    )


@require_role(VIEWER)
@require_GET
def tuning_status(request, tuning_id: int):
    """The live part of a tuning's page, polled by htmx; the page reloads when it ends."""
    tuning = _tuning(request, tuning_id)
    response = render(request, "tuning/_tuning_status.html", {"tuning": tuning})
    if not tuning.is_active and request.GET.get("was") == "active":
        response["HX-Refresh"] = "true"
    return response


@require_role(OPERATOR)
@require_POST
def tuning_apply(request, tuning_id: int):
    tuning = _tuning(request, tuning_id, role=OPERATOR)
    raw = request.POST.get("trial", "").strip()
    if raw and not raw.isdigit():
        messages.error(request, f"trial: a trial number, not {raw[:40]!r}. Nothing was applied.")
        return redirect(tuning)
    try:
        endpoint = services.tuning_apply(
            tuning=tuning, number=int(raw) if raw else None, user=request.user, request=request
        )
    except ValidationError as exc:
        messages.error(request, "Not applied: " + error_text(exc))
        return redirect(tuning)
    except Conflict as exc:
        messages.error(request, str(exc))
        return redirect(tuning)
    messages.success(request, f"Applied to {endpoint.name}: its replicas restart one at a time with the new settings.")
    return redirect(endpoint)
