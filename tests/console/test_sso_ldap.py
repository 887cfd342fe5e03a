"""LDAP single sign-on (console/sso_ldap.py, django-auth-ldap) against a real OpenLDAP slapd started by the test
(tests/support/slapd.py, the directory in tests/fixtures/sso/directory.ldif): the directory's groups give the
console role at each login, a person without a mapped group is refused, one removed from their group loses access
at their next login and their API tokens are revoked, local accounts keep working, and a directory user never takes
over a local account of the same name."""

import json
import os
import subprocess
import sys

import ldap
import pytest
from django.test import Client
from django_auth_ldap.config import GroupOfNamesType, LDAPSearch

from console.models import ApiToken, AuditEvent, ExternalIdentity, TeamMembership
from console.roles import ADMIN, OPERATOR, VIEWER, user_role
from console.services import api_token_create
from tests.support import ROOT
from tests.support.accounts import PASSWORD, make_user
from tests.support.slapd import slapd  # noqa: F401 (fixture)

GROUP_ROLES = {"console-admins": ADMIN, "ml-ops": OPERATOR, "ml-staff": VIEWER}


def ldap_env(server) -> dict[str, str]:
    """The environment an operator sets (docs/sso-and-teams.md) for this directory."""
    return {
        "LDAP_SERVER_URI": server.uri,
        "LDAP_USER_SEARCH_BASE": f"ou=people,{server.suffix}",
        "LDAP_GROUP_SEARCH_BASE": f"ou=groups,{server.suffix}",
        "SSO_GROUP_ROLES": ",".join(f"{group}={role}" for group, role in GROUP_ROLES.items()),
    }


@pytest.fixture
def ldap_login(settings, slapd):  # noqa: F811
    """The settings console/settings.py makes of ldap_env (test_settings_from_the_environment checks they agree)."""
    settings.AUTH_LDAP_SERVER_URI = slapd.uri
    settings.AUTH_LDAP_USER_SEARCH = LDAPSearch(f"ou=people,{slapd.suffix}", ldap.SCOPE_SUBTREE, "(uid=%(user)s)")
    settings.AUTH_LDAP_GROUP_SEARCH = LDAPSearch(
        f"ou=groups,{slapd.suffix}", ldap.SCOPE_SUBTREE, "(objectClass=groupOfNames)"
    )
    settings.AUTH_LDAP_GROUP_TYPE = GroupOfNamesType()
    settings.AUTH_LDAP_MIRROR_GROUPS = False
    settings.AUTH_LDAP_CACHE_TIMEOUT = 0
    settings.AUTH_LDAP_USER_ATTR_MAP = {"first_name": "givenName", "last_name": "sn", "email": "mail"}
    settings.AUTHENTICATION_BACKENDS = [*settings.AUTHENTICATION_BACKENDS, "console.sso_ldap.ConsoleLDAPBackend"]
    settings.LDAP_ENABLED = True
    settings.SSO_GROUP_ROLES = GROUP_ROLES
    return slapd


def role_of(user) -> str | None:
    """The role as the database has it now (user_role caches it on the instance)."""
    return user_role(type(user).objects.get(pk=user.pk))


def log_in(username, password=PASSWORD):
    client = Client()
    response = client.post("/login/", {"username": username, "password": password})
    return client, response


