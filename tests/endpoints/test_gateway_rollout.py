"""SLO-gated rollouts: the pure policy (endpoints/gateway/rollout.py) on recorded series, the
controller's one pass (endpoints/gateway/controller.py) against the real database with telemetry
stored by the gateway's own store function, and the API and form refusing bad settings."""

import time
from datetime import UTC, datetime, timedelta

import pytest
from django.core.management import call_command

from console.models import AuditEvent
from endpoints.gateway import services
from endpoints.gateway.controller import apply_rollout, evaluate_rollouts, rollout_decision, run_once
from endpoints.gateway.models import GatewayEndpoint
from endpoints.gateway.rollout import HOLD, PROMOTE, ROLLBACK, STEP, Sample, Thresholds, decide, window_figures
from endpoints.gateway.stats import Stats
from endpoints.models import Endpoint, EndpointEvent, Replica
from tests.endpoints.test_gateway_routing import pair

T0 = 1_800_000_000.0
STEPS = [10, 25, 50, 100]


def flushes(start, count, *, every=10, requests=20, p99=0.2, ttft=0.05, errors=0.0):
    """`count` gateway flushes from `start`, `every` seconds apart, each with these figures."""
    return [
        Sample(ts=start + every * (i + 1), requests=requests, p99_s=p99, ttft_p99_s=ttft, error_rate=errors)
        for i in range(count)
    ]


THRESHOLDS = Thresholds(p99_ms=500, error_pct=1.0, ttft_p99_ms=200)


def run(
    staged,
    *,
    thresholds=THRESHOLDS,
    window=60,
    current=10,
    last_step=T0,
    now=T0 + 60,
    live=(),
    min_requests=50,
    steps=STEPS,
):
    return decide(
        thresholds=thresholds,
        window_s=window,
        steps=steps,
        current=current,
        last_step_at=last_step,
        now=now,
        staged=staged,
        live=list(live),
        min_requests=min_requests,
    )


# --- the pure policy ------------------------------------------------------------------------------


def test_a_clean_whole_window_steps_to_the_next_share_with_its_figures():
    d = run(flushes(T0, 6))
    assert (d.action, d.share) == (STEP, 25)
    staged = d.figures["staged"]
    assert staged == {"requests": 120, "flushes": 6, "error_pct": 0.0, "p99_ms": 200.0, "ttft_p99_ms": 50.0}
    assert d.figures["window_start"] == T0 and d.figures["window_end"] == T0 + 60
    # A share set by hand between the plan's steps goes on to the plan's next one.
    assert run(flushes(T0, 6), current=15).share == 25
    assert run(flushes(T0, 6), current=25).share == 50


def test_the_last_step_promotes():
    d = run(flushes(T0, 6), current=50)
    assert (d.action, d.share) == (PROMOTE, 100)
    assert run(flushes(T0, 6), current=60, steps=[10, 60, 100]).action == PROMOTE


@pytest.mark.parametrize("metric,at,above", [("p99", 0.5, 0.501), ("ttft", 0.2, 0.2005), ("errors", 0.01, 0.0101)])
def test_exactly_at_a_threshold_is_within_and_just_above_is_a_breach(metric, at, above):
    assert run(flushes(T0, 6, **{metric: at})).action == STEP
    d = run(flushes(T0, 6, **{metric: above}))
    assert (d.action, d.share) == (ROLLBACK, 0)
    assert {"p99": "P99 latency", "ttft": "TTFT P99", "errors": "error rate"}[metric] in d.reason


def test_too_few_requests_hold_even_with_a_breach():
    # 49 requests: nothing is decided, not even on a 100 % error rate.
    few = flushes(T0, 7, every=8, requests=7, errors=1.0)
    d = run(few)
    assert (d.action, d.share) == (HOLD, 10) and "49 requests" in d.reason and d.figures["staged"]["requests"] == 49
    # One more request makes the minimum: then the breach counts.
    assert run(few + [Sample(ts=T0 + 59, requests=1, p99_s=0.1, error_rate=1.0)]).action == ROLLBACK
    assert run([]).action == HOLD


