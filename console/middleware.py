from django.conf import settings
from django.contrib.auth.views import redirect_to_login
from django.http import JsonResponse

from console.api_auth import NOT_FOUND, UNAUTHENTICATED, request_user

API_PREFIX = "/api/"
# Paths reachable without a session. The API authenticates itself (bearer token or
# session) and answers 401 in JSON, so it must not be redirected to the login page; /oidc/ starts and ends an
# OpenID Connect login (console/sso.py).
PUBLIC_PREFIXES = ("/login/", "/healthz", "/static/", "/oidc/", API_PREFIX)


class LoginRequiredEverywhereMiddleware:
    """Login on every page, by default: a new view is protected without anyone remembering to."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        if not request.user.is_authenticated and not request.path.startswith(PUBLIC_PREFIXES):
            return redirect_to_login(request.get_full_path(), settings.LOGIN_URL)
        return self.get_response(request)


class ApiNotFoundMiddleware:
    """A path under /api/ that no route serves (Django's resolver, django-ninja's root) answers like the API's
    routes, in JSON: 404 {"detail": "Not found."} to a caller with credentials, 401 to one without (who learns
    nothing of which paths exist). The routes' own 404s are JSON already and pass unchanged."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        response = self.get_response(request)
        if (
            response.status_code == 404
            and request.path.startswith(API_PREFIX)
            and not response.get("Content-Type", "").startswith("application/json")
        ):
            if request_user(request) is None:
                return JsonResponse({"detail": UNAUTHENTICATED}, status=401)
            return JsonResponse({"detail": NOT_FOUND}, status=404)
        return response