def test_settings_from_the_environment(slapd):  # noqa: F811
    """console/settings.py, loaded in a fresh process with the operator's variables, turns LDAP on as the
    fixture above does."""
    probe = (
        "import django, json; django.setup(); from django.conf import settings as s; "
        "print(json.dumps([s.LDAP_ENABLED, s.AUTH_LDAP_SERVER_URI, s.AUTH_LDAP_USER_SEARCH.base_dn, "
        "s.AUTH_LDAP_USER_SEARCH.filterstr, s.AUTH_LDAP_GROUP_SEARCH.base_dn, type(s.AUTH_LDAP_GROUP_TYPE).__name__, "
        "s.AUTHENTICATION_BACKENDS[-1], s.SSO_GROUP_ROLES, s.AUTH_LDAP_MIRROR_GROUPS]))"
    )
    env = {**os.environ, **ldap_env(slapd), "DJANGO_SETTINGS_MODULE": "console.settings"}
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [
        True,
        slapd.uri,
        f"ou=people,{slapd.suffix}",
        "(uid=%(user)s)",
        f"ou=groups,{slapd.suffix}",
        "GroupOfNamesType",
        "console.sso_ldap.ConsoleLDAPBackend",
        GROUP_ROLES,
        False,
    ]


def test_a_bad_group_type_or_role_is_refused_at_start(slapd):  # noqa: F811
    for extra, message in (
        ({"LDAP_GROUP_TYPE": "groupOfPeople"}, "LDAP_GROUP_TYPE='groupOfPeople'"),
        ({"SSO_GROUP_ROLES": "ml-ops=Boss"}, "SSO_GROUP_ROLES: ml-ops=Boss"),
        ({"SSO_GROUP_TEAMS": "ml-ops=research"}, "SSO_GROUP_TEAMS: ml-ops=research"),
        ({"LDAP_GROUP_SEARCH_BASE": ""}, "set LDAP_GROUP_SEARCH_BASE too"),
    ):
        env = {**os.environ, **ldap_env(slapd), **extra, "DJANGO_SETTINGS_MODULE": "console.settings"}
        out = subprocess.run(
            [sys.executable, "-c", "import django; django.setup()"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        assert out.returncode != 0 and message in out.stderr, out.stderr[-2000:]


@pytest.mark.django_db
def test_directory_groups_give_the_console_role(ldap_login):
    client, response = log_in("bob")
    assert response.status_code == 302 and response.url == "/", response.content[:500]
    assert client.get("/").status_code == 200
    identity = ExternalIdentity.objects.get(provider="ldap", subject="bob")
    bob = identity.user
    assert user_role(bob) == OPERATOR  # ml-ops and ml-staff: the higher wins
    assert identity.groups == ["ml-ops", "ml-staff"]
    assert (bob.email, bob.first_name, bob.last_name) == ("bob@console.test", "Bob", "Operator")
    assert not bob.has_usable_password()  # the directory's password is never kept
    sync = AuditEvent.objects.get(action="user.sso_sync", object_id=str(bob.pk))
    assert sync.via == "ldap" and sync.changes["role"] == [None, OPERATOR]
    client, _ = log_in("alice")
    assert user_role(ExternalIdentity.objects.get(subject="alice").user) == ADMIN


@pytest.mark.django_db
def test_wrong_password_and_unmapped_groups_are_refused(ldap_login):
    _, response = log_in("bob", "not bob's password")
    assert response.status_code == 200 and b"didn't match" in response.content
    assert not ExternalIdentity.objects.filter(subject="bob").exists()
    # carol is in the directory, in no group the console maps: no role, no session.
    client, response = log_in("carol")
    assert response.status_code == 200 and b"didn't match" in response.content
    assert client.get("/").status_code == 302
    carol = ExternalIdentity.objects.get(subject="carol").user
    assert user_role(carol) is None


@pytest.mark.django_db
def test_removed_from_the_group_loses_access_and_tokens_at_next_login(ldap_login):
    _, response = log_in("dave")
    assert response.status_code == 302
    dave = ExternalIdentity.objects.get(subject="dave").user
    assert user_role(dave) == VIEWER
    _, raw = api_token_create(user=dave, name="dave's script")
    assert Client().get("/api/v1/models", HTTP_AUTHORIZATION=f"Bearer {raw}").status_code == 200

    ldap_login.modify(
        f"cn=ml-staff,ou=groups,{ldap_login.suffix}",
        [(ldap.MOD_DELETE, "member", [f"uid=dave,ou=people,{ldap_login.suffix}".encode()])],
    )
    _, response = log_in("dave")
    assert response.status_code == 200 and b"didn't match" in response.content
    assert role_of(dave) is None
    assert not ApiToken.objects.active().filter(user=dave).exists()
    assert Client().get("/api/v1/models", HTTP_AUTHORIZATION=f"Bearer {raw}").status_code == 401
    sync = AuditEvent.objects.filter(action="user.sso_sync", object_id=str(dave.pk)).first()
    assert sync.changes["role"] == [VIEWER, None] and sync.changes["api_tokens_revoked"] == 1

    ldap_login.modify(  # back in the group: the role comes back at the next login (tokens stay revoked)
        f"cn=ml-staff,ou=groups,{ldap_login.suffix}",
        [(ldap.MOD_ADD, "member", [f"uid=dave,ou=people,{ldap_login.suffix}".encode()])],
    )
    _, response = log_in("dave")
    assert response.status_code == 302 and role_of(dave) == VIEWER


@pytest.mark.django_db
def test_local_accounts_keep_working_and_are_never_taken_over(ldap_login):
    admin = make_user("admin", ADMIN)
    # The directory has an "admin" in console-admins with the same password: the local account logs in by its own
    # password (ModelBackend first), and the directory's user is not let into it with another password.
    _, response = log_in("admin")
    assert response.status_code == 302
    assert not ExternalIdentity.objects.filter(user=admin).exists()
    admin.set_password("the local admin's own password 1")
    admin.save()
    _, response = log_in("admin")  # the directory's password: refused, the local account is not the directory's
    assert response.status_code == 200
    assert not ExternalIdentity.objects.exists()
    _, response = log_in("admin", "the local admin's own password 1")
    assert response.status_code == 302


@pytest.mark.django_db
def test_a_deactivated_directory_account_stays_out(ldap_login):
    log_in("bob")
    bob = ExternalIdentity.objects.get(subject="bob").user
    bob.is_active = False
    bob.save()
    client, response = log_in("bob")
    assert response.status_code == 200
    assert client.get("/").status_code == 302


@pytest.mark.django_db
def test_directory_groups_give_teams(ldap_login, settings):
    """SSO_GROUP_TEAMS: carol's only group gives her a team role and no console role: she logs in and sees her
    team; out of the group, her team membership goes at her next login, and she is refused."""
    settings.SSO_GROUP_TEAMS = {"unrelated": ("research", VIEWER), "ml-ops": ("research", OPERATOR)}
    client, response = log_in("carol")
    assert response.status_code == 302
    carol = ExternalIdentity.objects.get(subject="carol").user
    assert list(TeamMembership.objects.filter(user=carol).values_list("team__slug", "role")) == [("research", VIEWER)]
    assert role_of(carol) == VIEWER and client.get("/api/v1/teams").json()[0]["slug"] == "research"
    _, response = log_in("bob")  # ml-ops: Operator of research too, beside his console role
    bob = ExternalIdentity.objects.get(subject="bob").user
    assert TeamMembership.objects.get(user=bob, team__slug="research").role == OPERATOR

    ldap_login.modify(
        f"cn=unrelated,ou=groups,{ldap_login.suffix}",
        [(ldap.MOD_DELETE, "member", [f"uid=carol,ou=people,{ldap_login.suffix}".encode()])],
    )
    _, response = log_in("carol")
    assert response.status_code == 200
    assert not TeamMembership.objects.filter(user=carol).exists() and role_of(carol) is None
    sync = AuditEvent.objects.filter(action="user.sso_sync", object_id=str(carol.pk)).first()
    assert sync.changes["teams"] == {"research": [VIEWER, None]}
    ldap_login.modify(
        f"cn=unrelated,ou=groups,{ldap_login.suffix}",
        [(ldap.MOD_ADD, "member", [f"uid=carol,ou=people,{ldap_login.suffix}".encode()])],
    )