def test_a_breach_in_the_middle_of_the_window_rolls_back_before_the_window_is_up():
    good = flushes(T0, 2, requests=30)
    slow = [Sample(ts=T0 + 25, requests=30, p99_s=0.9, ttft_p99_s=0.05, error_rate=0.0)]
    d = run(good + slow + flushes(T0 + 25, 1, requests=30), now=T0 + 40)
    assert d.action == ROLLBACK and "P99 latency 900 ms > 500 ms" in d.reason
    assert d.figures["staged"]["p99_ms"] == 900.0  # the worst flush's P99: an upper bound of the window's
    # The same clean figures 40 s into a 60 s window only hold.
    held = run(flushes(T0, 4, requests=30), now=T0 + 40)
    assert held.action == HOLD and "20 s of the window left" in held.reason


def test_error_rate_is_the_windows_own_not_the_mean_of_flush_rates():
    # 5 errors in 10 requests, then none in 990: 0.5 % over the window (a mean of rates would say 25 %).
    samples = [
        Sample(ts=T0 + 10, requests=10, p99_s=0.1, ttft_p99_s=0.05, error_rate=0.5),
        Sample(ts=T0 + 20, requests=990, p99_s=0.1, ttft_p99_s=0.05, error_rate=0.0),
    ]
    d = run(samples)
    assert d.action == STEP and d.figures["staged"]["error_pct"] == 0.5


def test_a_set_threshold_with_no_figures_holds_and_an_unset_one_is_not_checked():
    no_ttft = [Sample(ts=s.ts, requests=s.requests, p99_s=s.p99_s, error_rate=s.error_rate) for s in flushes(T0, 6)]
    d = run(no_ttft)
    assert d.action == HOLD and "no TTFT P99 figures" in d.reason
    assert run(no_ttft, thresholds=Thresholds(p99_ms=500, error_pct=1.0)).action == STEP
    # A breach of another threshold still rolls back without the TTFT figures.
    assert run([Sample(ts=s.ts, requests=s.requests, p99_s=2.0) for s in no_ttft]).action == ROLLBACK
    assert run(flushes(T0, 6), thresholds=Thresholds()).action == HOLD  # nothing to gate on


def test_the_window_starts_again_at_each_step():
    before = flushes(T0 - 30, 3, p99=5.0, errors=0.5)  # at the old share, before the step at T0
    after = flushes(T0, 3)
    d = run(before + after, now=T0 + 30)  # 30 s after the step: the last 60 s reach back before it
    assert d.action == HOLD and d.figures["staged"]["requests"] == 60  # the breach before the step is not counted
    assert "30 s of the window left" in d.reason
    # A whole clean window after the step: the step's figures alone, and it steps.
    d = run(before + after + flushes(T0 + 30, 3), now=T0 + 60)
    assert d.action == STEP and d.figures["staged"]["requests"] == 120
    # Good figures from before the step do not count towards the new share's minimum either.
    d = run(flushes(T0 - 60, 6) + flushes(T0, 2), now=T0 + 20)
    assert d.action == HOLD and d.figures["staged"]["requests"] == 40 and "40 requests" in d.reason
    # Long after the step the window is the last window_s only: an old breach has aged out.
    old = flushes(T0, 3, p99=5.0)
    recent = flushes(T0 + 100, 6)
    assert run(old + recent, now=T0 + 160).action == STEP
    assert run(old + recent, now=T0 + 30 + 10).action == ROLLBACK


def test_no_share_and_live_figures_are_context_only():
    assert run(flushes(T0, 6), current=0).action == HOLD
    bad_live = flushes(T0, 6, p99=9.0, errors=0.9)
    d = run(flushes(T0, 6), live=bad_live)
    assert d.action == STEP and d.figures["live"]["p99_ms"] == 9000.0 and d.figures["live"]["error_pct"] == 90.0


def test_window_figures_ignore_empty_flushes_and_take_the_worst_p99():
    samples = [
        Sample(ts=1, requests=0, p99_s=99.0),
        Sample(ts=2, requests=5, p99_s=0.3),
        Sample(ts=3, requests=5, p99_s=0.4),
    ]
    assert window_figures(samples, start=0, end=3) == {
        "requests": 10,
        "flushes": 3,
        "error_pct": None,
        "p99_ms": 400.0,
        "ttft_p99_ms": None,
    }


# --- the controller against the database ------------------------------------------------------------


