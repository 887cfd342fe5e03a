"""The serving controller's evaluators: each reads stored telemetry and applies what it decides,
in one place (`manage.py serving_controller` calls `run_once` in a loop): SLO-gated rollouts and
autoscaling (endpoints/autoscale.py's policy on the replicas' queued requests).

An endpoint in advisory mode (Endpoint.advisory) is evaluated the same way, and what would be done is recorded
as an `advisory-autoscale` or `advisory-rollout` event with its figures instead: nothing is claimed, scaled,
shifted or stored.

Every applied decision is an endpoint event (on the live endpoint's page) with its figures and an
audit row as the system user (actor none, via "controller"). Two controllers never apply one step
twice: a decision is claimed by an update() conditioned on the state it was made from (the share and
when it was set); the loser finds no row and leaves it."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import transaction

from console.validation import error_text
from endpoints import autoscale
from endpoints.gateway import services
from endpoints.gateway.eval_gate import gated
from endpoints.gateway.models import GatewayEndpoint
from endpoints.gateway.rollout import HOLD, PROMOTE, ROLLBACK, Decision, Thresholds, decide
from endpoints.gateway.selectors import auto_rollouts, gateway_samples
from endpoints.models import Endpoint, EndpointEvent
from endpoints.replica_state import DEVICE_FAULT, event, refresh_endpoint_state
from endpoints.selectors import autoscaled_endpoints, load_samples
from endpoints.services import endpoint_scale, endpoint_scale_role
from workers.telemetry.services import Reading, store

log = logging.getLogger("console.controller")
VIA = "controller"


def rollout_decision(gw: GatewayEndpoint, now: float) -> Decision:
    """The pure policy's decision for one pair, from its stored telemetry."""
    assert gw.staged_id is not None  # auto_rollouts() yields pairs with a staged side
    window = gw.rollout_window_seconds
    since = now - window
    return decide(
        thresholds=Thresholds(p99_ms=gw.slo_p99_ms, error_pct=gw.slo_error_pct, ttft_p99_ms=gw.slo_ttft_p99_ms),
        window_s=window,
        steps=list(gw.rollout_steps or []),
        current=gw.canary_percent,
        last_step_at=gw.canary_set_at.timestamp() if gw.canary_set_at else None,
        now=now,
        staged=gateway_samples(gw.staged_id, since=since, until=now),
        live=gateway_samples(gw.endpoint_id, since=since, until=now),
        min_requests=settings.GATEWAY_ROLLOUT_MIN_REQUESTS,
    )


def _claim(gw: GatewayEndpoint, now: float) -> bool:
    """Take the decision made from `gw`'s state: 1 row only if nobody moved the pair meanwhile."""
    return (
        GatewayEndpoint.objects.filter(
            pk=gw.pk,
            rollout_auto=True,
            serving=GatewayEndpoint.Serving.LIVE,
            staged_id=gw.staged_id,
            canary_percent=gw.canary_percent,
            canary_set_at=gw.canary_set_at,
        ).update(canary_set_at=datetime.fromtimestamp(now, UTC))
        == 1
    )


def apply_rollout(gw: GatewayEndpoint, decision: Decision, now: float) -> bool:
    """Apply a step, promotion or rollback; False if another controller (or an operator) got there
    first or the move was refused (that is an event too: the pair stays as it was)."""
    extra = {"rollout": decision.as_dict()}
    try:
        with transaction.atomic():
            if not _claim(gw, now):
                return False
            if decision.action == ROLLBACK:
                services.rollback(endpoint=gw.endpoint, via=VIA, extra=extra)
            elif decision.action == PROMOTE:
                services.switch(endpoint=gw.endpoint, via=VIA, extra=extra)
            else:
                services.set_canary(endpoint=gw.endpoint, percent=decision.share, via=VIA, extra=extra)
    except ValidationError as exc:
        message = f"rollout {decision.action} to {decision.share} % refused: {error_text(exc)} ({decision.reason})"
        # Tried again every pass until it goes through: one event per refusal, not one per pass.
        last = EndpointEvent.objects.filter(endpoint_id=gw.endpoint_id, kind="rollout").order_by("-pk").first()
        if last is None or last.message != message:
            event(gw.endpoint_id, "rollout", message, level="warning")
        return False
    assert gw.staged is not None  # auto_rollouts() yields pairs with a staged side
    event(
        gw.endpoint_id,
        "rollout",
        f"rollout {decision.action}: {decision.reason}; "
        f"staged {gw.staged.name} now at {decision.share} %. Figures: {_figures_text(decision.figures)}",
        level="warning" if decision.action == ROLLBACK else "info",
    )
    return True


