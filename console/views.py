import logging

from django.conf import settings
from django.contrib import messages
from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError
from django.core.paginator import Paginator
from django.db import connection
from django.http import Http404, HttpResponse, JsonResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_GET, require_POST
from redis.exceptions import RedisError

from console import services
from console.form_layout import bind_errors, errors_by_field
from console.forms import AuditFilterForm, UserCreateForm, UserUpdateForm
from console.models import AuditEvent
from console.roles import ADMIN, VIEWER, require_role, user_role
from console.selectors import overview_counts
from console.teams import visible_audit
from console.validation import error_lines, int_in_range
from workers.jobs.queues import redis_connection

log = logging.getLogger(__name__)
User = get_user_model()


def oidc_only(view_class):
    """mozilla-django-oidc's login views, where OpenID Connect is configured (settings.OIDC_ENABLED); else 404."""
    view = view_class.as_view()

    def wrapped(request, *args, **kwargs):
        if not settings.OIDC_ENABLED:
            raise Http404("Single sign-on by OpenID Connect is not configured.")
        return view(request, *args, **kwargs)

    return wrapped


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
        redis_connection().ping()
        checks["redis"] = "ok"
    except (RedisError, OSError) as exc:
        checks["redis"] = f"error: {type(exc).__name__}"
    healthy = all(v == "ok" for v in checks.values())
    return JsonResponse({"status": "ok" if healthy else "degraded", "checks": checks}, status=200 if healthy else 503)


@require_role(VIEWER)
@require_GET
def overview(request):
    return render(request, "console/overview.html", {"counts": overview_counts(user=request.user)})


@require_role(VIEWER)
@require_GET
def audit_list(request):
    events = visible_audit(AuditEvent.objects.select_related("actor"), request.user)
    form = AuditFilterForm(
        request.GET,
        actions=AuditEvent.objects.values_list("action", flat=True).distinct().order_by("action"),
        object_types=AuditEvent.objects.exclude(object_type="")
        .values_list("object_type", flat=True)
        .distinct()
        .order_by("object_type"),
    )
    filters = form.values()
    if filters["actor"]:
        events = events.filter(actor_name=filters["actor"])
    if filters["action"]:
        events = events.filter(action__startswith=filters["action"])
    if filters["object_type"]:
        events = events.filter(object_type=filters["object_type"])
    number, problems = 1, [f"{field}: {message}" for field, errs in form.errors.items() for message in errs]
    try:
        number = int_in_range(request.GET.get("page"), "page", low=1, high=1_000_000, default=1)
    except ValidationError as exc:
        problems += error_lines(exc)
    for line in problems:
        messages.error(request, line)
    if problems:
        events = events.none()
    elif filters["since"]:
        events = events.filter(created_at__date__gte=filters["since"])
    page = Paginator(events, 50).get_page(number)
    return render(
        request,
        "console/audit.html",
        {
            "page": page,
            "form": form,
            "filters": filters,  # the pager's links keep them
        },
        status=400 if problems else 200,
    )


# --- API tokens (each user manages their own) ---------------------------------------


def _tokens_page(request, *, status: int = 200, **shown):
    return render(
        request,
        "console/tokens.html",
        {"tokens": request.user.api_tokens.all(), "default_token_days": settings.API_TOKEN_DEFAULT_DAYS, **shown},
        status=status,
    )


@require_role(VIEWER)
@require_GET
def token_list(request):
    return _tokens_page(request)


@require_role(VIEWER)
@require_POST
def token_create(request):
    try:
        token, raw = services.api_token_create(
            user=request.user,
            name=request.POST.get("name", ""),
            expires_days=request.POST.get("expires_days") or None,
            request=request,
        )
    except ValidationError as exc:  # the list again, each message beside its field, as a 400
        return _tokens_page(request, status=400, errors=errors_by_field(exc), values=request.POST)
    # Shown once: only the hash is kept.
    return _tokens_page(request, new_token=raw, new_token_obj=token)


@require_role(VIEWER)
@require_POST
def token_revoke(request, token_id: int):
    token = get_object_or_404(request.user.api_tokens, pk=token_id)
    services.api_token_revoke(token=token, user=request.user, request=request)
    messages.success(request, f"Token {token.name} revoked.")
    return redirect("token_list")


# --- Users (Admin) --------------------------------------------------------------------


@require_role(ADMIN, whole_console=True)
@require_GET
def user_list(request):
    return _users_page(request)


def _users_page(request, *, status: int = 200, form: UserCreateForm | None = None):
    users = User.objects.order_by("username").prefetch_related("groups")
    rows = []
    for u in users:
        role = user_role(u)
        # Each row's form its own ids (the fields' names stay role and active).
        initial = {"role": role or "", "active": "true" if u.is_active else "false"}
        rows.append((u, role, UserUpdateForm(initial=initial, auto_id=f"id_user{u.pk}_%s")))
    return render(
        request,
        "console/users.html",
        {"rows": rows, "form": form or UserCreateForm()},
        status=status,
    )


@require_role(ADMIN, whole_console=True)
@require_POST
def user_create(request):
    """A refused user is shown again with each error beside its field (400); nothing is stored."""
    form = UserCreateForm(request.POST)
    if not form.is_valid():
        return _users_page(request, status=400, form=form)
    try:
        user, password = services.user_create(**form.cleaned_data, actor=request.user, request=request)
    except ValidationError as exc:
        bind_errors(form, exc)
        return _users_page(request, status=400, form=form)
    if password:
        messages.success(request, f"User {user.username} created. Initial password (shown once): {password}")
    else:
        messages.success(request, f"User {user.username} created.")
    return redirect("user_list")


@require_role(ADMIN, whole_console=True)
@require_POST
def user_update(request, user_id: int):
    target = get_object_or_404(User, pk=user_id)
    form = UserUpdateForm(request.POST)
    try:
        if not form.is_valid():
            raise ValidationError(form.errors.as_data())
        services.user_update(
            target=target,
            role=form.cleaned_data["role"] or None,
            active=form.cleaned_data["active"],
            actor=request.user,
            request=request,
        )
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
