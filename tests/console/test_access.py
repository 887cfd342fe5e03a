"""Every route checks its role on the server. The route lists come from the URL resolver
and the API itself, so a new route without a check fails here."""

import re

import pytest
from django.test import Client
from django.urls import URLPattern, URLResolver, get_resolver

from console.api import api
from console.roles import ADMIN, OPERATOR, VIEWER

PUBLIC = {"login", "logout", "healthz", "oidc_authentication_init", "oidc_authentication_callback"}
BELOW = {VIEWER: "outsider", OPERATOR: "viewer", ADMIN: "operator"}


def _page_routes():
    routes = []

    def walk(patterns, prefix=""):
        for p in patterns:
            if isinstance(p, URLResolver):
                if str(p.pattern).startswith("api/"):
                    continue
                walk(p.url_patterns, prefix + str(p.pattern))
            elif isinstance(p, URLPattern):
                routes.append((p.name, prefix + str(p.pattern), p.callback))

    walk(get_resolver().url_patterns)
    return routes


def _api_routes():
    routes = []
    for prefix, router in api._routers:
        for path, path_view in router.path_operations.items():
            for op in path_view.operations:
                for method in op.methods:
                    routes.append(
                        (
                            method,
                            "/api/v1" + (prefix.rstrip("/") + "/" + path.lstrip("/")).replace("//", "/"),
                            op.view_func,
                        )
                    )
    return routes


def _concrete(path):
    path = re.sub(r"<int:[a-z_]+>", "1", path)
    path = re.sub(r"\{[a-z_]+\}", "1", path)
    return "/" + path.lstrip("/")


PAGES = [r for r in _page_routes() if r[0] not in PUBLIC]
API = _api_routes()


def test_route_lists_are_not_empty():
    assert len(PAGES) > 15 and len(API) > 8


@pytest.mark.parametrize("name,path,view", PAGES, ids=[r[0] for r in PAGES])
def test_every_page_declares_a_role(name, path, view):
    assert getattr(view, "required_role", None) in (VIEWER, OPERATOR, ADMIN), f"{name} has no @require_role"


@pytest.mark.parametrize("method,path,view", API, ids=[f"{m} {p}" for m, p, _ in API])
def test_every_api_route_declares_a_role(method, path, view):
    assert getattr(view, "required_role", None) in (VIEWER, OPERATOR, ADMIN), f"{method} {path} has no role check"


@pytest.mark.django_db
@pytest.mark.parametrize("name,path,view", PAGES, ids=[r[0] for r in PAGES])
def test_pages_refuse_the_role_below(name, path, view, request):
    role = view.required_role
    user = request.getfixturevalue(BELOW[role])
    client = Client()
    client.force_login(user)
    url = _concrete(path)
    for method in ("get", "post"):  # the role is checked first: whatever the method, 403
        response = getattr(client, method)(url)
        assert response.status_code == 403, f"{method.upper()} {url} as {user.username}: {response.status_code}"


@pytest.mark.django_db
@pytest.mark.parametrize("name,path,view", PAGES, ids=[r[0] for r in PAGES])
def test_pages_send_anonymous_to_login(name, path, view):
    response = Client().get(_concrete(path))
    assert response.status_code == 302 and response["Location"].startswith("/login/")


@pytest.mark.django_db
@pytest.mark.parametrize("method,path,view", API, ids=[f"{m} {p}" for m, p, _ in API])
def test_api_refuses_the_role_below(method, path, view, request, api_for):
    user = request.getfixturevalue(BELOW[view.required_role])
    client = api_for(user)
    url = _concrete(path)
    response = getattr(client, method.lower())(url) if method != "POST" else client.post(url, {})
    assert response.status_code == 403, (
        f"{method} {url} as {user.username}: {response.status_code} {response.content[:200]}"
    )


@pytest.mark.django_db
@pytest.mark.parametrize("method,path,view", API, ids=[f"{m} {p}" for m, p, _ in API])
def test_api_refuses_anonymous_and_bad_tokens(method, path, view):
    url = _concrete(path)
    client = Client()
    call = getattr(client, method.lower())
    assert call(url).status_code == 401
    assert call(url, headers={"Authorization": "Bearer lmc_not-a-real-token"}).status_code == 401


@pytest.mark.django_db
def test_revoked_and_expired_tokens_are_refused(viewer, api_for):
    from datetime import timedelta

    from django.utils import timezone

    from console.models import ApiToken

    client = api_for(viewer)
    assert client.get("/api/v1/models").status_code == 200
    token = ApiToken.objects.get(user=viewer)
    token.expires_at = timezone.now() - timedelta(seconds=1)
    token.save()
    assert client.get("/api/v1/models").status_code == 401
    token.expires_at = None
    token.revoked_at = timezone.now()
    token.save()
    assert client.get("/api/v1/models").status_code == 401


@pytest.mark.django_db
@pytest.mark.parametrize("name,path,view", PAGES, ids=[r[0] for r in PAGES])
def test_forms_enforce_csrf(name, path, view, admin):
    """Every POST needs the CSRF token, even from a logged-in Admin."""
    client = Client(enforce_csrf_checks=True)
    client.force_login(admin)
    response = client.post(_concrete(path), {"name": "x", "confirm": "x"})
    if response.status_code == 405:  # a page that takes no POST at all
        assert "POST" not in response["Allow"]
    else:
        assert response.status_code == 403 and b"security token" in response.content


@pytest.mark.django_db
def test_session_api_calls_need_csrf(admin, model_root):
    client = Client(enforce_csrf_checks=True)
    client.force_login(admin)
    response = client.post(
        "/api/v1/models", data={"name": "m", "path": str(model_root)}, content_type="application/json"
    )
    assert response.status_code == 403
    assert client.get("/api/v1/models").status_code == 200


@pytest.mark.django_db
def test_healthz_is_public_and_reports_dependencies(redis_conn):
    response = Client().get("/healthz")
    assert response.status_code == 200
    assert response.json() == {"status": "ok", "checks": {"database": "ok", "redis": "ok"}}


@pytest.mark.django_db
def test_openapi_schema_is_served(as_viewer):
    response = as_viewer.get("/api/v1/openapi.json")  # to a logged-in user (issue 19, finding 8)
    assert response.status_code == 200
    paths = response.json()["paths"]
    assert "/api/v1/models" in paths and "/api/v1/jobs/{job_id}/cancel" in paths
