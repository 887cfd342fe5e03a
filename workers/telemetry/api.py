"""Telemetry over the API: chart data, the fleet summary and alerts (Viewer)."""

from ninja import Query, Router
from ninja.errors import HttpError

from console.api_auth import api_route
from console.roles import VIEWER
from console.teams import visible_team_ids
from workers.telemetry import selectors, services
from workers.telemetry.models import Alert
from workers.telemetry.sources import hidden_endpoints, hidden_keys

router = Router(tags=["telemetry"])


@api_route(router, "get", "/telemetry/series", role=VIEWER, response=dict)
def series(
    request,
    metric: str,
    range_: str = Query(selectors.DEFAULT_RANGE, alias="range"),
    node: int | None = None,
    endpoint: int | None = None,
    device: int | None = None,
    gateway_key: int | None = None,
    since: int | None = None,
):
    """Chart data: every series of the given metric(s) (comma-separated, e.g.
    ``dev.temp_c`` or ``host.cpu_pct,host.mem_pct``), optionally of one node, endpoint,
    device or gateway key (``gateway_key``), over ``range`` (15m, 1h, 6h, 24h, 7d). Short ranges come from raw
    points, 6 h and longer from minute rollups; each series has at most 720 buckets (``t`` Unix seconds, ``v``
    mean, ``min``, ``max``). ``since`` (a bucket time you have) returns only newer buckets."""
    metrics = [m.strip() for m in metric.split(",") if m.strip()][:16]
    if not metrics:
        raise HttpError(400, "Name at least one metric.")
    try:
        selectors.plan(range_)
    except selectors.BadRange as exc:
        raise HttpError(400, str(exc)) from None
    team_ids = visible_team_ids(request.user)
    found = selectors.find_series(
        metrics=metrics,
        node=node,
        endpoint=endpoint,
        device=device,
        gateway_key=gateway_key,
        hidden_keys=hidden_keys(team_ids),
        hidden_endpoints=hidden_endpoints(team_ids),
    )
    return selectors.series_data(found, range_, since=since)


@api_route(router, "get", "/telemetry/fleet", role=VIEWER, response=dict)
def fleet(request):
    """The Overview cards as numbers."""
    summary = selectors.fleet_summary(hidden_endpoints=hidden_endpoints(visible_team_ids(request.user)))
    summary.pop("nodes")
    return summary


def _alert_json(a: Alert) -> dict:
    return {"id": a.pk, **services.alert_payload(a)}


@api_route(router, "get", "/telemetry/alerts", role=VIEWER, response=dict)
def alerts(request):
    """Firing alerts and those resolved in the last 24 hours."""
    firing, resolved = services.recent_alerts(team_ids=visible_team_ids(request.user))
    return {"firing": [_alert_json(a) for a in firing], "resolved": [_alert_json(a) for a in resolved]}