def _figures_text(figures: dict) -> str:
    s, live = figures["staged"], figures["live"]
    return (
        f"staged {s['requests']} requests, P99 {s['p99_ms']} ms, TTFT P99 {s['ttft_p99_ms']} ms, "
        f"errors {s['error_pct']} %; live {live['requests']} requests, P99 {live['p99_ms']} ms, "
        f"TTFT P99 {live['ttft_p99_ms']} ms, errors {live['error_pct']} %; window "
        f"{figures['window_end'] - figures['window_start']} s"
    )


def evaluate_rollouts(now: float | None = None) -> list[tuple[GatewayEndpoint, Decision, bool]]:
    """One pass over the pairs with an automatic rollout: (pair, decision, applied) each."""
    now = time.time() if now is None else now
    out = []
    for gw in auto_rollouts():
        decision = gated(gw, rollout_decision(gw, now), now)  # an accuracy gate may hold or roll back
        if gw.endpoint.advisory:  # show, don't act
            if decision.action != HOLD:
                advise(
                    gw.endpoint_id,
                    ADVISORY_ROLLOUT,
                    f"would {decision.action} {gw.staged.name} to {decision.share} %",
                    f"{decision.reason}. Figures: {_figures_text(decision.figures)}",
                )
            out.append((gw, decision, False))
            continue
        applied = decision.action != HOLD and apply_rollout(gw, decision, now)
        out.append((gw, decision, applied))
    return out


def autoscale_decision(endpoint: Endpoint, now: float) -> autoscale.Decision | None:
    """The pure policy's decision for one endpoint, from its stored load samples and its replicas' states; None
    where its stored settings are empty ({}: autoscaling off, which the selector's isnull lets through)."""
    scaling = autoscale.parse_settings(endpoint.autoscale)
    if scaling is None:
        return None
    gap = 3 * settings.TELEMETRY_INTERVAL_SECONDS  # a pass or two missed is no hole in the window
    since = now - max(scaling.scale_up_window_s, scaling.scale_down_window_s) - gap
    S = Endpoint.State
    counted = list(
        endpoint.replica_set.filter(index__lt=endpoint.replicas).values_list(
            "index", "state", "state_reason", "ready_at"
        )
    )
    # Held off a faulty device (PENDING with the fault as its reason) is not starting: it waits on the chip.
    starting = {
        i
        for i, state, why, _ in counted
        if state == S.STARTING or (state == S.PENDING and not why.startswith(DEVICE_FAULT))
    }
    last_serves = any(i == endpoint.replicas - 1 and state == S.READY for i, state, _, _ in counted)
    stays_unserving = sum(
        1 for i, state, _, _ in counted if i < endpoint.replicas - 1 and state != S.READY and i not in starting
    )
    return autoscale.decide(
        settings=scaling,
        now=datetime.fromtimestamp(now, UTC),
        current=endpoint.replicas,
        last_change_at=endpoint.scaled_at,
        samples=load_samples(endpoint.pk, since=since, until=now),
        tz=settings.TIME_ZONE,
        max_gap_s=gap,
        starting=len(starting),
        serving_since=max((ready for *_, ready in counted if ready), default=None),
        stays_unserving=stays_unserving if last_serves else 0,
    )


