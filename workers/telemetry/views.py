import hmac

from django.conf import settings
from django.contrib import messages
from django.core.exceptions import PermissionDenied, ValidationError
from django.http import HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_GET, require_POST

from console.api_auth import _token_user
from console.form_layout import bind_errors
from console.roles import OPERATOR, VIEWER, check_role, require_role
from console.teams import visible_team_ids
from console.validation import error_text
from workers.models import Node
from workers.telemetry import selectors, services
from workers.telemetry.exposition import exposition
from workers.telemetry.forms import AlertRuleForm, AlertRuleUpdateForm
from workers.telemetry.models import AlertRule
from workers.telemetry.sources import hidden_endpoints, hidden_keys, processes_seen

PROMETHEUS_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@require_role(VIEWER)
@require_GET
def fleet_panel(request):
    """The Overview's live part (fleet cards and alerts), polled by htmx."""
    team_ids = visible_team_ids(request.user)
    hidden = hidden_endpoints(team_ids)  # other teams' endpoints
    firing, resolved = services.recent_alerts(team_ids=team_ids)
    return render(
        request,
        "telemetry/_fleet.html",
        {"fleet": selectors.fleet_summary(hidden_endpoints=hidden), "firing": firing, "resolved": resolved},
    )


@require_role(VIEWER)
@require_GET
def overview_nodes(request):
    """A small chart per node for the Overview (loaded once; the charts update themselves)."""
    return render(request, "telemetry/_overview_nodes.html", {"nodes": Node.objects.all()})


@require_role(VIEWER)
@require_GET
def node_panel(request, node_id: int):
    """The node page's live part: devices with their processes mapped to endpoints. A process of another team's
    endpoint shows that it holds the device, not which endpoint it serves: the node is shared, the endpoint is not."""
    node = get_object_or_404(Node, pk=node_id)
    hidden = hidden_endpoints(visible_team_ids(request.user))
    devices = list(node.devices.all())
    for device in devices:
        device.processes = processes_seen(device.latest, hidden)
    return render(request, "telemetry/_node_panel.html", {"node": node, "devices": devices})


@require_role(VIEWER)
@require_GET
def alert_list(request):
    return _alerts_page(request)


def _alerts_page(request, *, form: AlertRuleForm | None = None):
    rules = AlertRule.objects.all()
    return render(
        request,
        "telemetry/alerts.html",
        {
            "rules": [(rule, AlertRuleUpdateForm(rule=rule)) for rule in rules],
            "alerts": services.visible_alerts(team_ids=visible_team_ids(request.user)).select_related("rule")[:200],
            "form": form or AlertRuleForm(),
            "webhook": bool(settings.TELEMETRY_ALERT_WEBHOOK_URL),
        },
        status=400 if form is not None else 200,
    )


@require_role(OPERATOR)
@require_POST
def alert_rule_create(request):
    """A refused rule is shown again with each error beside its field (400); nothing is stored."""
    form = AlertRuleForm(request.POST)
    if not form.is_valid():
        return _alerts_page(request, form=form)
    try:
        rule = services.alert_rule_create(**form.cleaned_data, actor=request.user, request=request, via="web")
    except ValidationError as exc:
        bind_errors(form, exc)
        return _alerts_page(request, form=form)
    messages.success(request, f"Rule “{rule.name}” created.")
    return redirect("alert_list")


@require_role(OPERATOR)
@require_POST
def alert_rule_update(request, rule_id: int):
    rule = get_object_or_404(AlertRule, pk=rule_id)
    form = AlertRuleUpdateForm(request.POST)
    try:
        if not form.is_valid():
            raise ValidationError(form.errors.as_data())
        services.alert_rule_update(rule=rule, **form.cleaned_data, actor=request.user, request=request, via="web")
    except ValidationError as exc:
        messages.error(request, f"Rule “{rule.name}” not saved: {error_text(exc)}")
        return redirect("alert_list")
    messages.success(request, f"Rule “{rule.name}” saved.")
    return redirect("alert_list")


def _exposition_response(user=None):
    """`user`: the reader, whose teams' gateway keys alone are shown; None: the shared METRICS_TOKEN (the fleet's
    Prometheus), which reads every key."""
    if user is None:
        return HttpResponse(exposition(), content_type=PROMETHEUS_TYPE)
    team_ids = visible_team_ids(user)
    return HttpResponse(exposition(hidden_keys(team_ids), hidden_endpoints(team_ids)), content_type=PROMETHEUS_TYPE)


@require_role(VIEWER)
@require_GET
def metrics_exposition(request):
    """Prometheus exposition for a logged-in Viewer. Scrapers send a bearer token instead
    (METRICS_TOKEN or a Viewer's API token): see metrics_with_token."""
    return _exposition_response(request.user)


def metrics_with_token(request):
    """/metrics with ``Authorization: Bearer`` (called by MetricsTokenMiddleware, before the
    login redirect): 401 for an unknown token, 403 for a user below Viewer."""
    if request.method not in ("GET", "HEAD"):
        return HttpResponse("Method not allowed\n", status=405, content_type="text/plain", headers={"Allow": "GET"})
    raw = request.headers.get("Authorization", "")[len("Bearer ") :].strip()
    expected = settings.METRICS_TOKEN
    user = None
    if not (expected and hmac.compare_digest(raw.encode(), expected.encode())):
        user = _token_user(request, raw) if raw else None
        if user is None:
            return HttpResponse(
                "Unknown or expired token\n",
                status=401,
                content_type="text/plain",
                headers={"WWW-Authenticate": "Bearer"},
            )
        try:
            check_role(user, VIEWER)
        except PermissionDenied:
            return HttpResponse("This needs the Viewer role.\n", status=403, content_type="text/plain")
    return _exposition_response(user)
