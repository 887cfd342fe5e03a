"""Changing gateway state: API keys (create, revoke) and per-endpoint settings. Each change
is audited. The gateway process picks changes up within GATEWAY_KEY_CACHE_SECONDS (keys)
and GATEWAY_ROUTES_REFRESH_SECONDS (routes)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta
from pathlib import Path

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.db.models import F, Q
from django.utils import timezone

from console.audit import audit_log
from console.models import hash_token
from console.roles import ADMIN
from console.teams import team_for_new
from console.validation import float_in_range, int_in_range
from endpoints.endpoint_spec import EndpointSpec
from endpoints.gateway.models import (
    Budget,
    GatewayEndpoint,
    GatewayKey,
    UsageHour,
    UsageJournalMark,
    default_rollout_steps,
)
from endpoints.gateway.selectors import model_name
from endpoints.gateway.stats import percentile
from endpoints.gateway.usage_journal import read_segment
from endpoints.models import Endpoint
from endpoints.replica_state import in_flight
from endpoints.services import endpoint_create, endpoint_stop
from workers.telemetry.models import AlertRule
from workers.telemetry.services import Reading, alert_raise, send_webhook, store


def _names(values: Sequence[str]) -> list[str]:
    names = sorted({str(v).strip() for v in values if str(v).strip()})
    for n in names:
        if len(n) > 100:
            raise ValidationError(f"Scope name too long: {n[:40]}…")
    return names


def _limit(value: int | None, field: str, label: str) -> int | None:
    """A per-minute limit, queue depth or drain time: blank is none; the message names the field."""
    return int_in_range(
        value, field, low=1, high=10_000_000, message=f"{label} must be a whole number between 1 and 10000000."
    )


def key_create(
    *,
    name: str,
    models: Sequence[str] = (),
    endpoints: Sequence[str] = (),
    expires_days: float | None = None,
    expires_at: datetime | None = None,
    rpm_limit: int | None = None,
    tpm_limit: int | None = None,
    team_id: int | None = None,
    actor=None,
    request=None,
    via: str = "",
) -> tuple[GatewayKey, str]:
    """Create a gateway key for a team where `actor` is an Admin (console.teams.team_for_new); returns (key, raw).
    The raw key is not stored anywhere."""
    # A job's key (a benchmark's own, endpoints.bench.client) is made for the system in the endpoint's team, which
    # the run's Operator could use: only a person's key needs their Admin role in its team.
    team_id = team_id if via == "job" and team_id is not None else team_for_new(actor, team_id, role=ADMIN)
    name = name.strip()
    if not name:
        raise ValidationError("Give the key a name (the application that will use it).")
    if len(name) > 100:
        raise ValidationError("The name is too long (100 characters at most).")
    days = float_in_range(
        expires_days,
        "expires_days",
        low=0,
        high=3650,
        low_open=True,
        message="Expiry must be a number of days, above 0 and up to 3650.",
    )
    if days is not None:
        expires_at = timezone.now() + timedelta(days=days)
    raw = GatewayKey.generate_raw()
    key = GatewayKey.objects.create(
        name=name,
        prefix=raw[:10],
        key_hash=hash_token(raw),
        models_scope=_names(models),
        endpoints_scope=_names(endpoints),
        rpm_limit=_limit(rpm_limit, "rpm_limit", "Requests per minute"),
        tpm_limit=_limit(tpm_limit, "tpm_limit", "Tokens per minute"),
        expires_at=expires_at,
        created_by=actor if actor is not None and getattr(actor, "pk", None) else None,
        team_id=team_id,
    )
    audit_log(
        actor=actor,
        action="gateway_key.create",
        obj=key,
        request=request,
        via=via,
        changes={
            "name": name,
            "models": key.models_scope,
            "endpoints": key.endpoints_scope,
            "rpm_limit": key.rpm_limit,
            "tpm_limit": key.tpm_limit,
            "expires_at": expires_at.isoformat() if expires_at else None,
        },
    )
    return key, raw


def key_revoke(*, key: GatewayKey, actor=None, request=None, via: str = "") -> GatewayKey:
    if key.revoked_at is None:
        key.revoked_at = timezone.now()
        key.save(update_fields=["revoked_at"])
        audit_log(actor=actor, action="gateway_key.revoke", obj=key, request=request, via=via)
    return key


def key_update_limits(
    *,
    key: GatewayKey,
    rpm_limit: int | None = None,
    tpm_limit: int | None = None,
    actor=None,
    request=None,
    via: str = "",
) -> GatewayKey:
    before = {"rpm_limit": key.rpm_limit, "tpm_limit": key.tpm_limit}
    key.rpm_limit = _limit(rpm_limit, "rpm_limit", "Requests per minute")
    key.tpm_limit = _limit(tpm_limit, "tpm_limit", "Tokens per minute")
    key.save(update_fields=["rpm_limit", "tpm_limit"])
    audit_log(
        actor=actor,
        action="gateway_key.update",
        obj=key,
        request=request,
        via=via,
        changes={"before": before, "after": {"rpm_limit": key.rpm_limit, "tpm_limit": key.tpm_limit}},
    )
    return key


def endpoint_settings(endpoint: Endpoint) -> GatewayEndpoint:
    return GatewayEndpoint.objects.get_or_create(endpoint=endpoint)[0]


# --- telemetry of the gateway (called by the gateway process) ----------------------------


def store_gateway_stats(stats, interval_s: float, outstanding: dict | None = None, held: dict | None = None) -> int:
    """Store one flush of the gateway's figures: per endpoint QPS, latency P50/P99, TTFT
    P50/P99, error rate and the requests held for a wake now (series e<id>.gw.*; an endpoint with
    requests held but none finished gets gw.waiting alone); per key requests, tokens and errors per
    minute, latency and TTFT P50/P99 (series gk<id>.gk.*), and add the counts to the key's running totals; per LoRA
    adapter requests, tokens and errors per minute (series e<id>.lora.*.<adapter>, labelled with its name)."""
    readings = []
    held = {ep_id: n for ep_id, n in (held or {}).items() if n}
    existing = set(Endpoint.objects.filter(pk__in=list(stats.ep) + list(held)).values_list("pk", flat=True))
    for ep_id in existing:
        e = stats.ep.get(ep_id)
        values = {"gw.waiting": held.get(ep_id, 0)}
        if e is not None:
            values |= {
                "gw.qps": e["n"] / interval_s,
                "gw.p50_s": percentile(e["lat"], 0.5),
                "gw.p99_s": percentile(e["lat"], 0.99),
                "gw.ttft_p50_s": percentile(e["ttft"], 0.5),
                "gw.ttft_p99_s": percentile(e["ttft"], 0.99),
                "gw.error_rate": e["errors"] / e["n"] if e["n"] else 0.0,
                "gw.inflight": (outstanding or {}).get(ep_id, 0),
            }
        for metric, value in values.items():
            readings.append(
                Reading(
                    key=f"e{ep_id}.{metric}",
                    metric=metric,
                    value=value,
                    endpoint_id=ep_id,
                    unit="s" if metric.endswith("_s") else "",
                    label="gateway",
                )
            )
    # LoRA adapters: requests, tokens and errors per minute, per (endpoint, adapter): series e<id>.lora.<name>.*
    per_minute = 60.0 / interval_s
    for (ep_id, name), a in stats.adapter.items():
        if ep_id not in existing:
            continue
        for metric, value in {
            "lora.requests_pm": a["n"] * per_minute,
            "lora.tokens_pm": a["tokens"] * per_minute,
            "lora.errors_pm": a["errors"] * per_minute,
        }.items():
            readings.append(
                Reading(
                    key=f"e{ep_id}.{metric}.{name}",
                    metric=metric,
                    value=value,
                    endpoint_id=ep_id,
                    unit="/min",
                    label=name,
                )
            )
    # Totals and points in one transaction: a reader never sees a key's total without its points.
    with transaction.atomic():
        keys = dict(GatewayKey.objects.filter(pk__in=list(stats.key)).values_list("pk", "name"))
        now = timezone.now()
        for key_id, k in stats.key.items():
            if key_id not in keys:
                continue
            per_minute = 60.0 / interval_s  # rates, so chart buckets and rollups average correctly
            for metric, value in {
                "gk.requests_pm": k["n"] * per_minute,
                "gk.tokens_pm": k["tokens"] * per_minute,
                "gk.errors_pm": k["errors"] * per_minute,
                "gk.p50_s": percentile(k["lat"], 0.5),
                "gk.p99_s": percentile(k["lat"], 0.99),
                "gk.ttft_p50_s": percentile(k["ttft"], 0.5),
                "gk.ttft_p99_s": percentile(k["ttft"], 0.99),
            }.items():
                readings.append(
                    Reading(
                        key=f"gk{key_id}.{metric}",
                        metric=metric,
                        value=value,
                        label=keys[key_id],
                        unit="s" if metric.endswith("_s") else "/min",
                    )
                )
            GatewayKey.objects.filter(pk=key_id).update(
                requests_total=F("requests_total") + k["n"],
                tokens_total=F("tokens_total") + k["tokens"],
                errors_total=F("errors_total") + k["errors"],
                last_used_at=now,
            )
        return store(readings)


# --- metering and budgets (called by the gateway process) ------------------------------------


def store_usage(stats) -> int:
    """Add one flush of metered usage to the UsageHour rows (docs/usage-and-budgets.md) and raise the soft budget
    alerts it noted. Rows are only added to (F() increments), each in its own transaction, so any number of gateways
    can flush at once (the row's unique constraints, NULL key or endpoint included, make the later of two creations
    add to the first). A LoRA adapter's row has its endpoint's served model name as model. Returns the rows written."""
    ep_ids = {row[4] for row in stats.usage if row[4] is not None}
    endpoints = {
        pk: (name, served or name)
        for pk, name, served in Endpoint.objects.filter(pk__in=ep_ids).values_list("pk", "name", "served_model_name")
    }
    keys = set(GatewayKey.objects.filter(pk__in={row[2] for row in stats.usage}).values_list("pk", flat=True))
    written = 0
    for (hour, team_id, key_id, key_name, ep_id, model, adapter), counts in stats.usage.items():
        if team_id is None:  # a key is always some team's; a row without one could not be stored
            continue
        ep_name, served = endpoints.get(ep_id, ("", model)) if ep_id is not None else ("", model)
        match = {
            "hour": hour,
            "team_id": team_id,
            "key_id": key_id if key_id in keys else None,  # a key deleted since keeps its usage, by name
            "endpoint_id": ep_id,
            "model": (served if adapter else model)[:200],
            "adapter": adapter[:200],
        }
        add = {field: F(field) + n for field, n in counts.items()}
        with transaction.atomic():
            pk = UsageHour.objects.filter(**match).order_by("pk").values_list("pk", flat=True).first()
            if pk is None:
                try:
                    with transaction.atomic():
                        UsageHour.objects.create(**match, key_name=key_name[:100], endpoint_name=ep_name, **counts)
                        written += 1
                        continue
                except IntegrityError:  # another gateway made it just now
                    pk = UsageHour.objects.filter(**match).order_by("pk").values_list("pk", flat=True).get()
            UsageHour.objects.filter(pk=pk).update(**add)
            written += 1
    for (budget_id, percent, start, reset), used in stats.budget_alerts.items():
        budget_alert(budget_id=budget_id, percent=percent, start=start, reset=reset, used=used)
    return written


def store_journal(*, journal: str, segments: list[tuple[int, Path]], finished: bool = False, died: bool = False) -> int:
    """Store a usage journal's finished segments (usage_journal.py), oldest first: each segment's usage and the
    journal's mark in one transaction, then its file deleted; a segment the mark already covers (its gateway died
    between the two) is only deleted. `finished`: the journal is done (its gateway stopped, or died and this is
    all it left): its mark goes too. `died`: its gateway died; the requests in flight on it (the tickets its
    segments leave open) go with the last segment, as interrupted requests. Returns the segments stored."""
    stored = 0
    in_flight: dict[int, tuple] = {}
    for number, (seq, path) in enumerate(segments, 1):
        usage = read_segment(path, in_flight=in_flight)
        if died and number == len(segments):
            for row in in_flight.values():
                usage.record_interrupted(row=row)
        with transaction.atomic():
            mark = UsageJournalMark.objects.select_for_update().filter(journal=journal).first()
            if mark is None or mark.seq < seq:
                store_usage(usage)
                UsageJournalMark.objects.update_or_create(journal=journal, defaults={"seq": seq})
                stored += 1
        path.unlink(missing_ok=True)
    if finished:
        UsageJournalMark.objects.filter(journal=journal).delete()
    return stored


def budget_alert(*, budget_id: int, percent: int, start: datetime, reset: datetime, used: int) -> bool:
    """Raise a soft budget's alert at `percent` (80 or 100) of its period starting at `start`, once for all gateways
    (Budget.alerted_80_for / alerted_100_for, set by one conditional UPDATE: the gateway whose update matched
    raises it): an alert on the alerts page (firing until the period's reset; the webhook is told), and an audit row.
    False where it was raised already (or the budget is gone)."""
    field = "alerted_80_for" if percent == 80 else "alerted_100_for"
    with transaction.atomic():
        won = (
            Budget.objects.filter(pk=budget_id)
            .filter(Q(**{f"{field}__isnull": True}) | Q(**{f"{field}__lt": start}))
            .update(**{field: start})
        )
        if not won:
            return False
        budget = Budget.objects.select_related("team", "key").get(pk=budget_id)
        label = f"{budget.owner_text}: {used} of {budget.tokens} tokens this {budget.period} ({percent} %)"
        alert = alert_raise(
            rule_name=f"Token budget at {percent} %",
            kind=AlertRule.Kind.BUDGET,
            severity="critical" if percent >= 100 else "warning",
            subject=f"budget:{budget.pk}:{percent}:{int(reset.timestamp())}",
            label=label,
            value=round(100 * used / budget.tokens, 1) if budget.tokens else None,
        )
        audit_log(
            action="budget.alert",
            obj=budget,
            via="gateway",
            changes={"percent": percent, "used": used, "tokens": budget.tokens, "period_start": start.isoformat()},
        )
    transaction.on_commit(lambda: send_webhook(alert))
    return True


# --- blue-green ------------------------------------------------------------------------------


def finish_drains() -> int:
    """Stop the idle side of each blue-green pair whose drain period is over (the gateway calls
    this every refresh), once its replicas have answered what they were sent before the switch (their
    vLLM's own gauges: every gateway's requests), or GATEWAY_DRAIN_SECONDS after the period whatever they
    run, as a scaled-down replica drains. A stream longer than the period was cut before. Returns how
    many were stopped."""
    stopped, now = 0, timezone.now()
    for gw in GatewayEndpoint.objects.filter(stop_idle_at__lte=now).select_related("endpoint", "staged"):
        idle = gw.staged if gw.serving == GatewayEndpoint.Serving.LIVE else gw.endpoint
        stop_idle_at = gw.stop_idle_at
        assert stop_idle_at is not None  # the filter's
        bound_over = now >= stop_idle_at + timedelta(seconds=settings.GATEWAY_DRAIN_SECONDS)
        if idle is not None and not bound_over and _still_answering(idle):
            continue  # looked at again at the next refresh
        with transaction.atomic():  # a Switch or Rollback meanwhile moved or cleared the drain: leave it
            if not GatewayEndpoint.objects.filter(pk=gw.pk, serving=gw.serving, stop_idle_at=gw.stop_idle_at).update(
                stop_idle_at=None
            ):
                continue
            if idle is not None:
                _stop_endpoint(idle, reason="blue-green drain over")
                stopped += 1
            if idle is not None and idle == gw.staged:  # rolled back and stopped: free to stand by elsewhere
                GatewayEndpoint.objects.filter(pk=gw.pk, staged=idle).update(staged=None)
    return stopped


def _still_answering(endpoint: Endpoint) -> bool:
    """A replica of the endpoint runs or queues a request, or cannot say (unknown counts as busy)."""
    return any(
        in_flight(replica, from_elsewhere=True, timeout=1.0) != 0
        for replica in endpoint.replica_set.filter(state=Endpoint.State.READY, port__isnull=False).select_related(
            "node"
        )
    )


def _stop_endpoint(endpoint: Endpoint, *, reason: str, actor=None, request=None):
    return endpoint_stop(endpoint=endpoint, user=actor, request=request)


def _pair(endpoint) -> GatewayEndpoint:
    return GatewayEndpoint.objects.select_for_update().get_or_create(endpoint=endpoint)[0]


def _ready(endpoint) -> bool:
    return (
        endpoint.desired_state == Endpoint.Desired.RUNNING
        and endpoint.replica_set.filter(state=Endpoint.State.READY, port__isnull=False).exists()
    )


def staged_endpoint(staged_id) -> Endpoint:
    """The endpoint named as a staged side, or a refusal on `staged`."""
    found = Endpoint.objects.filter(pk=staged_id).first() if str(staged_id or "").isdigit() else None
    if found is None:
        raise ValidationError(
            {"staged": f"No endpoint #{staged_id}: give the id of an endpoint serving the same model."}
        )
    return found


def endpoint_launch(*, spec: EndpointSpec, user, request=None) -> Endpoint:
    """Launch an endpoint (endpoints.services.endpoint_create); a blue-green standby (spec.stage_beside) is staged
    beside its live side in the same transaction, so it never serves that name outside the pair."""
    with transaction.atomic():
        endpoint = endpoint_create(spec=spec, user=user, request=request)
        if spec.stage_beside:
            live = Endpoint.objects.get(name=spec.stage_beside)
            try:
                stage(endpoint=live, staged=endpoint, actor=user, request=request)
            except ValidationError as exc:  # the pair's rules, under the launch's field
                raise ValidationError({"stage_beside": exc.messages}) from exc
    return endpoint


def stage(
    *, endpoint: Endpoint, staged: Endpoint, drain_seconds: int | None = None, actor=None, request=None, via: str = ""
) -> GatewayEndpoint:
    """Make `staged` (another endpoint serving the same model) the standby of `endpoint`: it
    gets no traffic until a switch."""
    if staged.pk == endpoint.pk:
        raise ValidationError({"staged": "An endpoint cannot be staged beside itself."})
    if model_name(staged) != model_name(endpoint):
        raise ValidationError(
            {
                "staged": f"{staged.name} serves {model_name(staged)!r}, not {model_name(endpoint)!r}: "
                "launch it with the same served model name."
            }
        )
    drain = None if drain_seconds is None else _limit(drain_seconds, "drain_seconds", "Drain seconds")
    with transaction.atomic():
        # The pair's row, then both endpoints (the drain's order: pair row, then the endpoint it stops): two
        # stagings naming the same endpoint run one after the other.
        gw = _pair(endpoint)
        list(Endpoint.objects.select_for_update().filter(pk__in=(endpoint.pk, staged.pk)).order_by("pk"))
        if GatewayEndpoint.objects.filter(staged=endpoint).exists():
            raise ValidationError({"staged": f"{endpoint.name} is itself the staged side of another blue-green pair."})
        if GatewayEndpoint.objects.filter(endpoint=staged, staged__isnull=False).exists():
            raise ValidationError({"staged": f"{staged.name} has a staged side of its own."})
        # One endpoint is the standby of one pair: else a rollback of one pair stops the other's live side.
        if GatewayEndpoint.objects.filter(staged=staged).exclude(endpoint=endpoint).exists():
            raise ValidationError({"staged": f"{staged.name} is already the staged side of another endpoint."})
        if gw.staged_id and gw.serving == GatewayEndpoint.Serving.STAGED:
            raise ValidationError({"staged": "The staged side is serving: roll back or wait for the drain first."})
        if gw.stop_idle_at and gw.staged_id != staged.pk:
            raise ValidationError(
                {
                    "staged": f"{gw.staged.name if gw.staged else 'The previous staged side'} is "
                    "draining after a rollback: stage another once it has stopped."
                }
            )
        gw.staged, gw.serving, gw.stop_idle_at, gw.canary_percent = staged, GatewayEndpoint.Serving.LIVE, None, 0
        if drain is not None:
            gw.drain_seconds = drain
        gw.save()
        audit_log(
            actor=actor, action="gateway.stage", obj=endpoint, request=request, via=via, changes={"staged": staged.name}
        )
    return gw


def _move(endpoint: Endpoint, to: str, *, actor, request, via, extra: dict | None = None) -> GatewayEndpoint:
    """All traffic to one side; the other side stops after the drain. A canary's share ends:
    a rollback while the live side serves with a canary is the canary's abort. An automatic
    rollout ends too (else the controller would start the canary again after a rollback)."""
    with transaction.atomic():
        gw = _pair(endpoint)
        if gw.staged is None:
            raise ValidationError(f"{endpoint.name} has no staged deployment.")
        if gw.serving == to and not (to == GatewayEndpoint.Serving.LIVE and gw.canary_percent):
            raise ValidationError(f"Traffic already goes to the {to} side.")
        target = gw.staged if to == GatewayEndpoint.Serving.STAGED else gw.endpoint
        if not _ready(target):
            raise ValidationError(f"{target.name} has no ready replica: traffic stays where it is.")
        canary_was, auto_was = gw.canary_percent, gw.rollout_auto
        gw.serving, gw.switched_at, gw.canary_percent, gw.rollout_auto = to, timezone.now(), 0, False
        gw.canary_set_at = gw.switched_at
        gw.stop_idle_at = gw.switched_at + timedelta(seconds=gw.drain_seconds)
        gw.save()
        audit_log(
            actor=actor,
            action="gateway.switch" if to == GatewayEndpoint.Serving.STAGED else "gateway.rollback",
            obj=endpoint,
            request=request,
            via=via,
            changes={
                "serving": target.name,
                "drain_seconds": gw.drain_seconds,
                **({"canary_percent": [canary_was, 0]} if canary_was else {}),
                **({"rollout_auto": [True, False]} if auto_was else {}),
                **(extra or {}),
            },
        )
    return gw


def set_engine_headers(
    *, endpoint: Endpoint, allowed: bool, actor=None, request=None, via: str = ""
) -> GatewayEndpoint:
    """Whether the endpoint's replicas get the clients' X-data-parallel-rank and X-Vllm-Priority (vLLM's routing
    headers): off by default, a client could otherwise pin itself to one rank or put itself ahead of others."""
    if not isinstance(allowed, bool):
        raise ValidationError({"allowed": "allowed must be true or false."})
    with transaction.atomic():
        gw = _pair(endpoint)
        if gw.engine_headers == allowed:
            return gw
        gw.engine_headers = allowed
        gw.save(update_fields=["engine_headers"])
        audit_log(
            actor=actor,
            action="gateway.engine_headers",
            obj=endpoint,
            request=request,
            via=via,
            changes={"engine_headers": [not allowed, allowed]},
        )
    return gw


def set_canary(
    *, endpoint: Endpoint, percent: int, actor=None, request=None, via: str = "", extra: dict | None = None
) -> GatewayEndpoint:
    """Send `percent` (1-99) of the endpoint's requests to its staged deployment while the live one
    keeps the rest; 0 ends the canary (the staged side idle again, still running). Switch and
    Rollback end it too. `extra`: more for the audit row (the rollout controller's figures)."""
    percent = int_in_range(
        percent, "percent", low=0, high=99, message="percent must be a whole number from 1 to 99 (0 ends the canary)."
    )
    if percent is None:
        raise ValidationError({"percent": "Give percent: a whole number from 1 to 99 (0 ends the canary)."})
    with transaction.atomic():
        gw = _pair(endpoint)
        if gw.staged is None:
            raise ValidationError({"staged": f"{endpoint.name} has no staged deployment: stage one first."})
        if gw.serving != GatewayEndpoint.Serving.LIVE:
            raise ValidationError(
                {
                    "percent": "The staged side serves all the traffic already: a canary share is "
                    "for a staged deployment before its switch."
                }
            )
        if percent and not _ready(gw.staged):
            raise ValidationError({"staged": f"{gw.staged.name} has no ready replica: no canary share for it yet."})
        before = gw.canary_percent
        if percent == before:
            return gw
        # A staged side draining after a rollback that takes a share again is kept.
        kept = bool(percent and gw.stop_idle_at)
        gw.canary_percent, gw.canary_set_at = percent, timezone.now()
        if kept:
            gw.stop_idle_at = None
        # Ending the canary by hand ends an automatic rollout too (it would hold at 0 forever).
        auto_ended = not percent and gw.rollout_auto
        gw.rollout_auto = gw.rollout_auto and bool(percent)
        gw.save(update_fields=["canary_percent", "canary_set_at", "stop_idle_at", "rollout_auto"])
        audit_log(
            actor=actor,
            action="gateway.canary",
            obj=endpoint,
            request=request,
            via=via,
            changes={
                "staged": gw.staged.name,
                "canary_percent": [before, percent],
                **({"drain_cancelled": True} if kept else {}),
                **({"rollout_auto": [True, False]} if auto_ended else {}),
                **(extra or {}),
            },
        )
    return gw


def switch(
    *, endpoint: Endpoint, actor=None, request=None, via: str = "", extra: dict | None = None
) -> GatewayEndpoint:
    """Send the endpoint's traffic to its staged deployment; the live one stops after the drain."""
    return _move(endpoint, GatewayEndpoint.Serving.STAGED, actor=actor, request=request, via=via, extra=extra)


def rollback(
    *, endpoint: Endpoint, actor=None, request=None, via: str = "", extra: dict | None = None
) -> GatewayEndpoint:
    """Send the traffic back to the live deployment (it must still be ready: within the drain)."""
    return _move(endpoint, GatewayEndpoint.Serving.LIVE, actor=actor, request=request, via=via, extra=extra)


# --- SLO-gated rollout settings ------------------------------------------------------------------


def _steps(value) -> list[int]:
    """The step plan: shares (%) rising from 1, ending at 100 (the promotion), given as a list or
    as text ("10,25,50,100"); blank: the default plan. A plan rather than a step size: the first
    share is the one that matters for the blast radius (small), the later ones can be coarse."""
    message = (
        "steps must be shares in percent, rising, each from 1 to 100, ending at 100 and with at least one "
        "below it (e.g. 10,25,50,100)."
    )
    if value in (None, ""):
        return default_rollout_steps()
    if isinstance(value, str):
        value = [v for v in value.replace(" ", ",").split(",") if v]
    if not isinstance(value, list | tuple) or not 2 <= len(value) <= 20:
        raise ValidationError({"steps": message})
    steps = [int_in_range(v, "steps", low=1, high=100, message=message) for v in value]
    if any(b <= a for a, b in zip(steps, steps[1:], strict=False)) or steps[-1] != 100:
        raise ValidationError({"steps": message})
    return steps


def set_rollout(
    *,
    endpoint: Endpoint,
    p99_ms: int | None,
    error_pct: float | None,
    ttft_p99_ms: int | None,
    window_seconds: int | None,
    steps,
    auto: bool,
    actor=None,
    request=None,
    via: str = "",
) -> GatewayEndpoint:
    """The pair's SLO thresholds (each optional), evaluation window, step plan and automatic rollout.
    Turning `auto` on with no canary share yet starts one at the plan's first share. All or nothing:
    a bad value changes nothing."""
    values = {
        "slo_p99_ms": int_in_range(
            p99_ms,
            "p99_ms",
            low=1,
            high=3_600_000,
            message="p99_ms must be a whole number of milliseconds from 1 to 3600000 (blank: not checked).",
        ),
        "slo_error_pct": float_in_range(
            error_pct,
            "error_pct",
            low=0,
            high=100,
            message="error_pct must be a percentage from 0 to 100 (blank: not checked).",
        ),
        "slo_ttft_p99_ms": int_in_range(
            ttft_p99_ms,
            "ttft_p99_ms",
            low=1,
            high=3_600_000,
            message="ttft_p99_ms must be a whole number of milliseconds from 1 to 3600000 (blank: not checked).",
        ),
        "rollout_window_seconds": int_in_range(
            window_seconds,
            "window_seconds",
            low=10,
            high=86_400,
            default=300,
            message="window_seconds must be a whole number of seconds from 10 to 86400.",
        ),
        "rollout_steps": _steps(steps),
        "rollout_auto": bool(auto),
    }
    with transaction.atomic():
        gw = _pair(endpoint)
        if values["rollout_auto"]:
            if gw.staged_id is None:
                raise ValidationError({"auto": f"{endpoint.name} has no staged deployment: stage one first."})
            if gw.serving != GatewayEndpoint.Serving.LIVE:
                raise ValidationError({"auto": "The staged side serves all the traffic already: nothing to roll out."})
            if all(values[f] is None for f in ("slo_p99_ms", "slo_error_pct", "slo_ttft_p99_ms")):
                raise ValidationError(
                    {
                        "auto": "Set at least one threshold (p99_ms, error_pct or ttft_p99_ms) "
                        "before an automatic rollout."
                    }
                )
        before = {f: getattr(gw, f) for f in values}
        for f, v in values.items():
            setattr(gw, f, v)
        gw.save(update_fields=list(values))
        changed = {f: [before[f], v] for f, v in values.items() if before[f] != v}
        if changed:
            audit_log(actor=actor, action="gateway.rollout", obj=endpoint, request=request, via=via, changes=changed)
        if gw.rollout_auto and not gw.canary_percent:
            # Its own audit row (gateway.canary); a staged side not ready raises and undoes the settings too.
            gw = set_canary(
                endpoint=endpoint,
                percent=gw.rollout_steps[0],
                actor=actor,
                request=request,
                via=via,
                extra={"rollout": "first step"},
            )
    return gw
