"""The console's own security findings of the outside probe (issue 19: 3, 4, 7, 8, 11, 12, 13):
login throttling and the password policy, private data files, the generated secret key,
the API docs, API token lifetimes, the Content-Security-Policy and the API's 401."""

import io
import json
import os
import re
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
from django.contrib.sessions.models import Session
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import Client
from django.utils import timezone

from console.models import ApiToken
from console.roles import OPERATOR
from endpoints.gateway.models import GatewayKey
from tests.support import ROOT
from tests.support.accounts import PASSWORD
from tests.support.pages import offsite_urls

# --- 3. Brute force and the password policy --------------------------------------------------


@pytest.mark.django_db
def test_thirty_wrong_passwords_lock_that_user_from_that_address(viewer):
    client = Client(REMOTE_ADDR="203.0.113.7")
    for _ in range(30):
        client.post("/login/", {"username": viewer.username, "password": "wrong guess"})
    refused = client.post("/login/", {"username": viewer.username, "password": PASSWORD})
    assert refused.status_code == 429 and b"too many login attempts" in refused.content
    assert client.get("/").status_code == 302  # not logged in
    # Another address is not locked out with it (the attacker cannot lock the owner out).
    owner = Client(REMOTE_ADDR="198.51.100.1")
    assert owner.post("/login/", {"username": viewer.username, "password": PASSWORD}).status_code == 302
    assert owner.get("/").status_code == 200


@pytest.mark.django_db
def test_behind_a_reverse_proxy_the_lockout_and_the_audit_log_see_the_clients_address(viewer, settings):
    """Every request comes from the proxy's address (REMOTE_ADDR): the client's is the one the proxy appends to
    X-Forwarded-For. Read from the header's right end, so an attacker's own entries (left of it) neither
    escape the lockout nor lock the owner out; the audit log records the same address."""
    from console.models import AuditEvent

    settings.TRUSTED_PROXIES = 1  # nginx in front (BEHIND_PROXY=true's default)
    proxy = "10.0.0.2"
    attacker = Client(REMOTE_ADDR=proxy, HTTP_X_FORWARDED_FOR="203.0.113.7")
    for i in range(30):  # each try claims another address of its own, left of what the proxy appended
        attacker.post(
            "/login/",
            {"username": viewer.username, "password": "wrong guess"},
            HTTP_X_FORWARDED_FOR=f"198.51.100.{i}, 203.0.113.7",
        )
    refused = attacker.post("/login/", {"username": viewer.username, "password": PASSWORD})
    assert refused.status_code == 429
    owner = Client(REMOTE_ADDR=proxy, HTTP_X_FORWARDED_FOR="192.0.2.44")  # through the same proxy
    assert owner.post("/login/", {"username": viewer.username, "password": PASSWORD}).status_code == 302
    login = AuditEvent.objects.filter(action="auth.login").latest("pk")
    assert login.source_ip == "192.0.2.44"


def test_the_client_address_is_the_entry_the_outermost_proxy_appended_whatever_the_client_wrote(settings):
    from console.audit import client_ip

    def seen(forwarded: str | None, remote: str = "10.0.0.2") -> str | None:
        meta = {"REMOTE_ADDR": remote} | ({"HTTP_X_FORWARDED_FOR": forwarded} if forwarded is not None else {})
        return client_ip(type("Request", (), {"META": meta}))

    settings.TRUSTED_PROXIES = 1
    assert seen("192.0.2.44") == "192.0.2.44"
    assert seen('9.9.9.9, ", 192.0.2.44') == "192.0.2.44"  # an unclosed quote of the client's swallows nothing
    assert seen("9.9.9.9, 10.1.2.3", remote="34.1.2.3") == "10.1.2.3"  # an intranet client behind a public proxy
    assert seen("[2001:db8::7]:51000") == "2001:db8::7" and seen("192.0.2.44:51000") == "192.0.2.44"
    assert seen(None) == "10.0.0.2" and seen("not an address") == "10.0.0.2"  # straight to the port; garbage
    settings.TRUSTED_PROXIES = 2  # a load balancer, then nginx: the entry the outer one appended
    assert seen("6.6.6.6, 192.0.2.44, 10.0.0.9") == "192.0.2.44"
    assert seen("10.0.0.9") == "10.0.0.2"  # fewer entries than proxies: not through them all
    settings.TRUSTED_PROXIES = 0  # none: the header is anybody's, REMOTE_ADDR only
    assert seen("6.6.6.6, 192.0.2.44, 10.0.0.9") == "10.0.0.2"