@pytest.fixture
def rollout_pair(admin, settings):
    settings.GATEWAY_TELEMETRY_SECONDS = 10
    settings.GATEWAY_ROLLOUT_MIN_REQUESTS = 50
    blue, green = pair()
    services.stage(endpoint=blue, staged=green, actor=admin)
    services.set_rollout(
        endpoint=blue,
        p99_ms=500,
        error_pct=1.0,
        ttft_p99_ms=None,
        window_seconds=60,
        steps=[10, 25, 50, 100],
        auto=True,
        actor=admin,
    )
    return blue, green


def backdate(blue, seconds=61):
    """The last step `seconds` ago: the window is over (the telemetry itself is stored now)."""
    GatewayEndpoint.objects.filter(endpoint=blue).update(canary_set_at=datetime.now(UTC) - timedelta(seconds=seconds))


def flush(endpoint, *, n, latency=0.1, status=200):
    """One gateway flush of `n` requests to `endpoint`, stored as the gateway stores it."""
    stats = Stats()
    for _ in range(n):
        stats.record(endpoint_id=endpoint.pk, key_id=None, status=status, latency=latency, ttft=0.02, tokens=1)
    services.store_gateway_stats(stats, 10)


def rollout_rows(blue):
    return (
        list(EndpointEvent.objects.filter(endpoint=blue, kind="rollout").values_list("message", flat=True)),
        list(AuditEvent.objects.filter(via="controller").order_by("pk")),
    )


@pytest.mark.django_db
def test_turning_auto_on_starts_at_the_first_step(rollout_pair):
    blue, _ = rollout_pair
    gw = GatewayEndpoint.objects.get(endpoint=blue)
    assert gw.rollout_auto and gw.canary_percent == 10 and gw.canary_set_at is not None
    assert AuditEvent.objects.filter(action="gateway.rollout").count() == 1
    assert AuditEvent.objects.get(action="gateway.canary").changes["canary_percent"] == [0, 10]


@pytest.mark.django_db
def test_a_breach_rolls_back_with_an_event_and_a_system_audit_row(rollout_pair):
    blue, green = rollout_pair
    backdate(blue, 5)  # 5 s into a 60 s window: a breach does not wait for the window's end
    flush(green, n=60, latency=0.8)  # P99 800 ms > 500 ms
    flush(blue, n=500, latency=0.05)
    [(gw, decision, applied)] = evaluate_rollouts(now=time.time() + 1)
    assert decision.action == ROLLBACK and applied
    gw = GatewayEndpoint.objects.get(endpoint=blue)
    assert (gw.serving, gw.canary_percent, gw.rollout_auto) == ("live", 0, False) and gw.stop_idle_at
    events, audits = rollout_rows(blue)
    assert len(events) == 1 and "rollout rollback: breach: P99 latency 800 ms > 500 ms" in events[0]
    assert "live 500 requests" in events[0]
    [audit] = audits
    assert audit.action == "gateway.rollback" and audit.actor is None and audit.actor_name == ""
    assert audit.changes["rollout"]["figures"]["staged"]["p99_ms"] == 800.0
    assert audit.changes["rollout"]["figures"]["staged"]["requests"] == 60
    assert audit.changes["canary_percent"] == [10, 0] and audit.changes["rollout_auto"] == [True, False]
    # Auto is off after a rollback: the next pass leaves the pair alone.
    assert evaluate_rollouts(now=time.time() + 2) == []


@pytest.mark.django_db
def test_good_figures_step_once_and_the_window_starts_again(rollout_pair):
    blue, green = rollout_pair
    backdate(blue)
    flush(green, n=60, latency=0.1)
    [(_, decision, applied)] = evaluate_rollouts(now=time.time() + 1)
    assert (decision.action, decision.share, applied) == (STEP, 25, True)
    gw = GatewayEndpoint.objects.get(endpoint=blue)
    assert gw.canary_percent == 25 and gw.serving == "live"
    events, [audit] = rollout_rows(blue)
    assert "rollout step" in events[0] and "now at 25 %" in events[0]
    assert audit.action == "gateway.canary" and audit.actor is None and audit.changes["canary_percent"] == [10, 25]
    # Right after the step the figures earned at 10 % no longer count: hold, nothing applied.
    [(_, again, applied)] = evaluate_rollouts(now=time.time() + 2)
    assert again.action == HOLD and not applied and again.figures["staged"]["requests"] == 0
    assert GatewayEndpoint.objects.get(endpoint=blue).canary_percent == 25


