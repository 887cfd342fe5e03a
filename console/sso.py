"""Single sign-on, each half on when configured (console/settings.py; docs/sso-and-teams.md):

- OpenID Connect by mozilla-django-oidc: the authorization code flow with PKCE (S256) and a nonce, the ID token's
  signature checked against the provider's JWKS, the user's claims from its userinfo endpoint;
- LDAP by django-auth-ldap: a bind as the user, their groups searched in the directory.

Both end in the same two services: `sso_account` (the account of that provider's subject, never a local one of the
same name) and `sso_login_sync` (the groups decide the role at every login; none: refused, API tokens revoked)."""

import logging
from urllib.parse import urlencode

from django.conf import settings
from mozilla_django_oidc.auth import OIDCAuthenticationBackend

from console.models import ExternalIdentity
from console.services import sso_account, sso_login_sync

log = logging.getLogger(__name__)


def claim_groups(value) -> list[str]:
    """A groups claim as a list of names: providers send a list, some a single string."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)):
        return [str(item) for item in value]
    return []


class ConsoleOIDCBackend(OIDCAuthenticationBackend):
    def get_or_create_user(self, access_token, id_token, payload):
        claims = self.get_userinfo(access_token, id_token, payload)
        subject = claims.get("sub")
        # OpenID Connect Core 1.0 §5.3.2: the userinfo `sub` must be the ID token's, or the answer is not used.
        if not subject or subject != payload.get("sub"):
            log.warning("OIDC login refused: the userinfo subject differs from the ID token's")
            return None
        user = sso_account(
            provider=ExternalIdentity.OIDC,
            subject=str(subject),
            username=str(claims.get(settings.OIDC_USERNAME_CLAIM) or ""),
            email=str(claims.get("email") or ""),
        )
        if user is None:
            log.warning("OIDC login refused for subject %s: no account, or its name is another account's", subject)
            return None
        groups = claim_groups(claims.get(settings.OIDC_GROUPS_CLAIM))
        if not sso_login_sync(user=user, provider=ExternalIdentity.OIDC, groups=groups, request=self.request):
            return None
        return user


def oidc_logout_url(request) -> str:
    """OIDC_OP_LOGOUT_URL_METHOD: RP-initiated logout (OpenID Connect RP-Initiated Logout 1.0 §2) at the provider's
    end_session_endpoint with the ID token as hint, back to the console's login page; without an end-session
    endpoint configured, only the console's session ends."""
    login_url = request.build_absolute_uri(settings.LOGIN_URL_PATH)
    id_token = request.session.get("oidc_id_token")
    if not settings.OIDC_OP_LOGOUT_ENDPOINT or not id_token:
        return login_url
    query = {"id_token_hint": id_token, "post_logout_redirect_uri": login_url, "client_id": settings.OIDC_RP_CLIENT_ID}
    return f"{settings.OIDC_OP_LOGOUT_ENDPOINT}?{urlencode(query)}"
