"""Pages of the gateway: application keys (Admins create, revoke and set limits; a new key
is shown once), each key's usage, and the blue-green and canary controls of an endpoint."""

from django.conf import settings
from django.contrib import messages
from django.core.exceptions import ValidationError
from django.shortcuts import redirect, render
from django.views.decorators.http import require_GET, require_POST

from console.form_layout import bind_errors
from console.roles import ADMIN, OPERATOR, require_role
from console.teams import default_team_for, team_options
from console.validation import error_text
from endpoints.gateway import selectors, services
from endpoints.gateway.forms import BlueGreenForm, KeyCreateForm, KeyLimitsForm, RolloutForm, form_error_text
from endpoints.gateway.models import GatewayKey
from endpoints.models import Endpoint
from endpoints.selectors import endpoint_get, endpoint_list


@require_role(ADMIN)
@require_GET
def key_list(request):
    return _key_list_page(request)


def _key_list_page(request, *, new_key: GatewayKey | None = None, new_raw: str = "", form: KeyCreateForm | None = None):
    endpoints = endpoint_list(user=request.user).order_by("name")
    # A key's model scope may name a served model or a LoRA adapter an endpoint holds (gateway.selectors).
    models = set(endpoints.exclude(served_model_name="").values_list("served_model_name", flat=True))
    models |= set(
        Endpoint.adapters.through.objects.filter(endpoint__in=endpoints).values_list("artifact__name", flat=True)
    )
    return render(
        request,
        "gateway/keys.html",
        {
            "keys": selectors.key_list(user=request.user).prefetch_related("budgets"),
            "new_key": new_raw,
            "new_key_obj": new_key,
            "gateway_url": settings.GATEWAY_URL,
            "form": form or KeyCreateForm(initial={"team": default_team_for(request.user, role=ADMIN)}),
            "team_options": team_options(request.user, role=ADMIN),  # a key is made by an Admin of its team
            "model_options": [(m, m) for m in sorted(models)],
            "endpoint_options": [(e.name, e.name) for e in endpoints],
        },
        status=400 if form is not None and form.errors else 200,
    )


@require_role(ADMIN)
@require_POST
def key_create(request):
    """A refused key is shown again with each error beside its field; nothing is stored."""
    form = KeyCreateForm(request.POST)
    if not form.is_valid():
        return _key_list_page(request, form=form)
    try:
        fields = dict(form.cleaned_data)
        team_id = fields.pop("team")
        key, raw = services.key_create(**fields, team_id=team_id, actor=request.user, request=request)
    except ValidationError as exc:
        bind_errors(form, exc)
        return _key_list_page(request, form=form)
    # Shown once, in this answer only: only the hash is kept (not in the session either).
    return _key_list_page(request, new_key=key, new_raw=raw)


@require_role(ADMIN)
@require_POST
def key_revoke(request, key_id: int):
    key = selectors.key_get(key_id, user=request.user)
    services.key_revoke(key=key, actor=request.user, request=request)
    messages.success(request, f"Key {key} revoked: the gateway refuses it within seconds.")
    return redirect("gateway_key_list")


@require_role(ADMIN)
@require_POST
def key_limits(request, key_id: int):
    """A refused limit is shown beside its field on the key's page (400); nothing is changed."""
    key = selectors.key_get(key_id, user=request.user)
    form = KeyLimitsForm(request.POST)
    if form.is_valid():
        try:
            services.key_update_limits(key=key, **form.cleaned_data, actor=request.user, request=request)
        except ValidationError as exc:
            bind_errors(form, exc)
        else:
            messages.success(request, "Limits saved.")
            return redirect("gateway_key_detail", key_id=key.pk)
    return _key_page(request, key, form=form)


@require_role(ADMIN)
@require_GET
def key_detail(request, key_id: int):
    return _key_page(request, selectors.key_get(key_id, user=request.user))


def _key_page(request, key: GatewayKey, *, form: KeyLimitsForm | None = None):
    limits = form or KeyLimitsForm(initial={"rpm_limit": key.rpm_limit, "tpm_limit": key.tpm_limit})
    return render(request, "gateway/key_detail.html", {"key": key, "form": limits}, status=400 if form else 200)


@require_role(OPERATOR)
@require_POST
def endpoint_bluegreen(request, endpoint_id: int):
    endpoint = endpoint_get(endpoint_id, user=request.user, role=OPERATOR)
    form = BlueGreenForm(request.POST)
    if not form.is_valid():
        messages.error(request, form_error_text(form))
        return redirect("endpoint_detail", endpoint.pk)
    action = form.cleaned_data["action"]
    try:
        if action == "stage":
            staged = services.staged_endpoint(form.cleaned_data["staged"])
            services.stage(endpoint=endpoint, staged=staged, actor=request.user, request=request)
        elif action == "canary":
            services.set_canary(
                endpoint=endpoint, percent=form.cleaned_data["percent"], actor=request.user, request=request
            )
        elif action == "switch":
            services.switch(endpoint=endpoint, actor=request.user, request=request)
        else:
            services.rollback(endpoint=endpoint, actor=request.user, request=request)
        messages.success(request, f"Blue-green: {action} done.")
    except ValidationError as exc:
        messages.error(request, error_text(exc))
    return redirect("endpoint_detail", endpoint.pk)


@require_role(OPERATOR)
@require_POST
def endpoint_rollout(request, endpoint_id: int):
    endpoint = endpoint_get(endpoint_id, user=request.user, role=OPERATOR)
    form = RolloutForm(request.POST)
    if not form.is_valid():
        messages.error(request, form_error_text(form))
        return redirect("endpoint_detail", endpoint.pk)
    try:
        gw = services.set_rollout(endpoint=endpoint, **form.cleaned_data, actor=request.user, request=request)
        messages.success(
            request,
            "SLO-gated rollout saved"
            + (f": automatic, the staged side at {gw.canary_percent} %." if gw.rollout_auto else "."),
        )
    except ValidationError as exc:
        messages.error(request, error_text(exc))
    return redirect("endpoint_detail", endpoint.pk)
