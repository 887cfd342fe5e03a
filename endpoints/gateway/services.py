"""Changing gateway state: API keys (create, revoke) and per-endpoint settings. Each change
is audited. The gateway process picks changes up within GATEWAY_KEY_CACHE_SECONDS (keys)
and GATEWAY_ROUTES_REFRESH_SECONDS (routes)."""
from __future__ import annotations

from datetime import timedelta

from django.core.exceptions import ValidationError
from django.utils import timezone

from console.audit import audit_log
from console.models import hash_token
from endpoints.gateway.models import GatewayEndpoint, GatewayKey


def _names(value) -> list[str]:
    if value in (None, ""):
        return []
    if isinstance(value, str):
        value = value.replace(",", " ").split()
    names = sorted({str(v).strip() for v in value if str(v).strip()})
    for n in names:
        if len(n) > 100:
            raise ValidationError(f"Scope name too long: {n[:40]}…")
    return names


def _limit(value, what: str) -> int | None:
    if value in (None, ""):
        return None
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise ValidationError(f"{what} must be a whole number.") from None
    if not 1 <= n <= 10_000_000:
        raise ValidationError(f"{what} must be between 1 and 10000000.")
    return n


def key_create(*, name: str, models=None, endpoints=None, expires_days=None, expires_at=None, rpm_limit=None,
               tpm_limit=None, actor=None, request=None, via: str = "") -> tuple[GatewayKey, str]:
    """Create a gateway key; returns (key, raw). The raw key is not stored anywhere."""
    name = (name or "").strip()
    if not name:
        raise ValidationError("Give the key a name (the application that will use it).")
    if len(name) > 100:
        raise ValidationError("The name is too long (100 characters at most).")
    if expires_days not in (None, ""):
        try:
            days = float(expires_days)
        except (TypeError, ValueError):
            raise ValidationError("Expiry must be a number of days.") from None
        if not 0 < days <= 3650:
            raise ValidationError("Expiry must be between 0 and 3650 days.")
        expires_at = timezone.now() + timedelta(days=days)
    raw = GatewayKey.generate_raw()
    key = GatewayKey.objects.create(
        name=name, prefix=raw[:10], key_hash=hash_token(raw), models_scope=_names(models),
        endpoints_scope=_names(endpoints), rpm_limit=_limit(rpm_limit, "Requests per minute"),
        tpm_limit=_limit(tpm_limit, "Tokens per minute"), expires_at=expires_at,
        created_by=actor if actor is not None and getattr(actor, "pk", None) else None)
    audit_log(actor=actor, action="gateway_key.create", obj=key, request=request, via=via, changes={
        "name": name, "models": key.models_scope, "endpoints": key.endpoints_scope, "rpm_limit": key.rpm_limit,
        "tpm_limit": key.tpm_limit, "expires_at": expires_at.isoformat() if expires_at else None})
    return key, raw


def key_revoke(*, key: GatewayKey, actor=None, request=None, via: str = "") -> GatewayKey:
    if key.revoked_at is None:
        key.revoked_at = timezone.now()
        key.save(update_fields=["revoked_at"])
        audit_log(actor=actor, action="gateway_key.revoke", obj=key, request=request, via=via)
    return key


def key_update_limits(*, key: GatewayKey, rpm_limit=None, tpm_limit=None, actor=None, request=None,
                      via: str = "") -> GatewayKey:
    before = {"rpm_limit": key.rpm_limit, "tpm_limit": key.tpm_limit}
    key.rpm_limit, key.tpm_limit = _limit(rpm_limit, "Requests per minute"), _limit(tpm_limit, "Tokens per minute")
    key.save(update_fields=["rpm_limit", "tpm_limit"])
    audit_log(actor=actor, action="gateway_key.update", obj=key, request=request, via=via,
              changes={"before": before, "after": {"rpm_limit": key.rpm_limit, "tpm_limit": key.tpm_limit}})
    return key


def endpoint_settings(endpoint) -> GatewayEndpoint:
    return GatewayEndpoint.objects.get_or_create(endpoint=endpoint)[0]


def set_queue_depth(*, endpoint, queue_depth, actor=None, request=None, via: str = "") -> GatewayEndpoint:
    gw = endpoint_settings(endpoint)
    before = gw.queue_depth
    gw.queue_depth = _limit(queue_depth, "Queue depth")
    gw.save(update_fields=["queue_depth"])
    audit_log(actor=actor, action="gateway.queue_depth", obj=endpoint, request=request, via=via,
              changes={"before": before, "after": gw.queue_depth})
    return gw
