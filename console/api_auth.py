"""API authentication and the per-route role check.

The role is checked inside authentication, before the body is parsed: a caller without
the role gets 403 whatever it sent, and learns nothing from validation errors."""

from functools import wraps

from django.core.exceptions import PermissionDenied
from django.http import JsonResponse
from django.utils import timezone
from ninja.security import APIKeyCookie, HttpBearer

from console.models import ApiToken, hash_token
from console.roles import VIEWER, check_role, require_role

UNAUTHENTICATED = "Authentication required: send 'Authorization: Bearer <API token>' or log in."
NOT_FOUND = "Not found."


def _token_user(request, raw):
    api_token = ApiToken.objects.active().select_related("user").filter(token_hash=hash_token(raw)).first()
    if api_token is None or not api_token.user.is_active:
        return None
    now = timezone.now()
    # Write last_used at most once a minute: a busy client must not turn reads into writes.
    if api_token.last_used_at is None or (now - api_token.last_used_at).total_seconds() > 60:
        ApiToken.objects.filter(pk=api_token.pk).update(last_used_at=now)
    request.user = api_token.user
    request.api_token = api_token
    return api_token.user


class BearerToken(HttpBearer):
    def __init__(self, role: str, whole_console: bool = False):
        super().__init__()
        self.role, self.whole_console = role, whole_console

    def authenticate(self, request, token):
        user = _token_user(request, token)
        if user is not None:
            check_role(user, self.role, whole_console=self.whole_console)  # PermissionDenied -> 403
        return user


class Session(APIKeyCookie):
    """The browser session, with CSRF (APIKeyCookie checks it)."""

    param_name = "sessionid"

    def __init__(self, role: str, whole_console: bool = False):
        from django.conf import settings

        self.param_name = settings.SESSION_COOKIE_NAME
        super().__init__(csrf=True)
        self.role, self.whole_console = role, whole_console

    def _get_key(self, request):
        # No logged-in session: there is nothing for CSRF to protect, so no 403 "CSRF check
        # Failed"; the caller is anonymous and the API answers 401.
        if not request.user.is_authenticated:
            return None
        return super()._get_key(request)

    def authenticate(self, request, key):
        if request.user.is_authenticated:
            check_role(request.user, self.role, whole_console=self.whole_console)
            return request.user
        return None


def request_user(request):
    """The caller of an API path outside the API's operations: the session's user, else the bearer token's
    (None: anonymous, or a token that is unknown, expired or revoked)."""
    if request.user.is_authenticated:
        return request.user
    scheme, _, raw = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not raw.strip():
        return None
    return _token_user(request, raw.strip())


def docs_access(view):
    """django-ninja's docs_decorator: the schema and the docs page to a Viewer, by API token or session, so that
    a client generator reads the schema with its token; anonymous callers get the API's JSON 401, a user
    without a role its JSON 403 (never the login page)."""

    @wraps(view)
    def wrapped(request, *args, **kwargs):
        user = request_user(request)
        if user is None:
            return JsonResponse({"detail": UNAUTHENTICATED}, status=401)
        try:
            check_role(user, VIEWER)
        except PermissionDenied as exc:
            return JsonResponse({"detail": str(exc)}, status=403)
        return view(request, *args, **kwargs)

    return wrapped


def api_route(router, method: str, path: str, *, role: str, whole_console: bool = False, **kwargs):
    """Register an API operation that needs `role` (Viewer, Operator or Admin; of the console itself where
    `whole_console`, else the highest a user holds: console.teams narrows it to an object's team)."""

    def decorator(func):
        view = require_role(role, whole_console=whole_console)(func)
        auth = [BearerToken(role, whole_console), Session(role, whole_console)]
        router.api_operation([method.upper()], path, auth=auth, **kwargs)(view)
        return view

    return decorator


__all__ = ["NOT_FOUND", "UNAUTHENTICATED", "PermissionDenied", "api_route", "docs_access", "request_user"]
