"""The gateway's state in the database: API keys for applications (hashed at rest, scoped to
models or endpoints, with expiry and per-minute limits) and per-endpoint gateway settings
(queue depth; the blue-green pair). The gateway process (endpoints/gateway/asgi.py) reads them."""

import secrets

from django.conf import settings
from django.db import models

from console.models import RevocableSecret, TeamOwned

__all__ = ["GatewayKey", "GatewayEndpoint", "UsageHour", "Budget"]


class GatewayKey(RevocableSecret, TeamOwned):
    """A key one application sends to the gateway (`Authorization: Bearer gk_…`). Only its
    SHA-256 is stored; the raw key is shown once. Empty scopes mean every model."""

    # name: the application
    key_hash = models.CharField(max_length=64, unique=True)
    models_scope = models.JSONField(default=list, blank=True)  # served model names
    endpoints_scope = models.JSONField(default=list, blank=True)  # endpoint names
    rpm_limit = models.PositiveIntegerField(null=True, blank=True)  # requests per minute
    tpm_limit = models.PositiveIntegerField(null=True, blank=True)  # tokens per minute
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    # Running totals, added to by the gateway at each telemetry flush.
    requests_total = models.BigIntegerField(default=0)
    tokens_total = models.BigIntegerField(default=0)
    errors_total = models.BigIntegerField(default=0)

    class Meta(RevocableSecret.Meta):
        pass

    @property
    def scope_text(self):
        parts = [f"model {m}" for m in self.models_scope] + [f"endpoint {e}" for e in self.endpoints_scope]
        return ", ".join(parts) or "all models"

    @staticmethod
    def generate_raw() -> str:
        return settings.GATEWAY_KEY_PREFIX + secrets.token_urlsafe(32)


def default_rollout_steps() -> list[int]:
    return [10, 25, 50, 100]


class GatewayEndpoint(models.Model):
    """Gateway settings of one endpoint (the public one, whose served model name clients use).

    Blue-green: `staged` is a second endpoint serving the same model, started beside this one.
    `serving` says which of the two takes the traffic (and `canary_percent` what share of it the
    staged side takes meanwhile); after a switch or rollback the other one
    keeps running for `drain_seconds` (so a rollback is instant), then it is stopped."""

    class Serving(models.TextChoices):
        LIVE = "live"
        STAGED = "staged"

    endpoint = models.OneToOneField("endpoints.Endpoint", on_delete=models.CASCADE, related_name="gateway")
    queue_depth = models.PositiveIntegerField(null=True, blank=True)  # None: GATEWAY_QUEUE_DEPTH
    # The client's X-data-parallel-rank and X-Vllm-Priority reach the replicas (vLLM 0.32
    # entrypoints/generate/base/serving.py: _get_data_parallel_rank, PRIORITY_HEADER): off, a client could pin
    # itself to one rank or jump the queue of every other key's requests.
    engine_headers = models.BooleanField(default=False)
    staged = models.ForeignKey(
        "endpoints.Endpoint", null=True, blank=True, on_delete=models.SET_NULL, related_name="staged_for"
    )
    serving = models.CharField(max_length=8, choices=Serving.choices, default=Serving.LIVE)
    # Weighted canary: while the live side serves, this share (percent) of the requests goes to the
    # staged side instead; 0: the staged side is idle. A switch or rollback sets it back to 0.
    canary_percent = models.PositiveSmallIntegerField(default=0)
    # When canary_percent last changed: an SLO-gated rollout's window starts again there.
    canary_set_at = models.DateTimeField(null=True, blank=True)
    drain_seconds = models.PositiveIntegerField(default=30)
    # SLO-gated rollout (endpoints/gateway/rollout.py, applied by `manage.py serving_controller`): while
    # `rollout_auto`, the staged side's share goes up the plan after each clean window, switches at 100
    # and rolls back on a breach of a threshold (each optional: None is not checked).
    slo_p99_ms = models.PositiveIntegerField(null=True, blank=True)
    slo_error_pct = models.FloatField(null=True, blank=True)
    slo_ttft_p99_ms = models.PositiveIntegerField(null=True, blank=True)
    rollout_window_seconds = models.PositiveIntegerField(default=300)
    rollout_steps = models.JSONField(default=default_rollout_steps, blank=True)  # shares (%), rising, ending at 100
    rollout_auto = models.BooleanField(default=False)
    switched_at = models.DateTimeField(null=True, blank=True)
    stop_idle_at = models.DateTimeField(null=True, blank=True)  # when the idle side is to be stopped

    def __str__(self):
        return f"gateway of {self.endpoint.name}"