@pytest.mark.parametrize(
    "value, said", [("-1", "TRUSTED_PROXIES=-1 must be 0 or more"), ("one", "TRUSTED_PROXIES='one' is not an integer")]
)
def test_a_bad_trusted_proxies_count_stops_the_console_naming_it(tmp_path, value, said):
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "TRUSTED_PROXIES"))}
    done = subprocess.run(
        [sys.executable, "-c", "import django; django.setup()"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={
            **clean,
            "DJANGO_SETTINGS_MODULE": "console.settings",
            "DATA_DIR": str(tmp_path),
            "TRUSTED_PROXIES": value,
        },
    )
    assert done.returncode != 0 and said in done.stderr


@pytest.mark.django_db
def test_password_123_is_refused_with_a_message_everywhere(as_admin, admin, api_for, monkeypatch):
    page = as_admin.post("/users/create", {"username": "weak", "role": OPERATOR, "password": "123"}, follow=True)
    assert b"This password is too short" in page.content
    api = api_for(admin).post("/api/v1/users", {"username": "weak", "role": OPERATOR, "password": "123"})
    assert api.status_code == 400 and "too short" in api.json()["detail"]
    from django.contrib.auth import get_user_model

    assert not get_user_model().objects.filter(username="weak").exists()
    get_user_model().objects.all().delete()
    monkeypatch.setenv("CONSOLE_ADMIN_PASSWORD", "123")
    with pytest.raises(CommandError, match="CONSOLE_ADMIN_PASSWORD is refused: This password is too short"):
        call_command("ensure_admin", stdout=io.StringIO())
    assert not get_user_model().objects.exists()


# --- 4. Private data files; the gateway key is kept nowhere -------------------------------------


def _settings_in_subprocess(data_dir: Path, **env) -> dict:
    """Load console.settings as `make run` does (no SECRET_KEY), open the SQLite database,
    and say what the key is."""
    code = (
        "import django, json; django.setup(); from django.conf import settings; "
        "from django.db import connection; connection.ensure_connection(); "
        "print(json.dumps({'key': settings.SECRET_KEY, 'database': settings.DATABASES['default']['NAME'], "
        "'redis': settings.REDIS_URL}))"
    )
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SECRET_KEY", "DATABASE_URL", "DJANGO_"))}
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**clean, "DJANGO_SETTINGS_MODULE": "console.settings", "DATA_DIR": str(data_dir), **env},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def test_data_directory_and_database_are_private(tmp_path):
    data = tmp_path / "data"
    _settings_in_subprocess(data)
    assert _mode(data) == 0o700
    assert _mode(data / "console.sqlite3") == 0o600
    # An older install's readable directory and database are tightened.
    data.chmod(0o755)
    (data / "console.sqlite3").chmod(0o644)
    _settings_in_subprocess(data)
    assert _mode(data) == 0o700 and _mode(data / "console.sqlite3") == 0o600


@pytest.mark.django_db
def test_a_new_gateway_key_is_shown_once_and_stored_in_no_session(as_admin):
    page = as_admin.post("/gateway/keys/create", {"name": "web-app"})
    assert page.status_code == 200
    raw = page.content.decode().split('id="new-gateway-key">')[1].split("<")[0]
    assert raw.startswith(GatewayKey.objects.get(name="web-app").prefix)
    for session in Session.objects.all():
        assert raw not in session.session_data and raw not in json.dumps(session.get_decoded())
    assert raw not in as_admin.get("/gateway/").content.decode()


# --- 7. No published development key ---------------------------------------------------------


def test_without_secret_key_a_random_key_is_made_once_and_kept_private(tmp_path):
    data = tmp_path / "data"
    first = _settings_in_subprocess(data)["key"]
    key_file = data / "secret_key"
    assert key_file.read_text().strip() == first and _mode(key_file) == 0o600
    assert len(first) >= 50 and "insecure" not in first
    assert _settings_in_subprocess(data)["key"] == first  # kept across restarts
    assert _settings_in_subprocess(tmp_path / "other")["key"] != first  # random per install
    assert _settings_in_subprocess(data, SECRET_KEY="from-the-environment")["key"] == "from-the-environment"
    given = tmp_path / "given"
    given.write_text("from-a-file\n")
    assert _settings_in_subprocess(data, SECRET_KEY_FILE=str(given))["key"] == "from-a-file"


def test_database_and_redis_urls_may_come_from_files(tmp_path):
    """Docker and Kubernetes secrets hand the URLs (with their passwords) over as files (deploy/)."""
    database, redis_url = tmp_path / "database_url", tmp_path / "redis_url"
    database.write_text(f"sqlite:///{tmp_path / 'from-a-file.sqlite3'}\n")
    redis_url.write_text("redis://:secret@127.0.0.1:6379/3\n")
    loaded = _settings_in_subprocess(tmp_path / "data", DATABASE_URL_FILE=str(database), REDIS_URL_FILE=str(redis_url))
    assert loaded["database"] == str(tmp_path / "from-a-file.sqlite3")
    assert loaded["redis"] == "redis://:secret@127.0.0.1:6379/3"


