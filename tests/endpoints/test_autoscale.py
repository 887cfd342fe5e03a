"""Autoscaling: the settings' one parser and the pure policy (endpoints/autoscale.py) on recorded
series; the API and form refusing bad settings by field; the controller's pass against the real
database with samples stored as the agent stores them; and the drain of a scaled-down replica at the
reconcile level (a stand-in supervisor, a real HTTP server answering /metrics)."""

import threading
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from django.core.exceptions import ValidationError
from django.test import Client
from django.utils import timezone

from console.models import AuditEvent
from endpoints.autoscale import DOWN, HOLD, UP, Sample, decide, parse_settings
from endpoints.endpoint_spec import EndpointSpec
from endpoints.gateway.controller import evaluate_autoscaling, run_once
from endpoints.gateway.selectors import routing_table
from endpoints.models import Endpoint, EndpointEvent, Replica
from endpoints.reconcile import ReplicaWorkload
from endpoints.services import _checked_autoscale, endpoint_create
from tests.endpoints.test_npu_faults import StandInSupervisor
from workers.models import Device
from workers.telemetry.models import Point, Series

S = Endpoint.State
# Monday 2026-11-30 12:00 UTC
MONDAY_NOON = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


def settings_of(**over):
    return parse_settings(
        {
            "min_replicas": 1,
            "max_replicas": 4,
            "target_waiting": 4,
            "scale_up_window_s": 60,
            "scale_down_window_s": 300,
            "cooldown_s": 120,
            **over,
        }
    )


def series(now, seconds, waiting, every=10, running=0, served=0):
    """Samples every `every` s over the last `seconds` up to `now`, each `waiting` (or waiting(i)), and
    likewise `running` and `served`."""
    end = now.timestamp()
    count = seconds // every

    def at(value, i):
        return value(i) if callable(value) else value

    return [
        Sample(ts=end - seconds + every * i, waiting=at(waiting, i), running=at(running, i), served=at(served, i))
        for i in range(count + 1)
    ]


def run(
    samples,
    *,
    current=1,
    now=MONDAY_NOON,
    last=None,
    tz="UTC",
    starting=0,
    serving_since=None,
    stays_unserving=0,
    **over,
):
    return decide(
        settings=settings_of(**over),
        now=now,
        current=current,
        last_change_at=last,
        samples=samples,
        tz=tz,
        starting=starting,
        serving_since=serving_since,
        stays_unserving=stays_unserving,
    )


# --- the settings ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw, field, message",
    [
        ({"min_replicas": 5, "max_replicas": 4}, "autoscale.min_replicas", "above max_replicas 4"),
        ({"min_replicas": -1, "max_replicas": 4}, "autoscale.min_replicas", "from 0 to 64, not -1"),
        (
            {"max_replicas": 2, "schedule": [{"days": "mon", "from": "08:00", "to": "20:00", "min_replicas": 0}]},
            "autoscale.schedule[0].min_replicas",
            "1 to max_replicas (2)",
        ),
        ({"max_replicas": 65}, "autoscale.max_replicas", "from 1 to 64"),
        ({"min_replicas": 1}, "autoscale.max_replicas", "at most"),
        ({"max_replicas": 2, "target_waiting": 0}, "autoscale.target_waiting", "above 0"),
        ({"max_replicas": 2, "cooldown": 5}, "autoscale.cooldown", "Unknown setting"),
        ({"max_replicas": 2, "scale_up_window_s": 5}, "autoscale.scale_up_window_s", "from 10"),
        (
            {"max_replicas": 2, "schedule": [{"days": "mon-fry", "from": "08:00", "to": "20:00", "min_replicas": 2}]},
            "autoscale.schedule[0].days",
            "'mon-fry' is not a day",
        ),
        (
            {"max_replicas": 2, "schedule": [{"days": "mon", "from": "8am", "to": "20:00", "min_replicas": 2}]},
            "autoscale.schedule[0].from",
            "HH:MM",
        ),
        (
            {"max_replicas": 2, "schedule": [{"days": "mon", "from": "08:00", "to": "25:00", "min_replicas": 2}]},
            "autoscale.schedule[0].to",
            "not a time of day",
        ),
        (
            {"max_replicas": 2, "schedule": [{"days": "mon", "from": "08:00", "to": "20:00", "min_replicas": 3}]},
            "autoscale.schedule[0].min_replicas",
            "1 to max_replicas (2)",
        ),
        ({"max_replicas": 2, "schedule": {"days": "mon"}}, "autoscale.schedule", "A list"),
        ({"max_replicas": 2, "schedule": {}}, "autoscale.schedule", "A list"),
        ({"max_replicas": 2, "schedule": ""}, "autoscale.schedule", "A list"),
        # Whole day names only: a prefix rule read these as Monday alone.
        *[
            (
                {"max_replicas": 2, "schedule": [{"days": days, "from": "08:00", "to": "20:00", "min_replicas": 2}]},
                "autoscale.schedule[0].days",
                "is not a day",
            )
            for days in ("monkey", "mon fri", "mon\u2013fri", "mo-fr")
        ],
    ],
)
def test_bad_settings_are_refused_naming_the_field(raw, field, message):
    with pytest.raises(ValidationError) as exc:
        parse_settings(raw)
    assert field in exc.value.message_dict and message in " ".join(exc.value.message_dict[field])


