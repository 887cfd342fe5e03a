"""The one way to write the audit log. Every state change calls `audit_log`."""

import ipaddress

from django.conf import settings

from console.models import AuditEvent


def client_ip(request) -> str | None:
    """The client's address, for the audit log and the login lockout (AXES_CLIENT_IP_CALLABLE). Without a
    reverse proxy, REMOTE_ADDR. Behind TRUSTED_PROXIES of them, REMOTE_ADDR is the nearest proxy's, shared by
    every user: each proxy appends the address it was reached from to X-Forwarded-For, so the client's is
    the TRUSTED_PROXIES-th entry from the right. Whatever the client wrote into the header itself lies to
    the left of it and is never taken; a header with fewer entries, or no address there, gives REMOTE_ADDR.

    Written by hand: django-ipware 8.0.0 (python-ipware 4.1.1 ``split_unquoted``) reads a double quote as
    opening a quoted string, so a client's unclosed quote swallowed the entries the proxies appended and the
    forged entry before it was taken; and its ranking of addresses (public first) took the proxy's public
    address over an intranet client's."""
    if request is None:
        return None
    remote = request.META.get("REMOTE_ADDR") or None
    proxies = settings.TRUSTED_PROXIES
    if not proxies:
        return remote
    hops = request.META.get("HTTP_X_FORWARDED_FOR", "").split(",")
    if len(hops) < proxies:
        return remote
    return _address(hops[-proxies]) or remote


def _address(hop: str) -> str | None:
    """An X-Forwarded-For entry as an address ("203.0.113.7", "2001:db8::1", "[2001:db8::1]:443",
    "203.0.113.7:51000"), or None."""
    text = hop.strip()
    if text.startswith("[") and "]" in text:  # a bracketed IPv6 address, perhaps with a port
        text = text[1 : text.index("]")]
    elif text.count(":") == 1:  # IPv4 with a port
        text = text.partition(":")[0]
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        return None


def audit_log(
    *, actor=None, action: str, obj=None, changes: dict | None = None, request=None, via: str = ""
) -> AuditEvent:
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
        team_id=getattr(obj, "team_id", None),
    )