# --- 8. API docs: local assets, login required ---------------------------------------------------


@pytest.mark.django_db
def test_api_docs_and_schema_need_a_login_and_load_nothing_from_elsewhere(as_viewer):
    anonymous = Client()
    for path in ("/api/v1/docs", "/api/v1/openapi.json"):
        assert anonymous.get(path).status_code in (302, 401), path
    page = as_viewer.get("/api/v1/docs")
    assert page.status_code == 200
    html = page.content.decode()
    assert "swagger-ui-bundle.js" in html
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", html), html
    assert as_viewer.get("/api/v1/openapi.json").json()["info"]["title"]


# --- 11. Command-line tokens expire ------------------------------------------------------------


@pytest.mark.django_db
def test_cli_tokens_expire_after_the_default_or_the_given_days(operator, settings):
    def make(*args):
        out = io.StringIO()
        call_command("create_api_token", operator.username, *args, stdout=out, stderr=io.StringIO())
        return ApiToken.objects.get(token_hash=ApiToken.objects.latest("id").token_hash)

    token = make("--name", "ci")
    assert settings.API_TOKEN_DEFAULT_DAYS == 90
    assert abs(token.expires_at - (timezone.now() + timedelta(days=90))) < timedelta(minutes=1)
    token = make("--name", "short", "--expires-in", "7")
    assert abs(token.expires_at - (timezone.now() + timedelta(days=7))) < timedelta(minutes=1)
    settings.API_TOKEN_DEFAULT_DAYS = 30
    token = make("--name", "setting")
    assert abs(token.expires_at - (timezone.now() + timedelta(days=30))) < timedelta(minutes=1)
    with pytest.raises(CommandError, match="between 1 and 3650"):
        make("--name", "never", "--expires-in", "0")


# --- 12. Content-Security-Policy -----------------------------------------------------------------


@pytest.mark.django_db
def test_pages_send_a_csp_that_allows_no_inline_script(as_viewer):
    for path in ("/", "/models/", "/login/"):
        policy = as_viewer.get(path, follow=True).headers["Content-Security-Policy"]
        directives = dict(d.strip().split(" ", 1) for d in policy.split(";") if d.strip())
        assert directives["script-src"] == "'self'", policy
        assert directives["default-src"] == "'self'" and directives["frame-ancestors"] == "'none'"


def test_templates_have_no_inline_script_nor_event_handler_attribute():
    """The CSP refuses them: code lives in static/*.js (data in json_script blocks)."""
    found = []
    for template in (ROOT / "templates").rglob("*.html"):
        text = template.read_text()
        for tag in re.findall(r"<script\b[^>]*>", text):
            if "src=" not in tag and "application/json" not in tag:
                found.append(f"{template}: {tag}")
        found += [f"{template}: {m}" for m in re.findall(r"""\son[a-z]+\s*=\s*["']""", text)]
        found += [f"{template}: {m}" for m in re.findall(r"hx-on[:\w-]*=|hx-trigger=\"[^\"]*\[|js:", text)]
    assert not found, "\n".join(found)


# --- 13. Anonymous API writes: 401, not a CSRF 403 -----------------------------------------------


@pytest.mark.django_db
def test_anonymous_api_post_is_401_in_json():
    client = Client(enforce_csrf_checks=True)
    for path in ("/api/v1/tokens", "/api/v1/models"):
        response = client.post(path, {"name": "x"}, content_type="application/json")
        assert response.status_code == 401, (path, response.content)
        assert "Authentication required" in response.json()["detail"]
    assert client.get("/api/v1/models").status_code == 401


def test_offsite_asset_check_reads_the_markup_not_the_text():
    """The pages' air-gap checks use offsite_urls: a CSRF token that spells "cdn" failed one once."""
    page = (
        '<input type="hidden" name="csrfmiddlewaretoken" value="x9cdnq"><a href="https://docs.example/">docs</a>'
        '<script src="/static/plotly/plotly.min.js"></script><link rel="stylesheet" href="/static/app.css">'
    )
    assert offsite_urls(page) == []
    assert offsite_urls(
        page + '<script src="https://cdn.plot.ly/plotly.min.js"></script><img src="//img.example/a.png">'
    ) == ["https://cdn.plot.ly/plotly.min.js", "//img.example/a.png"]