def test_days_are_short_or_full_names_and_ranges_wrap():
    def days(text):
        entry = {"days": text, "from": "08:00", "to": "20:00", "min_replicas": 1}
        return parse_settings({"max_replicas": 2, "schedule": [entry]}).schedule[0].days

    assert days("mon-fri") == days("Monday - Friday") == days("monday-fri") == frozenset(range(5))
    assert days("sat,sun") == days("saturday, sunday") == frozenset({5, 6})
    assert days("fri-mon") == frozenset({4, 5, 6, 0}) and days("daily") == frozenset(range(7))


def test_settings_round_trip_with_defaults_and_off():
    parsed = parse_settings(
        {"max_replicas": 3, "schedule": [{"days": "mon-fri", "from": "08:00", "to": "20:00", "min_replicas": 2}]}
    )
    assert (parsed.min_replicas, parsed.target_waiting, parsed.scale_up_window_s, parsed.cooldown_s) == (
        1,
        4.0,
        60,
        300,
    )
    assert parse_settings(parsed.as_json()) == parsed
    assert parse_settings(None) is None and parse_settings({}) is None
    assert parse_settings({"min_replicas": 0, "max_replicas": 2}).min_replicas == 0  # scale to zero


# --- the pure policy -------------------------------------------------------------------------------


def test_up_to_the_median_need_of_a_whole_up_window():
    # 10 to 16 queued, target 4 per replica: 10-12 need 3, 13-16 need 4; the median sample needs 4.
    d = run(series(MONDAY_NOON, 60, lambda i: 10 + i))
    assert (d.action, d.wanted) == (UP, 4) and "half the samples or more need 4+" in d.reason
    assert d.figures["waiting_avg_up"] == 13.0 and d.figures["samples"] == 7
    # A snapshot that caught the queue empty (the clients' next requests on their way) changes nothing.
    dip = series(MONDAY_NOON, 60, lambda i: 0 if i == 3 else 12)
    assert (run(dip).action, run(dip).wanted) == (UP, 3)
    # Half the window queued (4 of 7 samples): up; fewer than half: a burst, hold.
    assert run(series(MONDAY_NOON, 60, lambda i: 12 if i % 2 == 0 else 0)).wanted == 3
    assert run(series(MONDAY_NOON, 60, lambda i: 12 if i % 2 == 1 else 0)).action == HOLD
    assert run(series(MONDAY_NOON, 60, lambda i: 400 if i == 3 else 0)).action == HOLD
    # An even count (the controller's pass falls between samples: 6 in the window): exactly half is enough.
    between = MONDAY_NOON - timedelta(seconds=5)
    assert run(series(between, 50, lambda i: 12 if i >= 3 else 0)).figures["samples"] == 6
    assert run(series(between, 50, lambda i: 12 if i >= 3 else 0)).wanted == 3
    assert run(series(between, 50, lambda i: 12 if i >= 4 else 0)).action == HOLD
    # The need over a window that started only 20 s ago (telemetry just began; 30 s is the gap allowed): hold.
    assert run(series(MONDAY_NOON, 20, 12)).action == HOLD


def test_the_need_is_clamped_to_max_and_bounds_move_at_once():
    assert (run(series(MONDAY_NOON, 60, 100)).wanted) == 4  # 25 needed, max 4
    # Above max (settings lowered): down to max at once, even in cooldown and with no data.
    d = run([], current=6, last=MONDAY_NOON - timedelta(seconds=5))
    assert (d.action, d.wanted) == (DOWN, 4) and "above max_replicas" in d.reason
    d = run([], current=1, min_replicas=2, last=MONDAY_NOON - timedelta(seconds=5))
    assert (d.action, d.wanted) == (UP, 2) and "min_replicas 2" in d.reason


def test_cooldown_holds_both_ways_and_ends():
    busy = series(MONDAY_NOON, 300, 12)
    held = run(busy, last=MONDAY_NOON - timedelta(seconds=119))
    assert held.action == HOLD and held.cooling and "cooldown" in held.reason
    assert run(busy, last=MONDAY_NOON - timedelta(seconds=120)).action == UP
    idle = series(MONDAY_NOON, 300, 0)
    assert run(idle, current=3, last=MONDAY_NOON - timedelta(seconds=60)).action == HOLD
    assert run(idle, current=3, last=MONDAY_NOON - timedelta(seconds=121)).action == DOWN


def test_scale_down_after_a_whole_low_window_one_replica_at_a_time():
    d = run(series(MONDAY_NOON, 300, 0), current=3)
    assert (d.action, d.wanted) == (DOWN, 2)
    # 3 queued at some point of the window: 1 replica needed, still fewer than 3: down by one.
    assert run(series(MONDAY_NOON, 300, lambda i: 3 if i == 10 else 0), current=3).wanted == 2
    # 9 queued once in the window needs 3: no scale-down.
    assert run(series(MONDAY_NOON, 300, lambda i: 9 if i == 10 else 0), current=3).action == HOLD
    # Low for the up window only (60 s of 300): hold.
    assert run(series(MONDAY_NOON, 60, 0), current=3).action == HOLD
    # At min already: hold.
    assert run(series(MONDAY_NOON, 300, 0), current=1).action == HOLD
    # A replica of the count still starting (its queue carried by the others meanwhile): no scale-down yet.
    d = run(series(MONDAY_NOON, 300, 0), current=3, starting=1)
    assert d.action == HOLD and "1 replica(s) still starting" in d.reason
    # Nor before the three have served together for a whole window: the samples from before the last one
    # was ready describe two replicas (and a start's CPU taken from them).
    d = run(series(MONDAY_NOON, 300, 0), current=3, serving_since=MONDAY_NOON - timedelta(seconds=2))
    assert d.action == HOLD and "served together for 2 s" in d.reason
    long_ago = MONDAY_NOON - timedelta(seconds=300)
    assert run(series(MONDAY_NOON, 300, 0), current=3, serving_since=long_ago).action == DOWN
    # Nor when the replica it would stop serves and one that would stay does not (crashed, failed).
    d = run(series(MONDAY_NOON, 300, 0), current=3, serving_since=long_ago, stays_unserving=1)
    assert d.action == HOLD and "1 replica(s) that would stay are not serving" in d.reason
    assert "stops replica 2, which serves" in d.reason


