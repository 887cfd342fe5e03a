"""Lets Prometheus read /metrics with a bearer token and no session.

LoginRequiredEverywhereMiddleware sends every sessionless request to the login page; this one
runs just before it and answers ``GET /metrics`` itself when the request carries
``Authorization: Bearer ...`` (METRICS_TOKEN, or a Viewer's API token). Every other request,
/metrics without a bearer token included, goes on unchanged (session + Viewer role)."""

from workers.telemetry.views import metrics_with_token


class MetricsTokenMiddleware:
    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        if request.path == "/metrics" and request.headers.get("Authorization", "").startswith("Bearer "):
            return metrics_with_token(request)
        return self.get_response(request)