@pytest.mark.django_db
def test_two_controllers_never_apply_one_step_twice(rollout_pair):
    blue, green = rollout_pair
    backdate(blue)
    flush(green, n=60)
    now = time.time() + 1
    seen = list(GatewayEndpoint.objects.filter(endpoint=blue).select_related("endpoint", "staged"))[0]
    decision = rollout_decision(seen, now)
    assert decision.action == STEP
    assert apply_rollout(seen, decision, now) is True
    assert apply_rollout(seen, decision, now) is False  # the same decision from the same stale state
    assert GatewayEndpoint.objects.get(endpoint=blue).canary_percent == 25
    assert AuditEvent.objects.filter(via="controller").count() == 1
    assert EndpointEvent.objects.filter(endpoint=blue, kind="rollout").count() == 1


@pytest.mark.django_db
def test_the_last_step_switches(rollout_pair):
    blue, green = rollout_pair
    services.set_canary(endpoint=blue, percent=50)
    backdate(blue)
    flush(green, n=60)
    call_command("serving_controller", "--once")
    gw = GatewayEndpoint.objects.get(endpoint=blue)
    assert (gw.serving, gw.canary_percent, gw.rollout_auto) == ("staged", 0, False)
    events, [audit] = rollout_rows(blue)
    assert "rollout promote" in events[0] and audit.action == "gateway.switch" and audit.actor is None
    assert audit.changes["rollout"]["action"] == "promote"


@pytest.mark.django_db
def test_too_little_traffic_changes_nothing(rollout_pair):
    blue, green = rollout_pair
    backdate(blue)
    flush(green, n=4, latency=5.0)  # 4 slow requests: no evidence either way
    results = run_once(now=time.time() + 1)
    [(_, decision, applied)] = results["evaluate_rollouts"]
    assert decision.action == HOLD and not applied and "4 requests" in decision.reason
    gw = GatewayEndpoint.objects.get(endpoint=blue)
    assert (gw.serving, gw.canary_percent, gw.rollout_auto) == ("live", 10, True)
    assert rollout_rows(blue) == ([], [])


@pytest.mark.django_db
def test_a_refused_move_is_an_event_and_changes_nothing(rollout_pair):
    blue, green = rollout_pair
    backdate(blue)
    flush(green, n=60)
    Replica.objects.filter(endpoint=green).update(state=Endpoint.State.STARTING)
    [(_, decision, applied)] = evaluate_rollouts(now=time.time() + 1)
    assert decision.action == STEP and not applied
    assert GatewayEndpoint.objects.get(endpoint=blue).canary_percent == 10
    [message] = EndpointEvent.objects.filter(endpoint=blue, kind="rollout", level="warning").values_list(
        "message", flat=True
    )
    assert "refused" in message and "c-green has no ready replica" in message
    assert not AuditEvent.objects.filter(via="controller").exists()
    # Tried again on the next pass, still refused: no second event for the same refusal.
    evaluate_rollouts(now=time.time() + 2)
    assert EndpointEvent.objects.filter(endpoint=blue, kind="rollout").count() == 1
    # Once the staged side is ready again the step goes through.
    Replica.objects.filter(endpoint=green).update(state=Endpoint.State.READY)
    [(_, decision, applied)] = evaluate_rollouts(now=time.time() + 3)
    assert applied and GatewayEndpoint.objects.get(endpoint=blue).canary_percent == 25


# --- settings through the API and the form --------------------------------------------------------------