def test_missing_data_holds():
    assert run([], current=2).action == HOLD
    gap = [s for s in series(MONDAY_NOON, 300, 0) if not 100 < MONDAY_NOON.timestamp() - s.ts < 200]
    d = run(gap, current=2)
    assert d.action == HOLD and "no complete scale-down window" in d.reason
    stale = series(MONDAY_NOON - timedelta(seconds=60), 300, 20)  # nothing in the last minute
    assert run(stale, current=1).action == HOLD


def test_scale_to_zero_needs_a_whole_idle_window_and_the_cooldown():
    zero = {"min_replicas": 0}
    d = run(series(MONDAY_NOON, 300, 0), **zero)
    assert (d.action, d.wanted) == (DOWN, 0) and "idle for 300 s" in d.reason
    # One request served (vLLM's or the gateway's qps) or running in the window: hold at 1.
    one = run(series(MONDAY_NOON, 300, 0, served=lambda i: 0.1 if i == 20 else 0), **zero)
    assert (one.action, one.wanted) == (HOLD, 1) and "not idle" in one.reason
    assert run(series(MONDAY_NOON, 300, 0, running=lambda i: 1 if i == 5 else 0), **zero).action == HOLD
    # Steady load with an empty queue: need reads 0 throughout, yet no drop to zero.
    steady = run(series(MONDAY_NOON, 300, 0, running=3, served=2.5), **zero)
    assert steady.action == HOLD and steady.wanted == 1
    # vLLM not saying what it runs is not idle; a scrape gap decides nothing.
    assert run(series(MONDAY_NOON, 300, 0, running=None), **zero).action == HOLD
    gap = [s for s in series(MONDAY_NOON, 300, 0) if not 100 < MONDAY_NOON.timestamp() - s.ts < 200]
    assert run(gap, **zero).action == HOLD
    # The gateway's figures alone (no vLLM scrape) fill no window.
    gateway_only = [Sample(ts=s.ts, waiting=0, scraped=False) for s in series(MONDAY_NOON, 300, 0)]
    assert run(gateway_only, **zero).action == HOLD
    # Woken 60 s ago (cooldown 120 s): idle since, still held at 1; from 2 it goes to 1 first.
    cooling = run(series(MONDAY_NOON, 300, 0), last=MONDAY_NOON - timedelta(seconds=60), **zero)
    assert cooling.action == HOLD and cooling.cooling
    assert run(series(MONDAY_NOON, 300, 0), current=2, **zero).wanted == 1


def test_from_zero_requests_held_in_the_gateway_wake_one_replica_at_once():
    zero = {"min_replicas": 0}
    held = [Sample(ts=MONDAY_NOON.timestamp() - 5, waiting=3, scraped=False)]  # the gateway's gw.waiting
    # Past the cooldown (scaled to zero 10 s ago): a client waits.
    d = run(held, current=0, last=MONDAY_NOON - timedelta(seconds=10), **zero)
    assert (d.action, d.wanted) == (UP, 1) and "waking" in d.reason and d.figures["waiting_now"] == 3
    # Nothing waiting, or only long ago: stays at zero.
    assert run([], current=0, **zero).action == HOLD
    old = [Sample(ts=MONDAY_NOON.timestamp() - 120, waiting=3, scraped=False)]
    assert (run(old, current=0, **zero).action, run(old, current=0, **zero).wanted) == (HOLD, 0)
    # The floors still apply at zero: a schedule window lifts it to its floor.
    office = [{"days": "mon-fri", "from": "08:00", "to": "20:00", "min_replicas": 2}]
    assert run([], current=0, schedule=office, **zero).wanted == 2
    assert run(held, current=0, schedule=office, **zero).wanted == 2


