from django.contrib.auth.signals import user_logged_in, user_logged_out, user_login_failed
from django.dispatch import receiver

from console.audit import audit_log


@receiver(user_logged_in)
def _logged_in(sender, request, user, **kwargs):
    audit_log(actor=user, action="auth.login", obj=user, request=request, via="web")


@receiver(user_logged_out)
def _logged_out(sender, request, user, **kwargs):
    if user is not None:
        audit_log(actor=user, action="auth.logout", obj=user, request=request, via="web")


@receiver(user_login_failed)
def _login_failed(sender, credentials, request=None, **kwargs):
    audit_log(
        action="auth.login_failed",
        request=request,
        via="web",
        changes={"username": str(credentials.get("username", ""))[:150]},
    )
