import hashlib
import secrets

from django.conf import settings
from django.db import models
from django.utils import timezone


class AuditEvent(models.Model):
    """One state change: who did what to which object, from where."""

    created_at = models.DateTimeField(default=timezone.now, db_index=True)
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    # Kept as text too: the user may be deleted later, the record must still say who.
    actor_name = models.CharField(max_length=150, blank=True)
    action = models.CharField(max_length=64, db_index=True)
    object_type = models.CharField(max_length=64, blank=True, db_index=True)
    object_id = models.CharField(max_length=64, blank=True)
    object_repr = models.CharField(max_length=255, blank=True)
    changes = models.JSONField(default=dict, blank=True)
    source_ip = models.GenericIPAddressField(null=True, blank=True)
    via = models.CharField(max_length=16, blank=True)  # web | api | cli | agent | job | gateway | controller | system
    # The team of the object, where a team owns it (console.teams): its rows are that team's members' to read.
    team = models.ForeignKey("console.Team", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self):
        return f"{self.created_at:%Y-%m-%d %H:%M:%S} {self.actor_name or 'system'} {self.action} {self.object_repr}"


def hash_token(raw: str) -> str:
    # Tokens are 32 random bytes: a plain SHA-256 is enough (no brute-forcing a 256-bit secret).
    return hashlib.sha256(raw.encode()).hexdigest()


class SecretQuerySet(models.QuerySet):
    def active(self):
        now = timezone.now()
        return self.filter(revoked_at__isnull=True).filter(
            models.Q(expires_at__isnull=True) | models.Q(expires_at__gt=now)
        )


class RevocableSecret(models.Model):
    """What API tokens and gateway keys share: shown once, stored as a hash (in the concrete
    model), recognised by a prefix, expiring and revocable."""

    name = models.CharField(max_length=100)
    prefix = models.CharField(max_length=16)  # first characters, to recognise a secret in lists
    created_at = models.DateTimeField(default=timezone.now)
    expires_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    objects = SecretQuerySet.as_manager()

    class Meta:
        abstract = True
        ordering = ["-created_at"]

    def __str__(self):
        return f"{self.name} ({self.prefix}…)"

    @property
    def is_active(self):
        return self.revoked_at is None and (self.expires_at is None or self.expires_at > timezone.now())


class ApiToken(RevocableSecret):
    """A per-user bearer token for /api/v1/."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens")
    token_hash = models.CharField(max_length=64, unique=True)

    class Meta(RevocableSecret.Meta):
        pass

    @staticmethod
    def generate_raw() -> str:
        return settings.API_TOKEN_PREFIX + secrets.token_urlsafe(32)


class ExternalIdentity(models.Model):
    """A console account that logs in through single sign-on (console/sso.py): the identity provider's subject
    for it (OIDC's `sub`, the LDAP username), and the groups the provider gave at the last login, which decided
    its role and teams then."""

    OIDC, LDAP = "oidc", "ldap"
    PROVIDERS = [(OIDC, "OpenID Connect"), (LDAP, "LDAP")]

    provider = models.CharField(max_length=8, choices=PROVIDERS)
    subject = models.CharField(max_length=255)
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="external_identities")
    groups = models.JSONField(default=list, blank=True)
    last_login_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["provider", "subject"], name="external_identity_unique")]

    def __str__(self):
        return f"{self.provider}:{self.subject}"


class Team(models.Model):
    """A group of people that owns models, artifacts, endpoints, gateway keys, benchmarks and profiles
    (docs/sso-and-teams.md). Its members see its objects and no other team's; the console Admin sees all. Existing
    data, and what is made without a team, belongs to the default team (DEFAULT_SLUG)."""

    DEFAULT_SLUG = "default"

    name = models.CharField(max_length=100, unique=True)
    slug = models.SlugField(max_length=50, unique=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["name"]

    def __str__(self):
        return self.name

    @classmethod
    def default_id(cls) -> int:
        return cls.objects.get_or_create(slug=cls.DEFAULT_SLUG, defaults={"name": "Default"})[0].pk


class TeamMembership(models.Model):
    """A user's role in one team: Viewer, Operator or Admin of that team (console.roles)."""

    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="memberships")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="team_memberships")
    role = models.CharField(max_length=16, choices=[(r, r) for r in ("Viewer", "Operator", "Admin")])

    class Meta:
        constraints = [models.UniqueConstraint(fields=["team", "user"], name="team_membership_unique")]

    def __str__(self):
        return f"{self.user} in {self.team} ({self.role})"


class TeamOwned(models.Model):
    """What a team owns. A new object without a team takes the team of the first of its TEAM_PARENTS it has (an
    artifact its model's, a benchmark its endpoint's), else the default team."""

    TEAM_PARENTS: tuple[str, ...] = ()

    team = models.ForeignKey(Team, on_delete=models.PROTECT, related_name="+")

    class Meta:
        abstract = True

    def save(self, *args, **kwargs):
        if self.team_id is None:
            parents = [getattr(self, name) for name in self.TEAM_PARENTS if getattr(self, f"{name}_id") is not None]
            self.team_id = parents[0].team_id if parents else Team.default_id()
        super().save(*args, **kwargs)