@pytest.mark.django_db
def test_rollout_api_refuses_bad_input_naming_the_field_and_changes_nothing(operator, viewer, admin, api_for):
    blue, green = pair()
    api = api_for(operator)
    url = f"/api/v1/gateway/endpoints/{blue.pk}/rollout"
    no_pair = api.post(url, {"p99_ms": 500, "auto": True})
    assert no_pair.status_code == 400 and "auto" in no_pair.json()["errors"], no_pair.content
    services.stage(endpoint=blue, staged=green, actor=admin)
    for body, status, field in [
        ({"steps": [50, 25, 100]}, 400, "steps"),
        ({"steps": [10, 50]}, 400, "steps"),
        ({"steps": [100]}, 400, "steps"),
        ({"steps": [0, 100]}, 400, "steps"),
        ({"steps": "10,x,100"}, 400, "steps"),
        ({"p99_ms": 0}, 400, "p99_ms"),
        ({"error_pct": 150}, 400, "error_pct"),
        ({"ttft_p99_ms": -5}, 400, "ttft_p99_ms"),
        ({"window_seconds": 5}, 400, "window_seconds"),
        ({"auto": True}, 400, "auto"),
        ({"p99_ms": "fast"}, 422, "p99_ms"),
        ({"p99_ms": 500, "speed": 1}, 422, "speed"),
    ]:
        refused = api.post(url, body)
        assert refused.status_code == status and field in refused.content.decode(), (body, refused.content)
    gw = GatewayEndpoint.objects.get(endpoint=blue)
    assert (gw.slo_p99_ms, gw.rollout_steps, gw.rollout_auto, gw.canary_percent) == (None, [10, 25, 50, 100], False, 0)
    assert not AuditEvent.objects.filter(action__in=["gateway.rollout", "gateway.canary"]).exists()
    assert api_for(viewer).post(url, {"p99_ms": 500}).status_code == 403

    ok = api.post(url, {"p99_ms": 500, "error_pct": 2.5, "window_seconds": 120, "steps": [5, 50, 100], "auto": True})
    assert ok.status_code == 200, ok.content
    assert ok.json()["rollout"] | {"canary_set_at": None} == {
        "p99_ms": 500,
        "error_pct": 2.5,
        "ttft_p99_ms": None,
        "window_seconds": 120,
        "steps": [5, 50, 100],
        "auto": True,
        "canary_set_at": None,
    }
    assert ok.json()["canary_percent"] == 5  # started at the plan's first share
    audit = AuditEvent.objects.get(action="gateway.rollout")
    assert audit.actor == operator and audit.changes["slo_p99_ms"] == [None, 500]
    # Fields left out keep their value; null clears a threshold.
    kept = api.post(url, {"error_pct": None}).json()["rollout"]
    assert kept["p99_ms"] == 500 and kept["error_pct"] is None and kept["auto"] is True
    # A rollback by hand ends the automatic rollout.
    api.post(f"/api/v1/gateway/endpoints/{blue.pk}/rollback")
    assert GatewayEndpoint.objects.get(endpoint=blue).rollout_auto is False


@pytest.mark.django_db
def test_rollout_form_on_the_endpoint_page(as_operator, as_viewer, admin):
    blue, green = pair()
    services.stage(endpoint=blue, staged=green, actor=admin)
    page = as_operator.get(f"/endpoints/{blue.pk}/").content.decode()
    assert 'id="rollout-form"' in page and 'value="10,25,50,100"' in page
    url = f"/gateway/endpoints/{blue.pk}/rollout"
    bad = as_operator.post(
        url, {"p99_ms": "400", "steps": "25,10,100", "window_seconds": "60", "auto": "on"}, follow=True
    )
    assert "steps must be shares in percent" in bad.content.decode()
    assert GatewayEndpoint.objects.get(endpoint=blue).slo_p99_ms is None
    assert as_viewer.post(url, {"p99_ms": "400"}).status_code == 403
    ok = as_operator.post(
        url,
        {
            "p99_ms": "400",
            "error_pct": "",
            "ttft_p99_ms": "300",
            "steps": "20, 60, 100",
            "window_seconds": "90",
            "auto": "on",
        },
        follow=True,
    )
    assert "automatic, the staged side at 20 %" in ok.content.decode()
    gw = GatewayEndpoint.objects.get(endpoint=blue)
    assert (
        gw.slo_p99_ms,
        gw.slo_error_pct,
        gw.slo_ttft_p99_ms,
        gw.rollout_window_seconds,
        gw.rollout_steps,
        gw.rollout_auto,
        gw.canary_percent,
    ) == (400, None, 300, 90, [20, 60, 100], True, 20)
    assert 'id="rollout-auto"' in ok.content.decode()
