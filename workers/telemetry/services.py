"""Writing telemetry: storing readings, rolling raw points up into minutes, pruning by age,
and evaluating alert rules (with an optional webhook on each change)."""

from __future__ import annotations

import json
import logging
import operator
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from datetime import timedelta
from functools import reduce

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.db.models import Avg, Count, F, Max, Min, Q
from django.db.models.expressions import ExpressionWrapper
from django.db.models.fields import BigIntegerField
from django.utils import timezone

from console.audit import audit_log
from console.validation import float_in_range, int_in_range
from workers.models import Node
from workers.telemetry.models import METRIC_UNITS, Alert, AlertRule, Point, Rollup, Series
from workers.telemetry.sources import endpoint_names, hidden_budgets, hidden_endpoints, served_facts

log = logging.getLogger("console.telemetry")


@dataclass
class Reading:
    """One value of one series at the time of the sample."""

    key: str
    metric: str
    value: float
    unit: str = ""
    node_id: int | None = None
    endpoint_id: int | None = None
    device: int | None = None
    replica: int | None = None
    label: str = ""


def store(readings: list[Reading], ts: float | None = None) -> int:
    """Append one point per reading (creating series on first sight) and keep each series'
    latest value. Readings whose value is None are skipped. Returns the number of points."""
    readings = [r for r in readings if r.value is not None]
    if not readings:
        return 0
    ts = int(ts if ts is not None else time.time())
    by_key = {r.key: r for r in readings}  # the last reading of a key wins
    with transaction.atomic():
        series = {s.key: s for s in Series.objects.filter(key__in=list(by_key))}
        missing = [r for k, r in by_key.items() if k not in series]
        if missing:
            Series.objects.bulk_create(
                [
                    Series(
                        key=r.key,
                        metric=r.metric,
                        unit=r.unit,
                        node_id=r.node_id,
                        endpoint_id=r.endpoint_id,
                        device=r.device,
                        replica=r.replica,
                        label=r.label[:200],
                    )
                    for r in missing
                ],
                ignore_conflicts=True,
            )
            series = {s.key: s for s in Series.objects.filter(key__in=list(by_key))}
        points = []
        changed = []
        for key, reading in by_key.items():
            s = series[key]
            value = float(reading.value)
            points.append(Point(series_id=s.pk, ts=ts, value=value))
            s.last_ts, s.last_value = ts, value
            if reading.label and s.label != reading.label[:200]:
                s.label = reading.label[:200]
            changed.append(s)
        Point.objects.bulk_create(points)
        Series.objects.bulk_update(changed, ["last_ts", "last_value", "label"])
    return len(points)


# --- rollups and retention ---------------------------------------------------------------


def _minute_of(field: str):
    return ExpressionWrapper(F(field) / 60 * 60, output_field=BigIntegerField())


