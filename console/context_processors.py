from django.conf import settings

from console.roles import ADMIN, OPERATOR, has_role, is_console_admin, user_role


def roles(request):
    user = getattr(request, "user", None)
    return {
        "role": user_role(user),
        "is_operator": has_role(user, OPERATOR) if user else False,
        "is_admin": has_role(user, ADMIN) if user else False,  # of the console, or of a team (its keys, deletes)
        "is_console_admin": is_console_admin(user) if user else False,  # users, node settings
    }


def sso(request):
    """What the login page offers: the OpenID Connect button, and whether the password may be a directory's."""
    return {
        "oidc_enabled": settings.OIDC_ENABLED,
        "oidc_login_label": settings.OIDC_LOGIN_LABEL,
        "ldap_enabled": settings.LDAP_ENABLED,
    }