def test_schedule_floors_by_weekday_time_zone_and_across_midnight():
    office = [{"days": "mon-fri", "from": "08:00", "to": "20:00", "min_replicas": 3}]
    idle = series(MONDAY_NOON, 300, 0)
    # Monday 12:00 UTC is 13:00 in Paris: within office hours, the floor lifts 1 to 3 at once.
    d = run(idle, schedule=office, tz="Europe/Paris")
    assert (d.action, d.wanted) == (UP, 3) and "schedule floor 3" in d.reason and d.figures["floor"] == 3
    # 19:30 UTC is 20:30 in Paris (out of hours) but 19:30 in UTC (in hours).
    evening = MONDAY_NOON.replace(hour=19, minute=30)
    assert run([], now=evening, schedule=office, tz="Europe/Paris").action == HOLD
    assert run([], now=evening, schedule=office, tz="UTC").wanted == 3
    # Saturday: no floor; and at 3 replicas with an idle window the floor no longer holds them.
    saturday = MONDAY_NOON + timedelta(days=5)
    assert run(series(saturday, 300, 0), now=saturday, current=3, schedule=office).action == DOWN
    # A night entry on Friday crosses into Saturday morning.
    night = [{"days": "fri", "from": "22:00", "to": "02:00", "min_replicas": 2}]
    assert run([], now=saturday.replace(hour=1), schedule=night).wanted == 2
    assert run([], now=saturday.replace(hour=3), schedule=night).action == HOLD
    assert run([], now=(saturday - timedelta(days=1)).replace(hour=23), schedule=night).wanted == 2
    assert run([], now=(saturday - timedelta(days=1)).replace(hour=1), schedule=night).action == HOLD  # Thu night
    # A wrapping day range.
    weekend = [{"days": "sat-sun", "from": "00:00", "to": "23:59", "min_replicas": 2}]
    assert run([], now=saturday, schedule=weekend).wanted == 2 and run([], schedule=weekend).action == HOLD


# --- API, form and service checks ------------------------------------------------------------------

AUTO = {
    "min_replicas": 1,
    "max_replicas": 4,
    "target_waiting": 2,
    "scale_up_window_s": 30,
    "scale_down_window_s": 60,
    "cooldown_s": 30,
}


@pytest.mark.django_db
def test_launch_with_autoscale_holds_devices_for_max_and_starts_at_min(operator, api_for, ascend_node, tiny_artifact):
    api = api_for(operator)
    refused = api.post(
        "/api/v1/endpoints", {"name": "auto", "artifact": tiny_artifact.pk, "devices": [0, 1], "autoscale": AUTO}
    )
    assert refused.status_code == 400
    assert "need 4 devices" in " ".join(refused.json()["errors"]["autoscale.max_replicas"])
    bad = api.post(
        "/api/v1/endpoints",
        {
            "name": "auto",
            "artifact": tiny_artifact.pk,
            "devices": [0, 1, 2, 3],
            "autoscale": {**AUTO, "min_replicas": 5},
        },
    )
    assert bad.status_code == 400 and "autoscale.min_replicas" in bad.json()["errors"]
    assert not Endpoint.objects.exists()
    made = api.post(
        "/api/v1/endpoints",
        {
            "name": "auto",
            "artifact": tiny_artifact.pk,
            "devices": [0, 1, 2, 3],
            "autoscale": {**AUTO, "min_replicas": 2},
        },
    )
    assert made.status_code == 201, made.content
    body = made.json()
    assert body["replica_count"] == 2 and [r["devices"] for r in body["replicas"]] == [[0], [1]]
    assert body["autoscale"]["max_replicas"] == 4 and body["autoscale"]["schedule"] == []
    audit = AuditEvent.objects.get(action="endpoint.launch")
    assert audit.changes["autoscale"]["min_replicas"] == 2
    # Its devices are held for 4 replicas: another endpoint cannot take NPU 3.
    clash = api.post("/api/v1/endpoints", {"name": "other", "artifact": tiny_artifact.pk, "devices": [3]})
    assert clash.status_code == 400 and "In use by another endpoint: 3 (auto)" in clash.json()["detail"]


@pytest.mark.django_db
def test_patch_autoscale_checks_the_pinned_devices_and_is_audited(operator, api_for, ascend_node, tiny_artifact):
    api = api_for(operator)
    made = api.post(
        "/api/v1/endpoints", {"name": "two", "artifact": tiny_artifact.pk, "devices": [0, 1], "replicas": 2}
    )
    url = f"/api/v1/endpoints/{made.json()['id']}"
    too_many = api.patch(url, {"autoscale": {"max_replicas": 3}})
    assert too_many.status_code == 400
    assert "pinned to 2 ([0, 1])" in " ".join(too_many.json()["errors"]["autoscale.max_replicas"])
    schedule = api.patch(
        url,
        {
            "autoscale": {
                "max_replicas": 2,
                "schedule": [{"days": "weekdays", "from": "08:00", "to": "20:00", "min_replicas": 2}],
            }
        },
    )
    assert schedule.status_code == 400 and "autoscale.schedule[0].days" in schedule.json()["errors"]
    assert Endpoint.objects.get().autoscale is None and not AuditEvent.objects.filter(action="endpoint.update").exists()
    on = api.patch(url, {"autoscale": {"max_replicas": 2, "cooldown_s": 60}})
    assert on.status_code == 200 and on.json()["autoscale"]["cooldown_s"] == 60
    audit = AuditEvent.objects.get(action="endpoint.update")
    assert audit.changes["autoscale"][0] is None and audit.changes["autoscale"][1]["max_replicas"] == 2
    page = Client()
    page.force_login(operator)
    shown = page.get(f"/endpoints/{made.json()['id']}/").content.decode()
    assert "between 1 and 2, another one per 4.0 queued requests" in shown and "cooldown 60 s" in shown
    assert 'data-metric="as.wanted,as.ready,as.waiting"' in shown  # replicas wanted and running against the load
    off = api.patch(url, {"autoscale": None})
    assert off.status_code == 200 and off.json()["autoscale"] is None and off.json()["replica_count"] == 2


