"""OpenID Connect single sign-on (console/sso.py, mozilla-django-oidc) against a real OpenID provider started by the
test (panva's oidc-provider 9 under node, tests/support/oidc.py), the whole login driven in Chromium: the console's
button, the provider's own sign-in page, the code flow with PKCE back to the console; the provider's groups give the
role; logout ends the console session and the provider's (RP-initiated logout); someone taken out of the group is
refused at their next login and their API tokens are revoked; local accounts keep working beside it."""

import copy
import json
import os
import subprocess
import sys
from urllib.parse import parse_qs, urlparse

import pytest
from django.test import Client

from console.models import ApiToken, AuditEvent, ExternalIdentity
from console.roles import ADMIN, OPERATOR, VIEWER, user_role
from console.services import api_token_create
from tests.support import ROOT
from tests.support.accounts import PASSWORD, make_user
from tests.support.browser import browser, login, page  # noqa: F401 (fixtures)
from tests.support.oidc import PEOPLE, openid_provider  # noqa: F401 (fixture)

pytestmark = pytest.mark.browser
GROUP_ROLES = {"console-admins": ADMIN, "ml-ops": OPERATOR, "ml-staff": VIEWER}


@pytest.fixture
def oidc_login(settings, openid_provider):  # noqa: F811
    """The settings console/settings.py makes of the provider's variables (test_settings_from_the_environment)."""
    for name, value in openid_provider.console_env().items():
        setattr(settings, name, value)
    settings.OIDC_ENABLED = True
    settings.AUTHENTICATION_BACKENDS = [*settings.AUTHENTICATION_BACKENDS, "console.sso.ConsoleOIDCBackend"]
    settings.SSO_GROUP_ROLES = GROUP_ROLES
    policy = copy.deepcopy(settings.CONTENT_SECURITY_POLICY)
    policy["DIRECTIVES"]["form-action"].append(openid_provider.issuer)
    settings.CONTENT_SECURITY_POLICY = policy
    yield openid_provider
    openid_provider.users_file.write_text(json.dumps(PEOPLE))


def role_of(user) -> str | None:
    return user_role(type(user).objects.get(pk=user.pk))


def sso_login(page, username, password=PASSWORD):  # noqa: F811
    """The console's button, then the provider's sign-in page, as a person would. Returns the authorization
    request's query (what the console sent the provider)."""
    page.goto("/login/")
    with page.expect_request(lambda r: "/auth?" in r.url) as authorization:
        page.click("#sso-login")
    page.wait_for_selector("input[name=login]")
    page.fill("input[name=login]", username)
    page.fill("input[name=password]", password)
    page.click("button[type=submit]")
    page.wait_for_load_state("load")
    return parse_qs(urlparse(authorization.value.url).query)


