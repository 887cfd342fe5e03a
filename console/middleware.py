from django.conf import settings
from django.contrib.auth.views import redirect_to_login

# Paths reachable without a session. The API authenticates itself (bearer token or
# session) and answers 401 in JSON, so it must not be redirected to the login page.
PUBLIC_PREFIXES = ("/login/", "/healthz", "/static/", "/api/")


class LoginRequiredEverywhereMiddleware:
    """Login on every page, by default: a new view is protected without anyone remembering to."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        if not request.user.is_authenticated and not request.path.startswith(PUBLIC_PREFIXES):
            return redirect_to_login(request.get_full_path(), settings.LOGIN_URL)
        return self.get_response(request)
