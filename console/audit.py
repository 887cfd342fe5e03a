"""The one way to write the audit log. Every state change calls `audit_log`."""
from console.models import AuditEvent


def client_ip(request) -> str | None:
    if request is None:
        return None
    # REMOTE_ADDR only: X-Forwarded-For is spoofable unless a trusted proxy sets it.
    return request.META.get("REMOTE_ADDR") or None


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