@pytest.mark.django_db
def test_autoscaling_turned_off_while_scaled_to_zero_leaves_one_replica(
    operator, api_for, ascend_node, tiny_artifact, redis_conn
):
    """At zero replicas only a wake brings an endpoint back, and the gateway wakes autoscaled ones only: turned
    off there, it would serve nothing for good. Its fixed count becomes one (an event and an audit row say
    why); turned off above zero, the count stays."""
    from endpoints.services import endpoint_scale

    api = api_for(operator)
    made = api.post(
        "/api/v1/endpoints",
        {
            "name": "idle",
            "artifact": tiny_artifact.pk,
            "devices": [0, 1],
            "autoscale": {"min_replicas": 0, "max_replicas": 2},
        },
    )
    assert made.status_code == 201, made.content
    endpoint = Endpoint.objects.get(pk=made.json()["id"])
    endpoint, scaled = endpoint_scale(endpoint=endpoint, replicas=0, via="controller", reason="idle")
    assert scaled and endpoint.replicas == 0
    off = api.patch(f"/api/v1/endpoints/{endpoint.pk}", {"autoscale": None})
    assert off.status_code == 200 and off.json()["autoscale"] is None and off.json()["replica_count"] == 1
    scale = AuditEvent.objects.filter(action="endpoint.scale").latest("pk")
    assert scale.actor == operator and scale.changes["replicas"] == [0, 1]
    assert scale.changes["reason"] == "autoscaling turned off while scaled to zero"
    assert endpoint.events.filter(kind="autoscale", message__startswith="scaled up 0 → 1").exists()


@pytest.mark.django_db
def test_multi_node_endpoints_cannot_autoscale_and_cpu_ones_share_the_cores(
    ascend_node, cpu_node, tiny_artifact, operator
):
    with pytest.raises(ValidationError) as exc:
        _checked_autoscale({"max_replicas": 2}, node=ascend_node, devices=[0, 1], tp_pp=1, distributed="ray")
    assert "cannot autoscale" in exc.value.message_dict["autoscale"][0]
    # CPU replicas are processes sharing the node's cores: no device count bounds them.
    assert _checked_autoscale({"max_replicas": 3}, node=cpu_node, devices=[], tp_pp=1, distributed="").max_replicas == 3
    made = endpoint_create(
        spec=EndpointSpec(name="cpu-two", artifact=tiny_artifact.pk, node=cpu_node.name, replicas=2), user=operator
    )
    assert made.replicas == 2 and made.replica_set.count() == 2
    with pytest.raises(ValidationError) as exc:  # but one process per replica: no TP on a CPU node
        endpoint_create(
            spec=EndpointSpec(name="cpu-tp", artifact=tiny_artifact.pk, node=cpu_node.name, tensor_parallel_size=2),
            user=operator,
        )
    assert "one process per replica" in exc.value.message_dict["tensor_parallel_size"][0]


@pytest.mark.django_db
def test_launch_form_shows_autoscale_errors_under_the_box(as_operator, ascend_node, tiny_artifact):
    page = as_operator.post(
        "/endpoints/launch",
        {
            "name": "auto",
            "artifact": tiny_artifact.pk,
            "devices": "0",
            "autoscale": '{"min_replicas": -1, "max_replicas": 1}',
        },
    )
    assert page.status_code == 400
    assert "autoscale.min_replicas: A whole number from 0 to 64, not -1." in page.content.decode()
    page = as_operator.post(
        "/endpoints/launch", {"name": "auto", "artifact": tiny_artifact.pk, "devices": "0", "autoscale": "[1]"}
    )
    assert page.status_code == 400 and "Autoscaling: a JSON object" in page.content.decode()
    made = as_operator.post(
        "/endpoints/launch",
        {
            "name": "auto",
            "artifact": tiny_artifact.pk,
            "devices": "0,1",
            "autoscale": '{"min_replicas": 0, "max_replicas": 2}',
        },
    )
    assert made.status_code == 302
    made = Endpoint.objects.get()  # scale to zero accepted; it starts with one replica
    assert (made.autoscale["min_replicas"], made.autoscale["max_replicas"], made.replicas) == (0, 2, 1)


# --- the controller --------------------------------------------------------------------------------


def autoscaled(node, tiny_artifact, *, replicas=1, devices=(0, 1, 2, 3), **over):
    endpoint = Endpoint.objects.create(
        name="auto",
        artifact=tiny_artifact,
        node=node,
        served_model_name="auto",
        devices=list(devices),
        replicas=replicas,
        state=S.READY,
        autoscale=parse_settings({**AUTO, **over}).as_json(),
    )
    for index in range(replicas):
        Replica.objects.create(
            endpoint=endpoint,
            index=index,
            node=node,
            devices=[devices[index]],
            state=S.READY,
            port=8950 + index,
            port_host=node.hostname,
            pid=3_000_000 + index,
            pid_create_time=1.0,
        )
    return endpoint


