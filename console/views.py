import logging

from django.contrib import messages
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.core.exceptions import ValidationError
from django.core.paginator import Paginator
from django.db import connection
from django.http import HttpResponse, JsonResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_GET, require_POST
from redis.exceptions import RedisError

from console import services
from console.models import AuditEvent
from console.roles import ADMIN, ROLES, VIEWER, require_role, user_role
from console.selectors import overview_counts

log = logging.getLogger(__name__)
User = get_user_model()


@require_GET
def healthz(request):
    """Liveness/readiness probe: no login, no details beyond up/down per dependency."""
    checks = {}
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
        checks["database"] = "ok"
    except Exception as exc:  # the probe must answer, whatever broke
        checks["database"] = f"error: {type(exc).__name__}"
    try:
        from workers.jobs.queues import redis_connection

        redis_connection().ping()
        checks["redis"] = "ok"
    except (RedisError, OSError) as exc:
        checks["redis"] = f"error: {type(exc).__name__}"
    healthy = all(v == "ok" for v in checks.values())
    return JsonResponse({"status": "ok" if healthy else "degraded", "checks": checks}, status=200 if healthy else 503)


@require_GET
@require_role(VIEWER)
def overview(request):
    return render(request, "console/overview.html", {"counts": overview_counts()})


@require_GET
@require_role(VIEWER)
def audit_list(request):
    events = AuditEvent.objects.select_related("actor")
    filters = {k: request.GET.get(k, "").strip() for k in ("actor", "action", "object_type", "since")}
    if filters["actor"]:
        events = events.filter(actor_name=filters["actor"])
    if filters["action"]:
        events = events.filter(action__startswith=filters["action"])
    if filters["object_type"]:
        events = events.filter(object_type=filters["object_type"])
    page = Paginator(events, 50).get_page(request.GET.get("page"))
    return render(request, "console/audit.html", {
        "page": page, "filters": filters,
        "actions": AuditEvent.objects.values_list("action", flat=True).distinct().order_by("action"),
        "object_types": AuditEvent.objects.exclude(object_type="").values_list("object_type", flat=True).distinct().order_by("object_type"),
    })


# --- API tokens (each user manages their own) ---------------------------------------

@require_GET
@require_role(VIEWER)
def token_list(request):
    return render(request, "console/tokens.html", {"tokens": request.user.api_tokens.all()})


@require_POST
@require_role(VIEWER)
def token_create(request):
    try:
        token, raw = services.api_token_create(user=request.user, name=request.POST.get("name", ""),
                                               expires_days=request.POST.get("expires_days") or None,
                                               request=request)
    except ValidationError as exc:
        messages.error(request, " ".join(exc.messages))
        return redirect("token_list")
    # Shown once: only the hash is kept.
    return render(request, "console/tokens.html", {"tokens": request.user.api_tokens.all(), "new_token": raw, "new_token_obj": token})


@require_POST
@require_role(VIEWER)
def token_revoke(request, token_id: int):
    token = get_object_or_404(request.user.api_tokens, pk=token_id)
    services.api_token_revoke(token=token, user=request.user, request=request)
    messages.success(request, f"Token {token.name} revoked.")
    return redirect("token_list")


# --- Users (Admin) --------------------------------------------------------------------

@require_GET
@require_role(ADMIN)
def user_list(request):
    users = User.objects.order_by("username").prefetch_related("groups")
    rows = [(u, user_role(u)) for u in users]
    return render(request, "console/users.html", {"rows": rows, "roles": ROLES})


@require_POST
@require_role(ADMIN)
def user_create(request):
    try:
        user, password = services.user_create(
            username=request.POST.get("username", ""), role=request.POST.get("role", ""),
            password=request.POST.get("password", ""), actor=request.user, request=request,
        )
    except ValidationError as exc:
        messages.error(request, " ".join(exc.messages))
        return redirect("user_list")
    if password:
        messages.success(request, f"User {user.username} created. Initial password (shown once): {password}")
    else:
        messages.success(request, f"User {user.username} created.")
    return redirect("user_list")


@require_POST
@require_role(ADMIN)
def user_update(request, user_id: int):
    target = get_object_or_404(User, pk=user_id)
    try:
        services.user_update(target=target, role=request.POST.get("role") or None,
                             active=request.POST.get("active"), actor=request.user, request=request)
    except ValidationError as exc:
        messages.error(request, " ".join(exc.messages))
    else:
        messages.success(request, f"User {target.username} updated.")
    return redirect("user_list")


def csrf_failure(request, reason=""):
    return HttpResponse(
        "<h1>Forbidden</h1><p>The form's security token is missing or expired. Reload the page and try again.</p>",
        status=403,
    )
