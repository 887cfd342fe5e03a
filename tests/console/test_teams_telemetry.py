"""Teams in telemetry and the overview (issue 37): an endpoint's series (e<id>.*), its alerts, its readiness and
its place in the fleet summary are its team's members' to read, in the series API, the fleet API and panel, the
alerts and /metrics; the console Admin and the shared METRICS_TOKEN read every team's."""

import time
from datetime import UTC, datetime, timedelta

from django.test import Client

from endpoints.models import Endpoint
from tests.conftest import _client_for
from tests.console.test_teams import two_teams  # noqa: F401 (a fixture)
from workers.telemetry.models import Alert, AlertRule, Series


def _serving(two_teams):  # noqa: F811
    """Both endpoints running and ready, each with a fresh QPS reading and (theirs) a firing alert."""
    now = int(time.time())
    rule = AlertRule.objects.create(name="slow", kind="metric", metric="ep.qps", threshold=1)
    endpoints = {side: two_teams[side]["endpoint"] for side in ("ours", "theirs")}
    for side, ep in endpoints.items():
        Endpoint.objects.filter(pk=ep.pk).update(
            desired_state=Endpoint.Desired.RUNNING, state=Endpoint.State.READY, replicas=1
        )
        Series.objects.create(
            key=f"e{ep.pk}.r0.ep.qps",
            metric="ep.qps",
            endpoint_id=ep.pk,
            replica=0,
            last_ts=now,
            last_value=3.0 if side == "ours" else 40.0,
        )
        Alert.objects.create(
            rule=rule, subject=f"endpoint:{ep.pk}", label=f"alert-{side}", endpoint_id=ep.pk, state=Alert.State.FIRING
        )
    return endpoints


def test_endpoint_series_fleet_alerts_and_metrics_are_the_endpoints_teams(two_teams, as_admin, settings):  # noqa: F811
    endpoints = _serving(two_teams)
    ana = _client_for(two_teams["ana"])
    found = ana.get("/api/v1/telemetry/series", {"metric": "ep.qps", "range": "15m"}).json()
    assert [s["endpoint"] for s in found["series"]] == [endpoints["ours"].pk], found
    theirs = ana.get("/api/v1/telemetry/series", {"metric": "ep.qps", "endpoint": endpoints["theirs"].pk}).json()
    assert theirs["series"] == []
    fleet = ana.get("/api/v1/telemetry/fleet").json()
    assert fleet["endpoints_running"] == 1 and fleet["endpoints_ready"] == 1 and fleet["qps"] == 3.0, fleet
    alerts = ana.get("/api/v1/telemetry/alerts").json()
    assert [a["label"] for a in alerts["firing"]] == ["alert-ours"], alerts
    panel = ana.get("/telemetry/fleet").content.decode()
    assert "alert-ours" in panel and "alert-theirs" not in panel
    metrics = ana.get("/metrics").content.decode()
    assert 'endpoint="ep-ours"' in metrics and "ep-theirs" not in metrics, metrics
    assert "console_alerts_firing 1.0" in metrics

    everything = as_admin.get("/api/v1/telemetry/fleet").json()
    assert everything["endpoints_running"] == 2 and everything["qps"] == 43.0
    assert len(as_admin.get("/api/v1/telemetry/series", {"metric": "ep.qps"}).json()["series"]) == 2
    assert "ep-theirs" in as_admin.get("/metrics").content.decode()
    settings.METRICS_TOKEN = "shared-scrape-token"
    scrape = Client().get("/metrics", HTTP_AUTHORIZATION="Bearer shared-scrape-token").content.decode()
    assert 'endpoint="ep-ours"' in scrape and 'endpoint="ep-theirs"' in scrape


def test_the_alerts_page_and_budget_alerts_are_their_teams(two_teams, as_admin):  # noqa: F811
    """The alerts page lists only the reader's teams' endpoint alerts and token-budget alerts (a key's budget: the
    key's team's); it listed every alert to any Viewer, and a budget alert names its key."""
    from endpoints.gateway.models import Budget
    from endpoints.gateway.services import budget_alert

    _serving(two_teams)
    budgets = {
        "ours-team": Budget.objects.create(team=two_teams["research"], tokens=100, period="day", mode="soft"),
        "theirs-key": Budget.objects.create(key=two_teams["theirs"]["key"], tokens=100, period="day", mode="soft"),
        "theirs-team": Budget.objects.create(team=two_teams["default"], tokens=100, period="day", mode="soft"),
    }
    start = datetime(2026, 12, 6, tzinfo=UTC)
    for budget in budgets.values():
        assert budget_alert(budget_id=budget.pk, percent=80, start=start, reset=start + timedelta(days=1), used=85)
    ana = _client_for(two_teams["ana"])
    page = ana.get("/alerts/").content.decode()
    assert "alert-ours" in page and "alert-theirs" not in page
    assert f"team {two_teams['research']}" in page
    assert f"key {two_teams['theirs']['key']}" not in page and f"team {two_teams['default']}" not in page
    firing = [a["label"] for a in ana.get("/api/v1/telemetry/alerts").json()["firing"]]
    assert len(firing) == 2 and "alert-ours" in firing and any(str(two_teams["research"]) in f for f in firing)
    everything = as_admin.get("/alerts/").content.decode()
    assert f"key {two_teams['theirs']['key']}" in everything and "alert-theirs" in everything