def store_waiting(endpoint, *, replica, start, seconds, value, every=10, metric="ep.waiting"):
    """`ep.waiting` (or `metric`) points for one replica as the agent stores them (series e<id>.r<i>.<metric>);
    replica None: the gateway's series (e<id>.<metric>)."""
    key = f"e{endpoint.pk}.{metric}" if replica is None else f"e{endpoint.pk}.r{replica}.{metric}"
    s, _ = Series.objects.get_or_create(
        key=key, defaults={"metric": metric, "endpoint_id": endpoint.pk, "replica": replica, "node": endpoint.node}
    )
    Point.objects.bulk_create(
        [Point(series=s, ts=int(start) + every * i, value=value) for i in range(seconds // every + 1)]
    )


@pytest.mark.django_db
def test_controller_scales_up_on_summed_waiting_with_event_and_system_audit(ascend_node, tiny_artifact, settings):
    settings.TELEMETRY_INTERVAL_SECONDS = 10
    endpoint = autoscaled(ascend_node, tiny_artifact, replicas=2)
    now = 1_800_000_000
    # 3 + 3 queued on two replicas: 6 / 2 per replica = 3 needed over the whole 30 s window.
    for index in (0, 1):
        store_waiting(endpoint, replica=index, start=now - 30, seconds=30, value=3)
    [(_, decision, applied)] = evaluate_autoscaling(now)
    assert (decision.action, decision.wanted, applied) == (UP, 3, True)
    endpoint.refresh_from_db()
    assert endpoint.replicas == 3 and endpoint.scaled_at is not None
    new = Replica.objects.get(endpoint=endpoint, index=2)
    assert new.devices == [2] and new.state == S.PENDING
    ev = EndpointEvent.objects.get(endpoint=endpoint, kind="autoscale")
    assert "scaled up 2 → 3" in ev.message and "waiting_avg_up 6.0" in ev.message
    audit = AuditEvent.objects.get(action="endpoint.scale")
    assert audit.actor is None and audit.via == "controller" and audit.changes["replicas"] == [2, 3]
    # The next pass is in cooldown: nothing more, even on the same queue.
    [(_, again, applied)] = run_once(now + 10)["evaluate_autoscaling"]
    assert again.cooling and not applied and Endpoint.objects.get().replicas == 3
    # Each pass stored what the endpoint page charts: wanted, ready (two of three), the queue decided on.
    charted = {
        m: list(Point.objects.filter(series__key=f"e{endpoint.pk}.{m}").order_by("ts").values_list("ts", "value"))
        for m in ("as.wanted", "as.replicas", "as.ready", "as.waiting")
    }
    assert charted == {
        "as.wanted": [(now, 3.0), (now + 10, 3.0)],
        "as.replicas": [(now, 3.0), (now + 10, 3.0)],
        "as.ready": [(now, 2.0), (now + 10, 2.0)],
        "as.waiting": [(now, 6.0), (now + 10, 6.0)],
    }, charted


@pytest.mark.django_db
def test_a_scale_down_never_stops_the_serving_replica_and_keeps_a_broken_one(ascend_node, tiny_artifact, settings):
    """The scale-down stops the last replica of the count: while it serves and one that would stay does not
    (crashed and backing off, given up, held off a faulty device), the controller holds; when the broken one
    is the last, the step stops it. A replica held off a faulty device is not "starting" either."""
    settings.TELEMETRY_INTERVAL_SECONDS = 10
    endpoint = autoscaled(ascend_node, tiny_artifact, replicas=2)
    now = 1_800_000_000
    for index in (0, 1):
        store_waiting(endpoint, replica=index, start=now - 400, seconds=400, value=0)
    long_ago = timezone.now() - timedelta(days=1)
    Replica.objects.filter(endpoint=endpoint).update(ready_at=long_ago)

    for state, reason in (
        (S.RESTARTING, "crashed (exit code 1); restarting in 20 s"),
        (S.FAILED, "gave up"),
        (S.PENDING, "device fault: chip 0 Alarm; no healthy spare"),
    ):
        Replica.objects.filter(endpoint=endpoint, index=0).update(state=state, state_reason=reason)
        [(_, decision, applied)] = evaluate_autoscaling(now)
        assert (decision.action, applied) == (HOLD, False), (state, decision.reason)
        assert "would stay are not serving" in decision.reason and Endpoint.objects.get().replicas == 2

    Replica.objects.filter(endpoint=endpoint, index=0).update(state=S.READY, state_reason="")
    Replica.objects.filter(endpoint=endpoint, index=1).update(
        state=S.PENDING, state_reason="device fault: chip 1 Alarm; no spare"
    )
    [(_, decision, applied)] = evaluate_autoscaling(now)
    assert (decision.action, decision.wanted, applied) == (DOWN, 1, True)  # the broken one goes


@pytest.mark.django_db
def test_controller_scales_an_idle_endpoint_to_zero_and_wakes_it_on_held_requests(ascend_node, tiny_artifact, settings):
    settings.TELEMETRY_INTERVAL_SECONDS = 10
    endpoint = autoscaled(ascend_node, tiny_artifact, replicas=1, min_replicas=0)
    now = 1_800_000_000
    for metric in ("ep.waiting", "ep.running", "ep.qps"):
        store_waiting(endpoint, replica=0, start=now - 60, seconds=60, value=0, metric=metric)
    # One request the gateway served in the window: not idle.
    store_waiting(endpoint, replica=None, start=now - 30, seconds=0, value=0.1, metric="gw.qps")
    [(_, decision, applied)] = evaluate_autoscaling(now)
    assert (decision.action, decision.wanted, applied) == (HOLD, 1, False) and "not idle" in decision.reason
    Point.objects.filter(series__metric="gw.qps").update(value=0)
    [(_, decision, applied)] = evaluate_autoscaling(now)
    assert (decision.action, decision.wanted, applied) == (DOWN, 0, True)
    endpoint.refresh_from_db()
    assert endpoint.replicas == 0 and (endpoint.state, endpoint.state_reason) == (
        S.PENDING,
        "scaled to zero: the next request through the gateway starts a replica",
    )
    assert "scaled down 1 → 0: idle for 60 s" in EndpointEvent.objects.get(endpoint=endpoint, kind="autoscale").message
    assert not routing_table().backends and [w.endpoint_id for w in routing_table().wakeable["auto"]] == [endpoint.pk]
    # Requests held in a gateway (its wake write lost): the next pass wakes it, cooldown or not.
    store_waiting(endpoint, replica=None, start=now + 5, seconds=0, value=2, metric="gw.waiting")
    [(_, decision, applied)] = evaluate_autoscaling(now + 10)
    assert (decision.action, decision.wanted, applied) == (UP, 1, True) and "waking" in decision.reason
    assert Endpoint.objects.get().replicas == 1
    audit = AuditEvent.objects.filter(action="endpoint.scale").order_by("pk").last()
    assert audit.actor is None and audit.via == "controller" and audit.changes["replicas"] == [0, 1]


@pytest.mark.django_db
def test_the_controller_command_applies_and_prints_a_scaling_decision(ascend_node, tiny_artifact, settings):
    import io
    import time

    from django.core.management import call_command

    settings.TELEMETRY_INTERVAL_SECONDS = 10
    endpoint = autoscaled(ascend_node, tiny_artifact, replicas=2)
    now = int(time.time())
    for index in (0, 1):
        store_waiting(endpoint, replica=index, start=now - 40, seconds=40, value=3)
    out = io.StringIO()
    call_command("serving_controller", "--once", stdout=out)
    assert "evaluate_autoscaling: auto: up" in out.getvalue()
    assert Endpoint.objects.get(pk=endpoint.pk).replicas == 3


@pytest.mark.django_db
def test_a_scale_up_without_free_devices_says_so_instead_of_failing(ascend_node, tiny_artifact, settings):
    settings.TELEMETRY_INTERVAL_SECONDS = 10
    endpoint = autoscaled(ascend_node, tiny_artifact, replicas=1)
    Device.objects.filter(node=ascend_node, index=1).update(health="Critical")
    now = 1_800_000_000
    store_waiting(endpoint, replica=0, start=now - 30, seconds=30, value=5)  # needs 3
    [(_, decision, applied)] = evaluate_autoscaling(now)
    assert decision.wanted == 3 and not applied
    endpoint.refresh_from_db()
    assert endpoint.replicas == 1 and endpoint.autoscale_wanted == 3
    assert endpoint.state_reason == "wants 3, has 1: no free devices"
    assert EndpointEvent.objects.filter(kind="autoscale", message__startswith="wants 3, has 1").count() == 1
    evaluate_autoscaling(now + 1)  # tried again, one event only
    assert EndpointEvent.objects.filter(kind="autoscale").count() == 1
    # The chip is OK again: the next pass places both.
    Device.objects.filter(node=ascend_node, index=1).update(health="OK")
    evaluate_autoscaling(now + 2)
    endpoint.refresh_from_db()
    assert (
        endpoint.replicas == 3
        and endpoint.autoscale_wanted is None
        and endpoint.state_reason != "wants 3, has 1: no free devices"
    )


@pytest.mark.django_db
def test_two_controllers_apply_one_change(ascend_node, tiny_artifact, settings):
    settings.TELEMETRY_INTERVAL_SECONDS = 10
    endpoint = autoscaled(ascend_node, tiny_artifact, replicas=1)
    now = 1_800_000_000
    store_waiting(endpoint, replica=0, start=now - 30, seconds=30, value=4)
    from endpoints.services import endpoint_scale

    stale = Endpoint.objects.get(pk=endpoint.pk)
    assert evaluate_autoscaling(now)[0][2] is True
    _, applied = endpoint_scale(endpoint=stale, replicas=2, via="controller", reason="late")
    assert not applied and Endpoint.objects.get().replicas == 2
    assert AuditEvent.objects.filter(action="endpoint.scale").count() == 1


# --- the drain -------------------------------------------------------------------------------------


class Metrics(BaseHTTPRequestHandler):
    running = 1.0

    def do_GET(self):
        body = (
            f'vllm:num_requests_running{{model_name="auto"}} {Metrics.running}\n'
            'vllm:num_requests_waiting{model_name="auto"} 0.0\n'
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def metrics_server(settings):
    server = ThreadingHTTPServer(("127.0.0.1", 8990), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    settings.ENDPOINT_BIND_HOST = "127.0.0.1"
    yield server
    server.shutdown()
    server.server_close()


def two_running_replicas(node, tiny_artifact, monkeypatch):
    """An autoscaled endpoint with two ready replicas whose processes the stand-in supervisor holds;
    replica 1's /metrics is the metrics_server fixture's (port 8990)."""
    endpoint = autoscaled(node, tiny_artifact, replicas=2)
    Replica.objects.filter(endpoint=endpoint, index=1).update(port=8990)
    supervisor, workload = StandInSupervisor(), ReplicaWorkload()
    for pid in (3_000_000, 3_000_001):
        supervisor.adopt(pid)
    monkeypatch.setattr("endpoints.reconcile.check_ready", lambda replica: (True, "ok"))
    return endpoint, supervisor, workload


@pytest.mark.django_db
def test_a_scaled_down_replica_leaves_routing_at_once_and_stops_when_idle(
    ascend_node, tiny_artifact, settings, metrics_server, monkeypatch
):
    settings.GATEWAY_DRAIN_SECONDS, settings.GATEWAY_ROUTES_REFRESH_SECONDS = 30, 1
    endpoint, supervisor, workload = two_running_replicas(ascend_node, tiny_artifact, monkeypatch)

    def routed():
        return {b.replica_index for b in routing_table().backends.get("auto", [])}

    assert routed() == {0, 1}
    from endpoints.services import endpoint_scale

    endpoint_scale(endpoint=endpoint, replicas=1, via="controller", reason="test")
    assert routed() == {0}  # before any agent pass
    t0 = timezone.now()
    workload.reconcile(node=ascend_node, supervisor=supervisor)
    replica = Replica.objects.get(endpoint=endpoint, index=1)
    assert replica.state == S.STOPPING and "draining" in replica.state_reason and supervisor.terminated == []
    assert Endpoint.objects.get().state_reason == "draining 1 replica(s) after a scale-down"
    # A request still running 5 s later: kept.
    monkeypatch.setattr("endpoints.reconcile.timezone.now", lambda: t0 + timedelta(seconds=5))
    workload.reconcile(node=ascend_node, supervisor=supervisor)
    assert supervisor.terminated == [] and Replica.objects.get(pk=replica.pk).state == S.STOPPING
    # Idle: stopped.
    Metrics.running = 0.0
    workload.reconcile(node=ascend_node, supervisor=supervisor)
    replica.refresh_from_db()
    assert supervisor.terminated == [3_000_001] and replica.state == S.STOPPED and 3_000_000 in supervisor.running
    assert EndpointEvent.objects.filter(kind="drained", message__startswith="no request in flight").exists()
    endpoint.refresh_from_db()
    assert endpoint.state == S.READY and endpoint.state_reason == ""


@pytest.mark.django_db
def test_a_busy_draining_replica_stops_at_the_drain_bound(
    ascend_node, tiny_artifact, settings, metrics_server, monkeypatch
):
    settings.GATEWAY_DRAIN_SECONDS = 30
    Metrics.running = 3.0
    endpoint, supervisor, workload = two_running_replicas(ascend_node, tiny_artifact, monkeypatch)
    Endpoint.objects.filter(pk=endpoint.pk).update(replicas=1)
    t0 = timezone.now()
    workload.reconcile(node=ascend_node, supervisor=supervisor)
    monkeypatch.setattr("endpoints.reconcile.timezone.now", lambda: t0 + timedelta(seconds=29))
    workload.reconcile(node=ascend_node, supervisor=supervisor)
    assert supervisor.terminated == []
    monkeypatch.setattr("endpoints.reconcile.timezone.now", lambda: t0 + timedelta(seconds=31))
    workload.reconcile(node=ascend_node, supervisor=supervisor)
    assert supervisor.terminated == [3_000_001]
    assert EndpointEvent.objects.filter(kind="drained", message__startswith="drain bound of 30 s").exists()
    # Stopping the whole endpoint is not a drain: the other replica stops on the next pass.
    Endpoint.objects.filter(pk=endpoint.pk).update(desired_state=Endpoint.Desired.STOPPED)
    workload.reconcile(node=ascend_node, supervisor=supervisor)
    assert supervisor.terminated == [3_000_001, 3_000_000]


@pytest.mark.django_db
def test_a_scaled_down_replica_still_starting_stops_at_once(ascend_node, tiny_artifact):
    endpoint = autoscaled(ascend_node, tiny_artifact, replicas=2)
    Replica.objects.filter(endpoint=endpoint, index=1).update(state=S.STARTING)
    supervisor, workload = StandInSupervisor(), ReplicaWorkload()
    for pid in (3_000_000, 3_000_001):
        supervisor.adopt(pid)
    Endpoint.objects.filter(pk=endpoint.pk).update(replicas=1)
    workload.reconcile(node=ascend_node, supervisor=supervisor)
    assert supervisor.terminated == [3_000_001] and Replica.objects.get(endpoint=endpoint, index=1).state == S.STOPPED


@pytest.mark.django_db
def test_the_agent_at_zero_replicas_stops_the_last_one_and_starts_nothing(ascend_node, tiny_artifact, as_operator):
    endpoint = autoscaled(ascend_node, tiny_artifact, replicas=1, min_replicas=0)
    Replica.objects.filter(endpoint=endpoint).update(state=S.STARTING)  # never ready: stops at once
    supervisor, workload = StandInSupervisor(), ReplicaWorkload()
    supervisor.adopt(3_000_000)
    Endpoint.objects.filter(pk=endpoint.pk).update(replicas=0)
    workload.reconcile(node=ascend_node, supervisor=supervisor)
    workload.reconcile(node=ascend_node, supervisor=supervisor)
    assert supervisor.terminated == [3_000_000] and Replica.objects.get(endpoint=endpoint).state == S.STOPPED
    assert supervisor.started == []
    endpoint.refresh_from_db()
    assert (endpoint.desired_state, endpoint.state) == (Endpoint.Desired.RUNNING, S.PENDING)
    assert endpoint.state_reason == "scaled to zero: the next request through the gateway starts a replica"
    page = as_operator.get(f"/endpoints/{endpoint.pk}/").content.decode()
    assert "scaled to zero: the next request through the gateway starts a replica" in page and "0 replica(s)" in page
