"""Tuning pages: start one from the endpoint page, watch it, read the Pareto chart and the advice, apply it."""

from django.contrib import messages
from django.core.exceptions import ValidationError
from django.http import Http404
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_GET, require_POST

from console.exceptions import Conflict, ServiceUnavailable
from console.roles import OPERATOR, VIEWER, has_role, require_role
from console.validation import error_text
from endpoints.models import Endpoint
from endpoints.tuning import selectors, services
from endpoints.tuning.forms import TuningForm
from endpoints.tuning.models import Tuning


def _tuning(tuning_id: int) -> Tuning:
    try:
        return selectors.tuning_get(tuning_id)
    except Tuning.DoesNotExist:
        raise Http404 from None


@require_role(OPERATOR)
@require_POST
def tuning_new(request, endpoint_id: int):
    endpoint = get_object_or_404(Endpoint.objects.select_related("node", "artifact"), pk=endpoint_id)
    try:
        tuning = services.tuning_create(
            endpoint=endpoint.pk, **TuningForm(request.POST).arguments(), user=request.user, request=request
        )
    except ValidationError as exc:
        messages.error(request, "Tuning not started: " + error_text(exc))
        return redirect(endpoint)
    except (Conflict, ServiceUnavailable) as exc:
        messages.error(request, str(exc))
        return redirect(endpoint)
    messages.success(request, f"Tuning {endpoint.name} (tuning #{tuning.pk}): trial replicas start one at a time.")
    return redirect(tuning)


@require_role(VIEWER)
@require_GET
def tuning_detail(request, tuning_id: int):
    tuning = _tuning(tuning_id)
    read = selectors.analysis(tuning)
    return render(
        request,
        "tuning/tuning_detail.html",
        {
            "tuning": tuning,
            "trials": read["trials"],
            "pareto": read["pareto"],
            "chart": read["chart"],
            "is_operator": has_role(request.user, OPERATOR),
        },
    )


@require_role(VIEWER)
@require_GET
def tuning_status(request, tuning_id: int):
    """The live part of a tuning's page, polled by htmx; the page reloads when it ends."""
    tuning = _tuning(tuning_id)
    response = render(request, "tuning/_tuning_status.html", {"tuning": tuning})
    if not tuning.is_active and request.GET.get("was") == "active":
        response["HX-Refresh"] = "true"
    return response


@require_role(OPERATOR)
@require_POST
def tuning_apply(request, tuning_id: int):
    tuning = _tuning(tuning_id)
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
