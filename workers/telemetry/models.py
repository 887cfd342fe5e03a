"""Time series of the fleet: one Series per (subject, metric), raw Points for recent hours,
1-minute Rollups (min/avg/max/count) for weeks, and alert rules with the alerts they raised.

Times are integer Unix seconds (UTC), not DateTimeFields: bucketing for charts is then
``ts / step * step`` in SQL, the same on SQLite and PostgreSQL, and the rows stay small."""

from django.db import models
from django.utils import timezone

__all__ = ["Series", "Point", "Rollup", "AlertRule", "Alert"]


# The metrics telemetry records and their units (charts label axes with them; alert rules name them).
METRIC_UNITS = {
    "dev.util_pct": "%",
    "dev.mem_used_mb": "MB",
    "dev.mem_pct": "%",
    "dev.temp_c": "°C",
    "dev.power_w": "W",
    "dev.health": "",
    "host.cpu_pct": "%",
    "host.mem_pct": "%",
    "host.mem_used_bytes": "B",
    "host.load1": "",
    "host.disk_pct": "%",
    "host.net_rx_Bps": "B/s",
    "host.net_tx_Bps": "B/s",
    "host.dev_util_avg": "%",
    "proc.cpu_pct": "%",
    "proc.rss_bytes": "B",
    "ep.qps": "req/s",
    "ep.p50_s": "s",
    "ep.p90_s": "s",
    "ep.p99_s": "s",
    "ep.ttft_p50_s": "s",
    "ep.ttft_p99_s": "s",
    "ep.itl_p50_s": "s",
    "ep.gen_tps": "tok/s",
    "ep.prompt_tps": "tok/s",
    "ep.running": "",
    "ep.waiting": "",
    "ep.kv_cache_pct": "%",
    "ep.prefix_hit_pct": "%",
    "ep.spec_accept_pct": "%",  # speculative decoding: accepted / draft tokens over the window
    "ep.spec_mean_len": "tok",  # speculative decoding: 1 + accepted tokens / drafts (tokens per target step)
    # A disaggregated endpoint's per role (endpoints.telemetry): TTFT of its prefill replicas, ITL of its decode
    # replicas, and the prompt tokens its decode replicas loaded through the KV connector (per s, % of prompt).
    "ep.prefill_ttft_p50_s": "s",
    "ep.prefill_ttft_p99_s": "s",
    "ep.decode_itl_p50_s": "s",
    "ep.decode_itl_p99_s": "s",
    "ep.kv_in_tps": "tok/s",
    "ep.kv_in_pct": "%",
    "ep.errors": "",
    "ep.error_rate": "ratio",
    "ep.scrape_ok": "",
}


class Series(models.Model):
    """What one line on a chart measures. ``key`` is stable, e.g. ``n3.d0.dev.temp_c`` (node 3,
    device 0), ``n3.host.cpu_pct`` or ``e7.r0.ep.qps`` (endpoint 7, replica 0)."""

    key = models.CharField(max_length=200, unique=True)
    metric = models.CharField(max_length=64, db_index=True)
    unit = models.CharField(max_length=16, blank=True)
    node = models.ForeignKey("workers.Node", null=True, blank=True, on_delete=models.CASCADE, related_name="series")
    # The endpoint's id, not a foreign key: serving sits above telemetry, at the schema level too (the endpoints
    # app owns the link: it names the endpoint, endpoints.telemetry, and removes its series with it, endpoints.apps).
    endpoint_id = models.BigIntegerField(null=True, blank=True, db_index=True)
    device = models.IntegerField(null=True, blank=True)  # accelerator index on the node
    replica = models.IntegerField(null=True, blank=True)  # replica index of the endpoint
    label = models.CharField(max_length=200, blank=True)
    # The latest reading, kept here so cards, alerts and /metrics never scan the points.
    last_ts = models.BigIntegerField(null=True, blank=True)
    last_value = models.FloatField(null=True, blank=True)

    class Meta:
        ordering = ["key"]
        indexes = [
            models.Index(fields=["node", "metric"], name="tm_series_node_metric"),
            models.Index(fields=["endpoint_id", "metric"], name="tm_series_ep_metric"),
        ]

    def __str__(self):
        return self.key