def rollup(now: float | None = None, *, lookback_s: int = 300, chunk_s: int = 6 * 3600) -> int:
    """Roll complete minutes of raw points up into Rollup rows (min/avg/max/count). Idempotent:
    re-rolls the last ``lookback_s`` before the newest rollup so late points are counted.
    Returns the number of minute rows written."""
    now = int(now if now is not None else time.time())
    end = now // 60 * 60  # minutes before the current one are complete
    last = Rollup.objects.aggregate(m=Max("minute"))["m"]
    if last is None:
        first = Point.objects.aggregate(m=Min("ts"))["m"]
        if first is None:
            return 0
        start = first // 60 * 60
    else:
        start = max(last + 60 - lookback_s, 0)
    oldest_raw = now - settings.TELEMETRY_RAW_RETENTION_HOURS * 3600
    start = max(start, oldest_raw // 60 * 60)
    written = 0
    while start < end:
        stop = min(start + chunk_s, end)
        rows = (
            Point.objects.filter(ts__gte=start, ts__lt=stop)
            .annotate(m=_minute_of("ts"))
            .values("series_id", "m")
            .annotate(mn=Min("value"), av=Avg("value"), mx=Max("value"), n=Count("id"))
            .order_by()
        )
        objs = [
            Rollup(series_id=r["series_id"], minute=r["m"], min=r["mn"], avg=r["av"], max=r["mx"], count=r["n"])
            for r in rows
        ]
        if objs:
            Rollup.objects.bulk_create(
                objs,
                batch_size=2000,
                update_conflicts=True,
                unique_fields=["series", "minute"],
                update_fields=["min", "avg", "max", "count"],
            )
        written += len(objs)
        start = stop
    return written


def _delete_before(model, field: str, cutoff: int, step: int) -> int:
    """Delete rows with field < cutoff, oldest first, ``step`` seconds a statement (short locks)."""
    oldest = model.objects.aggregate(m=Min(field))["m"]
    deleted = 0
    while oldest is not None and oldest < cutoff:
        upto = min(oldest + step, cutoff)
        deleted += model.objects.filter(**{f"{field}__lt": upto}).delete()[0]  # fast path: one DELETE
        oldest = upto
    return deleted


def prune(now: float | None = None) -> dict:
    """Drop raw points past TELEMETRY_RAW_RETENTION_HOURS (only those already rolled up) and
    rollups past TELEMETRY_ROLLUP_RETENTION_DAYS."""
    now = int(now if now is not None else time.time())
    raw_cutoff = now - settings.TELEMETRY_RAW_RETENTION_HOURS * 3600
    rolled = Rollup.objects.aggregate(m=Max("minute"))["m"]
    raw_cutoff = min(raw_cutoff, rolled + 60) if rolled is not None else min(raw_cutoff, 0)
    rollup_cutoff = now - settings.TELEMETRY_ROLLUP_RETENTION_DAYS * 86400
    return {
        "points": _delete_before(Point, "ts", raw_cutoff, 3600),
        "rollups": _delete_before(Rollup, "minute", rollup_cutoff, 86400),
    }


def rollup_and_prune(now: float | None = None) -> dict:
    written = rollup(now)
    return {"rollups_written": written, **prune(now)}


# --- alerts ------------------------------------------------------------------------------

DEFAULT_RULES = [
    # name, kind, metric, op, threshold, duration, severity
    ("NPU temperature high", "metric", "dev.temp_c", "gt", 85, 60, "warning"),
    ("HBM almost full", "metric", "dev.mem_pct", "gt", 95, 300, "warning"),
    ("Accelerator health not OK", "metric", "dev.health", "ge", 1, 0, "critical"),
    ("P99 latency high", "metric", "ep.p99_s", "gt", 10, 120, "warning"),
    ("Error rate high", "metric", "ep.error_rate", "gt", 0.05, 60, "critical"),
    ("Node offline", "node_offline", "", "gt", 0, 60, "critical"),
    ("Endpoint not ready", "endpoint_not_ready", "", "gt", 0, 120, "warning"),
]


def stale_seconds() -> float:
    """A series whose latest point is older than this has no current value."""
    return max(3 * settings.TELEMETRY_INTERVAL_SECONDS, 30)


def _breaching(rule: AlertRule, now) -> dict[str, dict]:
    """subject -> {value, label, node_id, endpoint_id} for every subject breaching the rule now."""
    found: dict[str, dict] = {}
    if rule.kind == AlertRule.Kind.METRIC:
        fresh = int(now.timestamp() - stale_seconds())
        breaching = [
            s
            for s in Series.objects.filter(metric=rule.metric, last_ts__gte=fresh).select_related("node")
            if rule.breaches(s.last_value)
        ]
        endpoints = endpoint_names({s.endpoint_id for s in breaching if s.endpoint_id})
        for s in breaching:
            where = endpoints.get(s.endpoint_id, "") if s.endpoint_id else (s.node.name if s.node else "")
            found[s.key] = {
                "value": s.last_value,
                "label": f"{where} {s.label}".strip(),
                "node_id": s.node_id,
                "endpoint_id": s.endpoint_id,
            }
    elif rule.kind == AlertRule.Kind.NODE_OFFLINE:
        for node in Node.objects.all():
            if not node.online:
                age = (now - node.last_heartbeat).total_seconds() if node.last_heartbeat else None
                found[f"node:{node.pk}"] = {
                    "value": age,
                    "label": f"node {node.name}",
                    "node_id": node.pk,
                    "endpoint_id": None,
                }
    elif rule.kind == AlertRule.Kind.ENDPOINT_NOT_READY:
        for ep in served_facts():
            if not ep.ready:
                found[f"endpoint:{ep.id}"] = {
                    "value": None,
                    "label": f"endpoint {ep.name} is {ep.state}",
                    "node_id": ep.node_id,
                    "endpoint_id": ep.id,
                }
    elif rule.kind == AlertRule.Kind.BUDGET:
        # Raised by the gateway (alert_raise); open until the period in its subject ("budget:<id>:<%>:<reset epoch>")
        # is over.
        for alert in Alert.objects.filter(rule=rule, state__in=Alert.OPEN):
            reset = alert.subject.rpartition(":")[2]
            if reset.isdigit() and int(reset) > now.timestamp():
                found[alert.subject] = {
                    "value": alert.value,
                    "label": alert.label,
                    "node_id": alert.node_id,
                    "endpoint_id": alert.endpoint_id,
                }
    return found


def alert_raise(*, rule_name: str, kind: str, severity: str, subject: str, label: str, value: float | None) -> Alert:
    """A firing alert raised by the console itself, not by a rule's evaluation (a token budget's, kind "budget"):
    under its rule (made on first use, for the alerts page and the webhook's payload), firing at once. The caller
    sends the webhook (send_webhook) once its transaction is committed."""
    rule, _ = AlertRule.objects.get_or_create(
        name=rule_name, defaults={"kind": kind, "severity": severity, "duration_s": 0, "op": AlertRule.Op.GE}
    )
    now = timezone.now()
    return Alert.objects.create(
        rule=rule,
        subject=subject[:200],
        label=label[:300],
        value=value,
        state=Alert.State.FIRING,
        since=now,
        fired_at=now,
        updated_at=now,
    )


def evaluate_alerts(now=None, *, notify: bool = True) -> list[Alert]:
    """One pass over every rule: new breaches open a pending alert, which fires once it has
    lasted the rule's duration; a firing alert whose breach is over resolves (a pending one is
    dropped). Returns the alerts that fired or resolved in this pass (each POSTed to the webhook)."""
    now = now or timezone.now()
    changes: list[Alert] = []
    for rule in AlertRule.objects.all():
        current = _breaching(rule, now) if rule.enabled else {}
        with transaction.atomic():
            open_alerts = {
                a.subject: a for a in Alert.objects.select_for_update().filter(rule=rule, state__in=Alert.OPEN)
            }
            for subject, info in current.items():
                alert = open_alerts.get(subject)
                if alert is None:
                    alert = Alert(rule=rule, subject=subject, since=now, state=Alert.State.PENDING)
                alert.value, alert.label, alert.updated_at = info["value"], info["label"][:300], now
                alert.node_id, alert.endpoint_id = info["node_id"], info["endpoint_id"]
                if alert.state == Alert.State.PENDING and (now - alert.since).total_seconds() >= rule.duration_s:
                    alert.state, alert.fired_at = Alert.State.FIRING, now
                    changes.append(alert)
                alert.save()
            for subject, alert in open_alerts.items():
                if subject in current:
                    continue
                if alert.state == Alert.State.PENDING:
                    alert.delete()
                    continue
                alert.state, alert.resolved_at, alert.updated_at = Alert.State.RESOLVED, now, now
                alert.save(update_fields=["state", "resolved_at", "updated_at"])
                changes.append(alert)
    if notify:
        for alert in changes:
            send_webhook(alert)
    return changes


def alert_payload(alert: Alert) -> dict:
    rule = alert.rule
    return {
        "status": alert.state,
        "rule": rule.name,
        "severity": rule.severity,
        "condition": rule.condition,
        "subject": alert.subject,
        "label": alert.label,
        "value": alert.value,
        "threshold": rule.threshold,
        "node_id": alert.node_id,
        "endpoint_id": alert.endpoint_id,
        "since": alert.since.isoformat(),
        "fired_at": alert.fired_at.isoformat() if alert.fired_at else None,
        "resolved_at": alert.resolved_at.isoformat() if alert.resolved_at else None,
    }


def send_webhook(alert: Alert, url: str | None = None) -> bool:
    """POST the alert as JSON to TELEMETRY_ALERT_WEBHOOK_URL (if set). A failure is logged and
    kept on the alert; it never raises."""
    url = url if url is not None else settings.TELEMETRY_ALERT_WEBHOOK_URL
    if not url:
        return False
    body = json.dumps(alert_payload(alert)).encode()
    request = urllib.request.Request(
        url, data=body, method="POST", headers={"Content-Type": "application/json", "User-Agent": "inference-console"}
    )
    error = ""
    try:
        with urllib.request.urlopen(request, timeout=settings.TELEMETRY_ALERT_WEBHOOK_TIMEOUT_SECONDS) as response:  # noqa: S310 (configured by the operator)
            if not 200 <= response.status < 300:
                error = f"webhook answered {response.status}"
    except (urllib.error.URLError, OSError, ValueError) as exc:
        error = f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}"
    if error:
        log.warning("alert webhook %s: %s", url, error)
    Alert.objects.filter(pk=alert.pk).update(notify_error=error[:2000])
    return not error


