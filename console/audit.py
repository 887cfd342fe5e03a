"""The one way to write the audit log. Every state change calls `audit_log`."""
from django.conf import settings
from ipware import get_client_ip

from console.models import AuditEvent


def client_ip(request) -> str | None:
    """The client's address, for the audit log and the login lockout (AXES_CLIENT_IP_CALLABLE). Without a
    reverse proxy, REMOTE_ADDR. Behind TRUSTED_PROXIES of them, REMOTE_ADDR is the nearest proxy's, shared by
    every user: the client's is the address the outermost proxy saw, which each proxy appends to
    X-Forwarded-For, so it is the TRUSTED_PROXIES-th entry from the right (django-ipware's proxy count, which
    counts the proxies listed in the header: all but the nearest). What a client writes into the header
    itself lies to the left of it and is never taken."""
    if request is None:
        return None
    proxies = settings.TRUSTED_PROXIES
    if not proxies:
        return request.META.get("REMOTE_ADDR") or None
    found, _ = get_client_ip(request, proxy_count=proxies - 1, strict=False,
                             request_header_order=("HTTP_X_FORWARDED_FOR", "REMOTE_ADDR"))
    return found


def audit_log(*, actor=None, action: str, obj=None, changes: dict | None = None, request=None, via: str = "") -> AuditEvent:
    if actor is None and request is not None and request.user.is_authenticated:
        actor = request.user
    if not via and request is not None:
        via = "api" if request.path.startswith("/api/") else "web"
    return AuditEvent.objects.create(
        actor=actor if actor is not None and actor.pk else None,
        actor_name=getattr(actor, "username", "") or "",
        action=action,
        object_type=obj._meta.model_name if obj is not None else "",
        object_id=str(obj.pk) if obj is not None else "",
        object_repr=str(obj)[:255] if obj is not None else "",
        changes=changes or {},
        source_ip=client_ip(request),
        via=via or "cli",
    )