def evaluate_autoscaling(now: float | None = None) -> list[tuple[Endpoint, autoscale.Decision, bool]]:
    """One pass over the autoscaled endpoints: (endpoint, decision, applied) each. A change goes through
    endpoints.services.endpoint_scale (claimed on the count and scaled_at read here, an event with the
    figures, an audit row as the system user); a scale-up with no free devices is recorded as wanted
    and shown as the endpoint's reason; scale-down drains (ReplicaWorkload.drained)."""
    now = time.time() if now is None else now
    out = []
    for endpoint in autoscaled_endpoints():
        if endpoint.roles:  # prefill and decode, each on its own signal
            out += evaluate_role_autoscaling(endpoint, now)
            continue
        try:
            decision = autoscale_decision(endpoint, now)
            if decision is None:
                continue
        except ValidationError as exc:  # stored settings that no longer parse: say so once, leave it
            message = f"autoscale settings refused: {error_text(exc)}"
            last = EndpointEvent.objects.filter(endpoint_id=endpoint.pk, kind="autoscale").order_by("-pk").first()
            if last is None or last.message != message:
                event(endpoint.pk, "autoscale", message, level="warning")
            continue
        applied = False
        if endpoint.advisory:  # show, don't act: the decision and its figures as an event, no scale, no reading
            if decision.action != autoscale.HOLD:
                figures = {k: v for k, v in decision.figures.items() if v is not None}
                advise(
                    endpoint.pk,
                    ADVISORY_AUTOSCALE,
                    f"would scale {decision.action} {decision.current} → {decision.wanted} replica(s)",
                    f"{decision.reason}. Figures: " + ", ".join(f"{k} {v}" for k, v in figures.items()),
                )
            out.append((endpoint, decision, False))
            continue
        if decision.action != autoscale.HOLD or (endpoint.autoscale_wanted and not decision.cooling):
            # A hold (outside cooldown) clears a scale-up that was waiting for devices.
            figures = {k: v for k, v in decision.figures.items() if v is not None}
            endpoint, applied = endpoint_scale(
                endpoint=endpoint,
                replicas=decision.wanted,
                via=VIA,
                reason=decision.reason,
                figures=figures,
                at=datetime.fromtimestamp(now, UTC),
            )
            refresh_endpoint_state(endpoint)
        record_scaling(endpoint, decision, now)
        out.append((endpoint, decision, applied))
    return out


def evaluate_role_autoscaling(endpoint: Endpoint, now: float) -> list[tuple[Endpoint, autoscale.Decision, bool]]:
    """One pass over a disaggregated endpoint's roles (endpoints.autoscale.decide_role): each role's samples from its
    own replicas' series, its count from Endpoint.roles; the first change goes through
    endpoints.services.endpoint_scale_role (one step; the endpoint's cooldown then holds the other role too)."""
    try:
        roles = autoscale.parse_role_settings(endpoint.autoscale)
    except ValidationError as exc:
        message = f"autoscale settings refused: {error_text(exc)}"
        last = EndpointEvent.objects.filter(endpoint_id=endpoint.pk, kind="autoscale").order_by("-pk").first()
        if last is None or last.message != message:
            event(endpoint.pk, "autoscale", message, level="warning")
        return []
    if roles is None:  # autoscale off (None or {}): nothing to scale
        return []
    gap = 3 * settings.TELEMETRY_INTERVAL_SECONDS
    out = []
    for name, role in roles.items():
        counted = list(
            endpoint.replica_set.filter(index__lt=endpoint.replicas, role=name).values_list(
                "index", "state", "ready_at"
            )
        )
        since = now - max(role.settings.scale_up_window_s, role.settings.scale_down_window_s) - gap
        placements = endpoint.roles
        assert placements is not None  # a disaggregated endpoint's roles (the caller's check), kept by each scale step
        decision = autoscale.decide_role(
            role=role,
            samples=load_samples(endpoint.pk, since=since, until=now, replicas=[i for i, _, _ in counted]),
            now=datetime.fromtimestamp(now, UTC),
            current=placements[name]["replicas"],
            last_change_at=endpoint.scaled_at,
            tz=settings.TIME_ZONE,
            max_gap_s=gap,
            starting=sum(1 for _, state, _ in counted if state in (Endpoint.State.STARTING, Endpoint.State.PENDING)),
            serving_since=max((ready for *_, ready in counted if ready), default=None),
        )
        applied = False
        if decision.action != autoscale.HOLD and endpoint.advisory:  # show, don't act (as evaluate_autoscaling)
            figures = {k: v for k, v in decision.figures.items() if v is not None}
            advise(
                endpoint.pk,
                ADVISORY_AUTOSCALE,
                f"would scale {name} {decision.action} {decision.current} → {decision.wanted} replica(s)",
                f"{decision.reason}. Figures: " + ", ".join(f"{k} {v}" for k, v in figures.items()),
            )
        elif decision.action != autoscale.HOLD:
            endpoint, applied, why_not = endpoint_scale_role(
                endpoint=endpoint,
                role=name,
                replicas=decision.wanted,
                via=VIA,
                reason=decision.reason,
                figures={k: v for k, v in decision.figures.items() if v is not None},
                at=datetime.fromtimestamp(now, UTC),
            )
            if why_not:
                last = EndpointEvent.objects.filter(endpoint_id=endpoint.pk, kind="autoscale").order_by("-pk").first()
                message = f"{name} wants {decision.wanted}, has {decision.current}: {why_not}"
                if last is None or last.message != message:
                    event(endpoint.pk, "autoscale", message, level="warning")
            if applied:
                refresh_endpoint_state(endpoint)
        out.append((endpoint, decision, applied))
    return out