ALERT_SEVERITIES = ("warning", "critical")


def _checked_limits(*, op, threshold, duration_s, defaults: tuple) -> tuple[str, float, int]:
    """A rule's operator, threshold and duration (a blank one is its default), as creating and updating a
    rule take them; a ValidationError keyed by the first bad field."""
    op = op or defaults[0]
    if op not in AlertRule.Op.values:
        raise ValidationError({"op": f"Choose one of: {', '.join(AlertRule.Op.values)}."})
    threshold = float_in_range(threshold, "threshold", low=-1e18, high=1e18, default=defaults[1])
    duration_s = int_in_range(duration_s, "duration_s", low=0, high=7 * 86400, default=defaults[2])
    return op, threshold, duration_s


def alert_rule_create(
    *,
    name: str,
    kind: str,
    metric: str = "",
    op: str = "gt",
    threshold=None,
    duration_s=None,
    severity: str = "warning",
    enabled: bool = True,
    actor=None,
    request=None,
    via: str = "",
) -> AlertRule:
    """A new alert rule; a ValidationError keyed by the first bad field changes nothing."""
    name = (name or "").strip()
    if not name or len(name) > 100:
        raise ValidationError({"name": "Give the rule a name of 1 to 100 characters."})
    if AlertRule.objects.filter(name=name).exists():
        raise ValidationError({"name": f"A rule named “{name}” exists already."})
    if kind not in AlertRule.Kind.values or kind == AlertRule.Kind.BUDGET:  # the gateway raises budget alerts
        kinds = [k for k in AlertRule.Kind.values if k != AlertRule.Kind.BUDGET]
        raise ValidationError({"kind": f"Choose one of: {', '.join(kinds)}."})
    metric = (metric or "").strip() if kind == AlertRule.Kind.METRIC else ""
    if kind == AlertRule.Kind.METRIC and metric not in METRIC_UNITS:
        raise ValidationError({"metric": "Choose a metric the console records (e.g. dev.temp_c, ep.p99_s)."})
    # Rules of the other kinds have no operator to give.
    op, threshold, duration_s = _checked_limits(
        op=op, threshold=threshold, duration_s=duration_s, defaults=(AlertRule.Op.GT, 0.0, 60)
    )
    if severity not in ALERT_SEVERITIES:
        raise ValidationError({"severity": f"Choose one of: {', '.join(ALERT_SEVERITIES)}."})
    try:
        with transaction.atomic():
            rule = AlertRule.objects.create(
                name=name,
                kind=kind,
                metric=metric,
                op=op,
                threshold=threshold,
                duration_s=duration_s,
                severity=severity,
                enabled=bool(enabled),
            )
            audit_log(
                actor=actor,
                action="alert_rule.create",
                obj=rule,
                request=request,
                via=via,
                changes={
                    "name": name,
                    "kind": kind,
                    "metric": metric,
                    "op": op,
                    "threshold": threshold,
                    "duration_s": duration_s,
                    "severity": severity,
                    "enabled": rule.enabled,
                },
            )
    except IntegrityError as exc:  # the same name created at the same moment: the unique index decides
        raise ValidationError({"name": f"A rule named “{name}” exists already."}) from exc
    return rule


