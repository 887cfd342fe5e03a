"""Accounts, roles, API tokens and the audit log."""

import io
from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import Client
from django.utils import timezone

from console.models import ApiToken, AuditEvent, hash_token
from console.roles import ADMIN, OPERATOR, VIEWER, user_role
from tests.support.accounts import PASSWORD


@pytest.mark.django_db
def test_login_page_login_and_logout_are_audited(viewer):
    client = Client(enforce_csrf_checks=False)
    assert client.get("/").status_code == 302
    page = client.get("/login/")
    assert page.status_code == 200 and b"Log in" in page.content
    bad = client.post("/login/", {"username": viewer.username, "password": "wrong"})
    assert bad.status_code == 200 and b"didn't match" in bad.content
    ok = client.post("/login/", {"username": viewer.username, "password": PASSWORD})
    assert ok.status_code == 302
    assert client.get("/").status_code == 200
    client.post("/logout/")
    assert client.get("/").status_code == 302
    actions = list(AuditEvent.objects.order_by("id").values_list("action", flat=True))
    assert actions == ["auth.login_failed", "auth.login", "auth.logout"]


@pytest.mark.django_db
def test_create_api_token_command_prints_token_last_and_stores_hash(operator, api_for):
    out = io.StringIO()
    call_command("create_api_token", operator.username, "--name", "ci", stdout=out, stderr=io.StringIO())
    raw = out.getvalue().strip().splitlines()[-1]
    assert raw.startswith("lmc_")
    token = ApiToken.objects.get(user=operator, name="ci")
    assert token.token_hash == hash_token(raw) and raw not in token.token_hash
    response = Client().get("/api/v1/models", headers={"Authorization": f"Bearer {raw}"})
    assert response.status_code == 200
    with pytest.raises(CommandError, match="No user"):
        call_command("create_api_token", "ghost")


@pytest.mark.django_db
def test_tokens_page_creates_shows_once_and_revokes(as_viewer, viewer):
    page = as_viewer.post("/tokens/create", {"name": "grafana", "expires_days": "30"})
    assert page.status_code == 200
    raw = page.content.decode().split('id="new-token">')[1].split("<")[0]
    assert Client().get("/api/v1/models", headers={"Authorization": f"Bearer {raw}"}).status_code == 200
    assert raw not in as_viewer.get("/tokens/").content.decode()
    token = ApiToken.objects.get(name="grafana")
    as_viewer.post(f"/tokens/{token.pk}/revoke")
    assert Client().get("/api/v1/models", headers={"Authorization": f"Bearer {raw}"}).status_code == 401
    bad = as_viewer.post("/tokens/create", {"name": "x", "expires_days": "-3"}, follow=True)
    assert b"between 1 and 3650" in bad.content
    actions = AuditEvent.objects.filter(action__startswith="api_token").order_by("id").values_list("action", flat=True)
    assert list(actions) == ["api_token.create", "api_token.revoke"]


@pytest.mark.django_db
def test_users_cannot_revoke_tokens_of_others(as_viewer, operator):
    other = ApiToken.objects.create(user=operator, name="x", prefix="lmc_x", token_hash="0" * 64)
    assert as_viewer.post(f"/tokens/{other.pk}/revoke").status_code == 404
    other.refresh_from_db()
    assert other.revoked_at is None