class UsageHour(models.Model):
    """Metered gateway usage, one row per hour (UTC, truncated), key, endpoint, served model and LoRA adapter
    (docs/usage-and-budgets.md). Counts come from the engine's own `usage` (prompt and completion tokens), settled
    by the gateway after each answer; the rows are only ever added to (F() increments), so any number of gateways
    and flushes can write them. The team is the key's team at the time of the request (a key moved later keeps its
    past usage where it was)."""

    hour = models.DateTimeField(db_index=True)
    team = models.ForeignKey("console.Team", on_delete=models.PROTECT, related_name="+")
    key = models.ForeignKey(GatewayKey, null=True, blank=True, on_delete=models.SET_NULL, related_name="usage")
    key_name = models.CharField(max_length=100, blank=True)  # kept when the key is deleted
    # An id, not a foreign key: usage outlives its endpoint (deleted endpoints keep their rows and their name).
    endpoint_id = models.IntegerField(null=True, blank=True, db_index=True)
    endpoint_name = models.CharField(max_length=100, blank=True)
    model = models.CharField(max_length=200, blank=True)  # the served model name the client asked for
    adapter = models.CharField(max_length=200, blank=True)  # a LoRA adapter's name, else ""
    requests = models.BigIntegerField(default=0)
    errors = models.BigIntegerField(default=0)
    # Of `requests`, those in flight on a gateway that died (killed): sent to a replica, answer and tokens unknown.
    interrupted = models.BigIntegerField(default=0)
    prompt_tokens = models.BigIntegerField(default=0)
    completion_tokens = models.BigIntegerField(default=0)

    class Meta:
        # One row per hour, team, key, endpoint, model and adapter, where the key or the endpoint is NULL too: a
        # unique index treats NULLs as distinct (PostgreSQL < 15, SQLite), so each NULL case has its own partial one.
        constraints = [
            models.UniqueConstraint(
                fields=["hour", "team", "key", "endpoint_id", "model", "adapter"], name="usage_hour_unique_row"
            ),
            models.UniqueConstraint(
                fields=["hour", "team", "endpoint_id", "model", "adapter"],
                condition=models.Q(key__isnull=True, endpoint_id__isnull=False),
                name="usage_hour_unique_row_no_key",
            ),
            models.UniqueConstraint(
                fields=["hour", "team", "key", "model", "adapter"],
                condition=models.Q(key__isnull=False, endpoint_id__isnull=True),
                name="usage_hour_unique_row_no_endpoint",
            ),
            models.UniqueConstraint(
                fields=["hour", "team", "model", "adapter"],
                condition=models.Q(key__isnull=True, endpoint_id__isnull=True),
                name="usage_hour_unique_row_no_key_no_endpoint",
            ),
        ]
        ordering = ["-hour"]

    def __str__(self):
        return f"{self.hour:%Y-%m-%d %H}h {self.key_name or '-'} {self.model} {self.adapter}".strip()

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class UsageJournalMark(models.Model):
    """How far a gateway's usage journal (endpoints/gateway/usage_journal.py) is stored in UsageHour: its segments
    up to `seq`. Written in the same transaction as a segment's usage, so a segment is stored once, whatever process
    dies when; removed once the journal's last segment is."""

    journal = models.CharField(max_length=200, unique=True)
    seq = models.BigIntegerField()
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self):
        return f"{self.journal} stored to {self.seq}"


class Budget(models.Model):
    """A token budget of one team or one gateway key per day or month (UTC calendar periods), enforced by every
    gateway through the shared counters in Redis (endpoints/gateway/limits.py) and settled with the engine's usage.

    hard: a request that does not fit is refused (429, Retry-After at the period's reset); queue: it waits until the
    window allows (up to GATEWAY_BUDGET_QUEUE_SECONDS, then 429); soft: it passes, alerts fire at 80 % and 100 %."""

    class Period(models.TextChoices):
        DAY = "day"
        MONTH = "month"

    class Mode(models.TextChoices):
        HARD = "hard"
        QUEUE = "queue"
        SOFT = "soft"

    team = models.ForeignKey("console.Team", null=True, blank=True, on_delete=models.CASCADE, related_name="budgets")
    key = models.ForeignKey(GatewayKey, null=True, blank=True, on_delete=models.CASCADE, related_name="budgets")
    tokens = models.PositiveBigIntegerField()
    period = models.CharField(max_length=8, choices=Period.choices)
    mode = models.CharField(max_length=8, choices=Mode.choices, default=Mode.HARD)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    # The start of the period for which the 80 % / 100 % alerts last fired (one of each per period).
    alerted_80_for = models.DateTimeField(null=True, blank=True)
    alerted_100_for = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            models.CheckConstraint(
                condition=models.Q(team__isnull=False, key__isnull=True)
                | models.Q(team__isnull=True, key__isnull=False),
                name="budget_of_a_team_or_a_key",
            ),
            models.UniqueConstraint(fields=["team", "period"], name="budget_one_per_team_period"),
            models.UniqueConstraint(fields=["key", "period"], name="budget_one_per_key_period"),
        ]

    def __str__(self):
        return f"{self.tokens} tokens per {self.period} ({self.mode}) for {self.owner_text}"

    @property
    def owner_text(self) -> str:
        return f"team {self.team}" if self.team_id else f"key {self.key}"