def test_settings_from_the_environment(openid_provider):  # noqa: F811
    """console/settings.py, loaded in a fresh process with the operator's variables, turns OIDC on as the fixture
    above does, with PKCE (S256) and RP-initiated logout; an endpoint left out is named at start."""
    probe = (
        "import django, json; django.setup(); from django.conf import settings as s; "
        "print(json.dumps([s.OIDC_ENABLED, s.AUTHENTICATION_BACKENDS[-1], s.OIDC_USE_PKCE, "
        "s.OIDC_PKCE_CODE_CHALLENGE_METHOD, s.OIDC_OP_LOGOUT_URL_METHOD, s.OIDC_OP_JWKS_ENDPOINT, s.OIDC_RP_SIGN_ALGO, "
        "s.CONTENT_SECURITY_POLICY['DIRECTIVES']['form-action']]))"
    )
    env = {**os.environ, **openid_provider.console_env(), "DJANGO_SETTINGS_MODULE": "console.settings"}
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [
        True,
        "console.sso.ConsoleOIDCBackend",
        True,
        "S256",
        "console.sso.oidc_logout_url",
        openid_provider.metadata["jwks_uri"],
        "RS256",
        ["'self'", openid_provider.issuer],
    ]
    env["OIDC_OP_TOKEN_ENDPOINT"] = ""
    out = subprocess.run(
        [sys.executable, "-c", "import django; django.setup()"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode != 0 and "set OIDC_OP_TOKEN_ENDPOINT too" in out.stderr


@pytest.mark.django_db(transaction=True)
def test_login_with_pkce_gives_the_role_and_logout_ends_both_sessions(page, oidc_login):  # noqa: F811
    query = sso_login(page, "erin")
    assert query["code_challenge_method"] == ["S256"] and len(query["code_challenge"][0]) == 43  # SHA-256, base64url
    assert query["response_type"] == ["code"] and "nonce" in query
    page.wait_for_selector("header.topbar")
    assert urlparse(page.url).path == "/" and "erin" in page.inner_text("header.topbar .who")
    identity = ExternalIdentity.objects.get(provider="oidc", subject="erin")
    assert role_of(identity.user) == OPERATOR and identity.groups == ["everyone", "ml-ops"]
    assert identity.user.email == "erin@idp.test" and not identity.user.has_usable_password()
    assert AuditEvent.objects.filter(action="auth.login", actor=identity.user).exists()
    assert page.goto("/endpoints/").ok  # an Operator's page

    # Log out: the console's session ends, then the provider's (its own confirmation page), back to the login page.
    page.click("header.topbar button:has-text('Log out')")
    page.wait_for_url(lambda url: url.startswith(oidc_login.issuer))
    page.click("button[name=logout]")
    page.wait_for_url(lambda url: urlparse(url).path == "/login/")
    page.goto("/endpoints/")
    assert urlparse(page.url).path == "/login/"  # no console session
    page.click("#sso-login")
    page.wait_for_selector("input[name=login]")  # and none at the provider: it asks for the password again


@pytest.mark.django_db(transaction=True)
def test_removed_from_the_group_is_refused_and_tokens_revoked(page, oidc_login):  # noqa: F811
    sso_login(page, "erin")
    page.wait_for_selector("header.topbar")
    erin = ExternalIdentity.objects.get(subject="erin").user
    _, raw = api_token_create(user=erin, name="erin's notebook")
    assert Client().get("/api/v1/models", HTTP_AUTHORIZATION=f"Bearer {raw}").status_code == 200
    page.context.clear_cookies()  # a new browser session, at both ends

    oidc_login.set_groups("erin", ["everyone"])
    sso_login(page, "erin")
    page.wait_for_url(lambda url: urlparse(url).path == "/login/")
    assert "no role in this console" in page.get_by_role("alert").inner_text()
    assert role_of(erin) is None
    assert not ApiToken.objects.active().filter(user=erin).exists()
    assert Client().get("/api/v1/models", HTTP_AUTHORIZATION=f"Bearer {raw}").status_code == 401
    sync = AuditEvent.objects.filter(action="user.sso_sync", object_id=str(erin.pk)).first()
    assert sync.via == "oidc" and sync.changes["role"] == [OPERATOR, None] and sync.changes["api_tokens_revoked"] == 1


@pytest.mark.django_db(transaction=True)
def test_unmapped_groups_are_refused_and_local_accounts_keep_working(page, oidc_login, admin):  # noqa: F811
    sso_login(page, "frank")
    page.wait_for_url(lambda url: urlparse(url).path == "/login/")
    assert "no role in this console" in page.get_by_role("alert").inner_text()
    assert role_of(ExternalIdentity.objects.get(subject="frank").user) is None
    page.context.clear_cookies()
    login(page, admin)  # the password form, beside the provider's button
    assert role_of(admin) == ADMIN and not ExternalIdentity.objects.filter(user=admin).exists()


@pytest.mark.django_db(transaction=True)
def test_the_provider_cannot_take_over_a_local_account(page, oidc_login):  # noqa: F811
    local = make_user("erin", VIEWER)  # a local account named like the provider's erin
    sso_login(page, "erin")
    page.wait_for_url(lambda url: urlparse(url).path == "/login/")
    assert not ExternalIdentity.objects.exists() and role_of(local) == VIEWER