@pytest.mark.django_db
def test_admin_manages_users_and_roles(as_admin, admin):
    as_admin.post("/users/create", {"username": "newop", "role": OPERATOR, "password": "a long enough password 77"})
    user = get_user_model().objects.get(username="newop")
    assert user_role(user) == OPERATOR
    as_admin.post(f"/users/{user.pk}/update", {"role": VIEWER, "active": "false"})
    user = get_user_model().objects.get(pk=user.pk)
    assert list(user.groups.values_list("name", flat=True)) == [VIEWER] and not user.is_active
    assert user_role(user) is None  # an inactive user holds no role at all
    # Guard rails: no self-demotion, no bad role, no duplicate.
    demote = as_admin.post(f"/users/{admin.pk}/update", {"role": VIEWER, "active": "true"}, follow=True)
    assert b"cannot remove your own Admin role" in demote.content and user_role(admin) == ADMIN
    # An active flag that is neither true nor false is refused naming the field; the user stays as they were.
    maybe = as_admin.post(f"/users/{user.pk}/update", {"role": OPERATOR, "active": "maybe"}, follow=True)
    assert b"active must be true or false" in maybe.content
    user.refresh_from_db()
    assert (
        user_role(user) is None and not user.is_active and list(user.groups.values_list("name", flat=True)) == [VIEWER]
    )
    bad = as_admin.post("/users/create", {"username": "x", "role": "Root"}, follow=True)
    assert b"Choose a role" in bad.content
    dup = as_admin.post("/users/create", {"username": "NEWOP", "role": VIEWER}, follow=True)
    assert b"already exists" in dup.content
    events = AuditEvent.objects.filter(action__startswith="user.").values_list("action", "changes")
    assert ("user.create", {"role": OPERATOR}) in list(events)
    assert any(a == "user.update" and c.get("role") == [OPERATOR, VIEWER] for a, c in events)


@pytest.mark.django_db
def test_ensure_admin_creates_the_first_admin_once(monkeypatch):
    monkeypatch.setenv("CONSOLE_ADMIN_PASSWORD", "first admin password 123")
    call_command("ensure_admin", stdout=io.StringIO())
    admin = get_user_model().objects.get(username="admin")
    assert user_role(admin) == ADMIN and admin.check_password("first admin password 123")
    out = io.StringIO()
    call_command("ensure_admin", stdout=out)
    assert "exist already" in out.getvalue() and get_user_model().objects.count() == 1


@pytest.mark.django_db
def test_ensure_admin_generates_a_password_into_a_file(monkeypatch, settings, tmp_path):
    """Not printed (issue 39): tests/console/test_admin_password.py checks the file's mode and the output."""
    monkeypatch.delenv("CONSOLE_ADMIN_PASSWORD", raising=False)
    monkeypatch.delenv("CONSOLE_ADMIN_PASSWORD_FILE", raising=False)
    settings.DATA_DIR = tmp_path
    call_command("ensure_admin", stdout=io.StringIO())
    password = (tmp_path / "initial_admin_password").read_text().strip()
    assert get_user_model().objects.get(username="admin").check_password(password)


@pytest.mark.django_db
def test_audit_page_lists_and_filters(as_viewer, viewer, operator):
    from console.audit import audit_log

    audit_log(actor=operator, action="model.register", changes={"path": "/x"})
    audit_log(actor=viewer, action="api_token.create")
    page = as_viewer.get("/audit/?action=model.")
    assert b"model.register" in page.content and b"api_token.create" not in page.content.split(b'id="audit-table"')[1]
    page = as_viewer.get(f"/audit/?actor={viewer.username}")
    body = page.content.split(b'id="audit-table"')[1]
    assert b"api_token.create" in body and b"model.register" not in body


@pytest.mark.django_db
def test_outsider_without_role_sees_nothing(outsider):
    client = Client()
    client.force_login(outsider)
    assert client.get("/").status_code == 403
    assert client.get("/models/").status_code == 403


def test_secrets_come_from_files(tmp_path, monkeypatch):
    from console.env import env_secret

    secret = tmp_path / "key"
    secret.write_text("from-a-file\n")
    monkeypatch.setenv("SOME_SECRET_FILE", str(secret))
    assert env_secret("SOME_SECRET") == "from-a-file"


