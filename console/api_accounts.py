"""Accounts over the API: users and roles (Admin), one's own tokens, and the audit log."""

from django.contrib.auth import get_user_model
from django.shortcuts import get_object_or_404
from ninja import Query, Router, Schema
from pydantic import ConfigDict

from console import services
from console.api_auth import api_route
from console.models import AuditEvent
from console.roles import ADMIN, VIEWER, user_role
from console.teams import visible_audit

router = Router(tags=["accounts"])
User = get_user_model()


class UserIn(Schema):
    model_config = ConfigDict(extra="forbid")  # a misspelt field is refused, not dropped

    username: str
    role: str
    password: str = ""


class UserUpdate(Schema):
    model_config = ConfigDict(extra="forbid")  # a misspelt field is refused, not dropped

    role: str | None = None
    active: bool | None = None


class TokenIn(Schema):
    model_config = ConfigDict(extra="forbid")  # a misspelt field is refused, not dropped

    name: str
    expires_days: int | None = None


def user_json(user) -> dict:
    return {
        "id": user.pk,
        "username": user.username,
        "role": user_role(user) if user.is_active else None,
        "active": user.is_active,
        "last_login": user.last_login.isoformat() if user.last_login else None,
    }


def token_json(token) -> dict:
    return {
        "id": token.pk,
        "name": token.name,
        "prefix": token.prefix,
        "active": token.is_active,
        "created_at": token.created_at.isoformat(),
        "expires_at": token.expires_at.isoformat() if token.expires_at else None,
        "last_used_at": token.last_used_at.isoformat() if token.last_used_at else None,
    }


@api_route(router, "get", "/users", role=ADMIN, whole_console=True, response=list[dict])
def list_users(request):
    return [user_json(u) for u in User.objects.order_by("username")]


@api_route(router, "post", "/users", role=ADMIN, whole_console=True, response={201: dict})
def create_user(request, payload: UserIn):
    user, generated = services.user_create(
        username=payload.username, role=payload.role, password=payload.password, actor=request.user, request=request
    )
    return 201, user_json(user) | ({"password": generated} if generated else {})


@api_route(router, "post", "/users/{user_id}", role=ADMIN, whole_console=True, response=dict)
def update_user(request, user_id: int, payload: UserUpdate):
    target = get_object_or_404(User, pk=user_id)
    services.user_update(target=target, role=payload.role, active=payload.active, actor=request.user, request=request)
    return user_json(User.objects.get(pk=user_id))


@api_route(router, "get", "/tokens", role=VIEWER, response=list[dict])
def list_tokens(request):
    return [token_json(t) for t in request.user.api_tokens.all()]


@api_route(router, "post", "/tokens", role=VIEWER, response={201: dict})
def create_token(request, payload: TokenIn):
    token, raw = services.api_token_create(
        user=request.user,
        name=payload.name,
        expires_days=payload.expires_days,
        minted_with=getattr(request, "api_token", None),
        request=request,
    )
    return 201, token_json(token) | {"token": raw}


@api_route(router, "post", "/tokens/{token_id}/revoke", role=VIEWER, response=dict)
def revoke_token(request, token_id: int):
    token = get_object_or_404(request.user.api_tokens, pk=token_id)
    return token_json(services.api_token_revoke(token=token, user=request.user, request=request))


@api_route(router, "get", "/audit", role=VIEWER, response=list[dict])
def list_audit(
    request, actor: str = "", action: str = "", object_type: str = "", limit: int = Query(100, ge=1, le=1000)
):
    events = visible_audit(AuditEvent.objects.all(), request.user)
    if actor:
        events = events.filter(actor_name=actor)
    if action:
        events = events.filter(action__startswith=action)
    if object_type:
        events = events.filter(object_type=object_type)
    return [
        {
            "id": e.pk,
            "at": e.created_at.isoformat(),
            "actor": e.actor_name or None,
            "action": e.action,
            "object_type": e.object_type,
            "object_id": e.object_id,
            "object": e.object_repr,
            "changes": e.changes,
            "source_ip": e.source_ip,
            "via": e.via,
        }
        for e in events[:limit]
    ]
