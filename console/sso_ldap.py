"""The LDAP half of single sign-on (console/sso.py), by django-auth-ldap: in the backends only where LDAP_SERVER_URI
is set, so that python-ldap (requirements/sso-ldap.txt, built against libldap) is needed only there."""

from django_auth_ldap.backend import LDAPBackend

from console.models import ExternalIdentity
from console.services import sso_account, sso_login_sync


class ConsoleLDAPBackend(LDAPBackend):
    def authenticate(self, request, username=None, password=None, **kwargs):
        self.request = request  # Django makes a backend per authenticate() call: this is this login's
        return super().authenticate(request, username=username, password=password, **kwargs)

    def get_or_build_user(self, username, ldap_user):
        user = sso_account(provider=ExternalIdentity.LDAP, subject=username.lower(), username=username)
        if user is None:
            raise ldap_user.AuthenticationFailed(f"{username!r} is another account's name, or deactivated")
        return user, False

    def authenticate_ldap_user(self, ldap_user, password):
        user = super().authenticate_ldap_user(ldap_user, password)
        if user is None:
            return None
        groups = ldap_user.group_names
        if not sso_login_sync(user=user, provider=ExternalIdentity.LDAP, groups=groups, request=self.request):
            return None
        return user