def test_deploy_check_is_clean_with_production_settings(tmp_path):
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    env.update(
        {
            "DJANGO_SETTINGS_MODULE": "console.settings",
            "SECRET_KEY": "p" * 60 + "Zq9!x",
            "HTTPS": "true",
            "SECURE_SSL_REDIRECT": "true",
            "SECURE_HSTS_SECONDS": "31536000",
            "DATA_DIR": str(tmp_path),
        }
    )
    result = subprocess.run(
        [sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.django_db
def test_accounts_over_the_api(admin, viewer, api_for):
    api = api_for(admin)
    created = api.post("/api/v1/users", {"username": "bot-op", "role": OPERATOR})
    assert created.status_code == 201 and created.json()["role"] == OPERATOR and created.json()["password"]
    user_id = created.json()["id"]
    assert api.post(f"/api/v1/users/{user_id}", {"role": VIEWER}).json()["role"] == VIEWER
    assert {u["username"] for u in api.get("/api/v1/users").json()} >= {"bot-op", admin.username}
    mine = api_for(viewer)
    token = mine.post("/api/v1/tokens", {"name": "ci", "expires_days": 7})
    assert token.status_code == 201 and token.json()["token"].startswith("lmc_")
    assert (
        Client().get("/api/v1/models", headers={"Authorization": f"Bearer {token.json()['token']}"}).status_code == 200
    )
    assert mine.post(f"/api/v1/tokens/{token.json()['id']}/revoke").json()["active"] is False
    assert (
        Client().get("/api/v1/models", headers={"Authorization": f"Bearer {token.json()['token']}"}).status_code == 401
    )
    lasting = mine.post("/api/v1/tokens", {"name": "no expiry given"})  # the default lifetime, not for ever
    expires = ApiToken.objects.get(pk=lasting.json()["id"]).expires_at
    assert lasting.status_code == 201 and abs((expires - timezone.now()) - timedelta(days=90)) < timedelta(minutes=1)
    bad = api.post("/api/v1/users", {"username": "x", "role": "Root"})
    assert bad.status_code == 400 and "Choose a role" in bad.json()["detail"]
    audit = api.get("/api/v1/audit?action=user.").json()
    assert [e["action"] for e in audit] == ["user.update", "user.create"] and audit[0]["via"] == "api"


@pytest.mark.django_db(transaction=True)
def test_a_user_created_twice_at_the_same_moment_is_a_field_error_not_a_500(admin, api_for, monkeypatch):
    """The name check and the insert are two steps: another request can commit the same name between them.
    The unique index then refuses the insert, and the refusal names the field."""
    from console import services

    def the_other_request_commits_meanwhile(password, user):  # runs between the name check and the insert
        get_user_model().objects.create(username="twin")

    monkeypatch.setattr(services, "validate_password", the_other_request_commits_meanwhile)
    twice = api_for(admin).post("/api/v1/users", {"username": "twin", "role": VIEWER})
    assert twice.status_code == 400 and twice.json()["errors"] == {"username": ["A user named 'twin' already exists."]}
    assert get_user_model().objects.filter(username="twin").count() == 1
    assert not AuditEvent.objects.filter(action="user.create").exists()


@pytest.mark.django_db
def test_a_token_made_with_a_token_cannot_outlive_it(viewer, as_viewer):
    """A leaked short-lived token must not be turned into a long-lived one; a browser session is not capped."""
    from console.services import api_token_create

    short, raw = api_token_create(user=viewer, name="two days", expires_days=2)
    bearer = Client(headers={"Authorization": f"Bearer {raw}"})
    longer = bearer.post("/api/v1/tokens", {"name": "longer", "expires_days": 30}, content_type="application/json")
    assert longer.status_code == 400 and list(longer.json()["errors"]) == ["expires_days"], longer.content
    assert "cannot outlive it" in longer.json()["detail"] and not ApiToken.objects.filter(name="longer").exists()
    default = bearer.post("/api/v1/tokens", {"name": "default"}, content_type="application/json")
    assert default.status_code == 201 and ApiToken.objects.get(pk=default.json()["id"]).expires_at == short.expires_at
    shorter = bearer.post("/api/v1/tokens", {"name": "one day", "expires_days": 1}, content_type="application/json")
    assert shorter.status_code == 201
    assert as_viewer.post("/tokens/create", {"name": "session", "expires_days": "30"}).status_code == 200
    assert ApiToken.objects.get(name="session").expires_at - short.expires_at > timedelta(days=27)