ADVISORY_AUTOSCALE, ADVISORY_ROLLOUT = "advisory-autoscale", "advisory-rollout"


def advise(endpoint_id: int, kind: str, would: str, why: str) -> None:
    """Advisory mode's record: what the controller would do, as an endpoint event with its figures. One event per
    change of what it would do (the same advice pass after pass is one event, not one per pass)."""
    last = EndpointEvent.objects.filter(endpoint_id=endpoint_id, kind=kind).order_by("-pk").first()
    if last is not None and last.message.startswith(f"advisory: {would}:"):
        return
    event(endpoint_id, kind, f"advisory: {would}: {why} (advisory mode: nothing changed)")


def record_scaling(endpoint: Endpoint, decision: autoscale.Decision, now: float) -> None:
    """The figures the endpoint page charts against each other, one point per pass: replicas wanted (what
    the policy asks, past what fits), the count applied, those ready, and the queue it decided on."""
    ready = endpoint.replica_set.filter(state=Endpoint.State.READY, index__lt=endpoint.replicas).count()
    values = {
        "as.wanted": endpoint.autoscale_wanted or endpoint.replicas,
        "as.replicas": endpoint.replicas,
        "as.ready": ready,
        "as.waiting": decision.figures.get("waiting_avg_up"),
    }
    store(
        [
            Reading(
                key=f"e{endpoint.pk}.{metric}", metric=metric, value=value, endpoint_id=endpoint.pk, label="autoscaling"
            )
            for metric, value in values.items()
            if value is not None
        ],
        ts=now,
    )


# The controller's loop body: each evaluator makes and applies its own decisions, one pass per call. Other parts
# of serving add theirs (register_evaluator, from EndpointsConfig.ready: tuning's leftover trial replicas).
EVALUATORS: list[Callable[..., list]] = [evaluate_rollouts, evaluate_autoscaling]


def register_evaluator(evaluator: Callable[..., list]) -> None:
    if evaluator not in EVALUATORS:
        EVALUATORS.append(evaluator)


def run_once(now: float | None = None) -> dict[str, list]:
    """One pass of every evaluator; one failing (the database gone for a moment) leaves the others."""
    results = {}
    for evaluator in EVALUATORS:
        try:
            results[evaluator.__name__] = evaluator(now)
        except Exception:
            log.exception("serving controller: %s failed", evaluator.__name__)
            results[evaluator.__name__] = []
    return results
