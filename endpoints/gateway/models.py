"""The gateway's state in the database: API keys for applications (hashed at rest, scoped to
models or endpoints, with expiry and per-minute limits) and per-endpoint gateway settings
(queue depth; the blue-green pair). The gateway process (endpoints/gateway/asgi.py) reads them."""

import secrets

from django.conf import settings
from django.db import models

from console.models import RevocableSecret, TeamOwned

__all__ = ["GatewayKey", "GatewayEndpoint"]


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