class Point(models.Model):
    """One raw reading (kept TELEMETRY_RAW_RETENTION_HOURS)."""

    series = models.ForeignKey(Series, on_delete=models.CASCADE, related_name="+", db_index=False)
    ts = models.BigIntegerField()  # Unix seconds
    value = models.FloatField()

    class Meta:
        indexes = [
            models.Index(fields=["series", "ts"], name="tm_point_series_ts"),
            models.Index(fields=["ts"], name="tm_point_ts"),
        ]

    def __str__(self):
        return f"series {self.series_id} @ {self.ts}: {self.value}"


class Rollup(models.Model):
    """One minute of a series (kept TELEMETRY_ROLLUP_RETENTION_DAYS)."""

    series = models.ForeignKey(Series, on_delete=models.CASCADE, related_name="+", db_index=False)
    minute = models.BigIntegerField()  # Unix seconds of the minute's start
    min = models.FloatField()
    avg = models.FloatField()
    max = models.FloatField()
    count = models.IntegerField()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["series", "minute"], name="tm_rollup_series_minute")]
        indexes = [models.Index(fields=["minute"], name="tm_rollup_minute")]

    def __str__(self):
        return f"series {self.series_id} @ {self.minute}: {self.avg} (n={self.count})"


class AlertRule(models.Model):
    class Kind(models.TextChoices):
        METRIC = "metric", "metric above/below a threshold"
        NODE_OFFLINE = "node_offline", "node offline"
        ENDPOINT_NOT_READY = "endpoint_not_ready", "endpoint not ready"
        # Raised by the gateway when a soft token budget passes 80 % or 100 % of its period (endpoints/gateway/
        # services.py budget_alert); it fires at once and resolves when the period is over.
        BUDGET = "budget", "token budget (raised by the gateway)"

    class Op(models.TextChoices):
        GT = "gt", ">"
        GE = "ge", "≥"
        LT = "lt", "<"
        LE = "le", "≤"

    name = models.CharField(max_length=100, unique=True)
    kind = models.CharField(max_length=24, choices=Kind.choices, default=Kind.METRIC)
    metric = models.CharField(max_length=64, blank=True)  # for kind=metric, e.g. dev.temp_c
    op = models.CharField(max_length=2, choices=Op.choices, default=Op.GT)
    threshold = models.FloatField(default=0)
    duration_s = models.PositiveIntegerField(default=60)  # must hold this long before firing
    severity = models.CharField(max_length=16, default="warning")  # warning | critical
    enabled = models.BooleanField(default=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["name"]

    def __str__(self):
        return self.name

    def breaches(self, value) -> bool:
        if value is None:
            return False
        return {
            "gt": value > self.threshold,
            "ge": value >= self.threshold,
            "lt": value < self.threshold,
            "le": value <= self.threshold,
        }[self.op]

    @property
    def condition(self) -> str:
        if self.kind != self.Kind.METRIC:
            return f"{self.get_kind_display()} for {self.duration_s} s"
        return f"{self.metric} {self.get_op_display()} {self.threshold:g} for {self.duration_s} s"


class Alert(models.Model):
    """One rule breached by one subject (a series, node or endpoint): pending until the breach
    has lasted the rule's duration, then firing, then resolved."""

    class State(models.TextChoices):
        PENDING = "pending"
        FIRING = "firing"
        RESOLVED = "resolved"

    OPEN = (State.PENDING, State.FIRING)

    rule = models.ForeignKey(AlertRule, on_delete=models.CASCADE, related_name="alerts")
    subject = models.CharField(max_length=200)  # series key, "node:3" or "endpoint:7"
    label = models.CharField(max_length=300, blank=True)
    node = models.ForeignKey("workers.Node", null=True, blank=True, on_delete=models.CASCADE, related_name="+")
    endpoint_id = models.BigIntegerField(null=True, blank=True, db_index=True)  # as Series.endpoint_id
    state = models.CharField(max_length=12, choices=State.choices, default=State.PENDING, db_index=True)
    value = models.FloatField(null=True, blank=True)
    since = models.DateTimeField(default=timezone.now)  # the breach began
    fired_at = models.DateTimeField(null=True, blank=True)
    resolved_at = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField(default=timezone.now)
    notify_error = models.TextField(blank=True)  # the webhook's last failure

    class Meta:
        ordering = ["-updated_at", "-id"]
        indexes = [models.Index(fields=["rule", "subject", "state"], name="tm_alert_rule_subject")]

    def __str__(self):
        return f"{self.rule.name} {self.label or self.subject} {self.state}"