def alert_rule_update(
    *, rule: AlertRule, threshold, duration_s, op: str, enabled: bool, actor=None, request=None, via: str = ""
) -> AlertRule:
    """A rule's threshold, duration, operator and switch; a ValidationError keyed by the first bad field
    changes nothing."""
    op, threshold, duration_s = _checked_limits(
        op=op, threshold=threshold, duration_s=duration_s, defaults=(rule.op, rule.threshold, rule.duration_s)
    )
    before = {"threshold": rule.threshold, "duration_s": rule.duration_s, "op": rule.op, "enabled": rule.enabled}
    rule.threshold, rule.duration_s, rule.op, rule.enabled = threshold, duration_s, op, bool(enabled)
    rule.save(update_fields=["threshold", "duration_s", "op", "enabled"])
    audit_log(
        actor=actor,
        action="alert_rule.update",
        obj=rule,
        request=request,
        via=via,
        changes={
            "before": before,
            "after": {"threshold": threshold, "duration_s": duration_s, "op": op, "enabled": rule.enabled},
        },
    )
    return rule


def ensure_default_rules() -> int:
    """Create the default rules that do not exist yet (by name). The migration seeds the same."""
    created = 0
    for name, kind, metric, op, threshold, duration, severity in DEFAULT_RULES:
        _, new = AlertRule.objects.get_or_create(
            name=name,
            defaults={
                "kind": kind,
                "metric": metric,
                "op": op,
                "threshold": threshold,
                "duration_s": duration,
                "severity": severity,
            },
        )
        created += new
    return created


def visible_alerts(*, team_ids: set[int] | None):
    """The alerts a reader of `team_ids` may see (None: every team's, the console Admin): not another team's
    endpoint's, nor another team's token budget's (console.teams)."""
    alerts = Alert.objects.all()
    if team_ids is None:
        return alerts
    hidden = hidden_endpoints(team_ids)
    if hidden:
        alerts = alerts.exclude(endpoint_id__in=hidden)
    budgets = hidden_budgets(team_ids)
    if budgets:
        alerts = alerts.exclude(reduce(operator.or_, (Q(subject__startswith=f"budget:{b}:") for b in budgets)))
    return alerts


def recent_alerts(hours: int = 24, *, team_ids: set[int] | None):
    """The firing alerts and those resolved in the last `hours` that a reader of `team_ids` may see."""
    since = timezone.now() - timedelta(hours=hours)
    alerts = visible_alerts(team_ids=team_ids)
    firing = list(alerts.filter(state=Alert.State.FIRING).select_related("rule")[:50])
    resolved = list(alerts.filter(state=Alert.State.RESOLVED, resolved_at__gte=since).select_related("rule")[:20])
    return firing, resolved
