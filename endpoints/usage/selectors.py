"""Reads of metered usage, accelerator-hours and budgets, narrowed to what the user sees (console.teams)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from django.core.exceptions import ValidationError
from django.db.models import Sum
from django.db.models.functions import TruncDay
from django.http import Http404
from django.utils import timezone

from console.models import Team
from console.roles import VIEWER
from console.teams import check_team_role, visible, visible_get, visible_team_ids
from endpoints.gateway.models import Budget, GatewayKey, UsageHour
from endpoints.gateway.selectors import period_bounds, tokens_metered
from endpoints.models import Endpoint, EndpointEvent, Replica

#: group_by's words -> the row fields they group on (the first is the label, the rest go along with it).
GROUPS: dict[str, tuple[str, ...]] = {
    "hour": ("hour",),
    "day": ("day",),
    "team": ("team__name", "team_id"),
    "key": ("key_name", "key_id"),
    "endpoint": ("endpoint_name", "endpoint_id"),
    "model": ("model",),
    "adapter": ("adapter",),
}
#: The names the rows carry for those fields (the API's and the CSV's columns).
FIELD_NAMES = {"team__name": "team", "key_name": "key", "endpoint_name": "endpoint"}
COUNTS = ("requests", "errors", "interrupted", "prompt_tokens", "completion_tokens")
DEFAULT_DAYS = 7


@dataclass(frozen=True)
class UsageQuery:
    since: datetime
    until: datetime
    group_by: tuple[str, ...]
    team_id: int | None = None
    key_id: int | None = None
    endpoint: str = ""
    model: str = ""


def parse_group_by(value: str) -> tuple[str, ...]:
    words = tuple(w.strip() for w in (value or "").split(",") if w.strip())
    unknown = [w for w in words if w not in GROUPS]
    if unknown:
        raise ValidationError(
            {"group_by": f"Unknown grouping {', '.join(unknown)}: one or more of {', '.join(GROUPS)}."}
        )
    return tuple(dict.fromkeys(words))


def usage_query(
    *,
    user,
    team: int | None = None,
    key: int | None = None,
    endpoint: str = "",
    model: str = "",
    since: datetime | None = None,
    until: datetime | None = None,
    group_by: str = "",
) -> UsageQuery:
    """The query's filters checked against what `user` sees: a team or key of another team is a 404 (as the object
    would be); the window defaults to the last DEFAULT_DAYS days, in whole UTC hours."""
    if team is not None:
        team_ids = visible_team_ids(user)
        if not Team.objects.filter(pk=team).exists() or (team_ids is not None and team not in team_ids):
            raise Http404("Not found.")
    if key is not None:
        visible_get(GatewayKey.objects.all(), user, role=VIEWER, pk=key)
    now = timezone.now()
    until = until or now
    since = since or until - timedelta(days=DEFAULT_DAYS)
    if since.tzinfo is None:
        since = since.replace(tzinfo=UTC)
    if until.tzinfo is None:
        until = until.replace(tzinfo=UTC)
    if since >= until:
        raise ValidationError({"since": "since must be before until."})
    return UsageQuery(
        since=hour_floor(since),
        until=until,
        group_by=parse_group_by(group_by),
        team_id=team,
        key_id=key,
        endpoint=endpoint.strip(),
        model=model.strip(),
    )


def hour_floor(moment: datetime) -> datetime:
    return moment.astimezone(UTC).replace(minute=0, second=0, microsecond=0)


def usage_rows(*, user, query: UsageQuery) -> list[dict]:
    """Sums of the hourly rows in the window, one row per group (one row of totals without group_by), each with
    requests, errors, interrupted, prompt_tokens, completion_tokens and total_tokens."""
    rows = visible(UsageHour.objects.all(), user).filter(hour__gte=query.since, hour__lt=query.until)
    if query.team_id is not None:
        rows = rows.filter(team_id=query.team_id)
    if query.key_id is not None:
        rows = rows.filter(key_id=query.key_id)
    if query.endpoint:
        rows = rows.filter(
            **({"endpoint_id": int(query.endpoint)} if query.endpoint.isdigit() else {"endpoint_name": query.endpoint})
        )
    if query.model:
        rows = rows.filter(model=query.model)
    if "day" in query.group_by:
        rows = rows.annotate(day=TruncDay("hour", tzinfo=UTC))
    fields = [f for word in query.group_by for f in GROUPS[word]]
    sums = {c: Sum(c) for c in COUNTS}
    grouped = rows.values(*fields).annotate(**sums).order_by(*fields) if fields else [rows.aggregate(**sums)]
    return [_row(values, fields) for values in grouped]


def _row(values: dict, fields: list[str]) -> dict:
    row: dict = {}
    for f in fields:
        value = values[f]
        row[FIELD_NAMES.get(f, f)] = value.isoformat() if isinstance(value, datetime) else value
    for c in COUNTS:
        row[c] = values[c] or 0
    row["total_tokens"] = row["prompt_tokens"] + row["completion_tokens"]
    return row


def usage_columns(query: UsageQuery) -> list[str]:
    fields = [FIELD_NAMES.get(f, f) for word in query.group_by for f in GROUPS[word]]
    return [*fields, *COUNTS, "total_tokens"]


# Accelerator-hours. The most faithful record of when a replica ran is its endpoint's event log (EndpointEvent, one
# row per replica start and end, written by the agent's reconcile loop as it happens): Replica.started_at holds the
# current run only and is overwritten at each restart, while the events keep every run. A run opens at "started" and
# ends at the first of RUN_ENDS for that replica (or the next "started"); one still open ends now if the replica still
# runs, else at its last event. The devices are the replica's own (Replica.devices; the endpoint's placement for a
# replica row that is gone): events do not record them, and a device-fault move keeps their number. Endpoints deleted
# take their events with them, and their accelerator-hours. The team is the endpoint's.
RUN_ENDS = frozenset({"stopped", "killed", "crashed", "start-timeout", "failed", "start-failed"})


def replica_runs(*, endpoint_ids, since: datetime, until: datetime) -> list[tuple[int, int, datetime, datetime]]:
    """(endpoint id, replica index, start, end) of each run that overlaps [since, until)."""
    events = (
        EndpointEvent.objects.filter(endpoint_id__in=endpoint_ids, replica_index__isnull=False, created_at__lt=until)
        .order_by("created_at", "id")
        .values_list("endpoint_id", "replica_index", "kind", "created_at")
    )
    running = {
        (e, i)
        for e, i in Replica.objects.filter(endpoint_id__in=endpoint_ids)
        .exclude(pid__isnull=True, container_id="")
        .values_list("endpoint_id", "index")
    }
    now = min(timezone.now(), until)
    opened: dict[tuple[int, int], datetime] = {}
    runs = []
    last_event: dict[tuple[int, int], datetime] = {}
    for endpoint_id, replica_index, kind, at in events:
        index = int(replica_index or 0)  # never None: filtered above
        slot = (endpoint_id, index)
        last_event[slot] = at
        if kind not in RUN_ENDS and kind != "started":
            continue
        start = opened.pop(slot, None)
        if start is not None:
            runs.append((endpoint_id, index, start, at))
        if kind == "started":
            opened[slot] = at
    for (endpoint_id, index), start in opened.items():
        end = now if (endpoint_id, index) in running else last_event.get((endpoint_id, index), start)
        runs.append((endpoint_id, index, start, end))
    return [r for r in runs if r[3] > since and r[2] < until]


def accelerator_hours(*, user, query: UsageQuery) -> list[dict]:
    """Per UTC hour and team: replica-hours (how long replicas ran) and accelerator-hours (replica-hours x each
    replica's devices), in the query's window (and team)."""
    endpoints = visible(Endpoint.objects.all(), user)
    if query.team_id is not None:
        endpoints = endpoints.filter(team_id=query.team_id)
    info = {e.pk: e for e in endpoints.select_related("team").only("id", "devices", "team__name")}
    devices = {
        (e, i): len(d or [])
        for e, i, d in Replica.objects.filter(endpoint_id__in=info).values_list("endpoint_id", "index", "devices")
    }
    buckets: dict[tuple[datetime, int], list[float]] = defaultdict(lambda: [0.0, 0.0])
    for endpoint_id, index, start, end in replica_runs(endpoint_ids=list(info), since=query.since, until=query.until):
        count = devices.get((endpoint_id, index), len(info[endpoint_id].devices or []))
        start, end = max(start, query.since), min(end, query.until)
        hour = hour_floor(start)
        while hour < end:
            part = (min(end, hour + timedelta(hours=1)) - max(start, hour)).total_seconds() / 3600
            if part > 0:
                bucket = buckets[(hour, info[endpoint_id].team_id)]
                bucket[0] += part
                bucket[1] += part * count
            hour += timedelta(hours=1)
    names = {e.team_id: e.team.name for e in info.values()}
    return [
        {
            "hour": hour.isoformat(),
            "team": names[team_id],
            "team_id": team_id,
            "replica_hours": round(values[0], 4),
            "accelerator_hours": round(values[1], 4),
        }
        for (hour, team_id), values in sorted(buckets.items(), key=lambda item: (item[0][0], names[item[0][1]]))
    ]


# Budgets.


def budget_used(budget: Budget, *, now: datetime | None = None) -> int:
    """The tokens used so far in the budget's current period (the gateway's periods and metered rows)."""
    start, _ = period_bounds(budget.period, now)
    if budget.team_id:
        return tokens_metered(team_id=budget.team_id, since=start)
    return tokens_metered(key_id=budget.key_id, since=start)


def team_get(team_id: int, *, user, role: str = VIEWER) -> Team:
    """A team the user sees (404 otherwise: as an object of another team), with at least `role` in it beyond
    Viewer (console.teams.check_team_role)."""
    team = visible_teams(user=user).filter(pk=team_id).first()
    if team is None:
        raise Http404("Not found.")
    if role != VIEWER:
        check_team_role(user, team.pk, role)
    return team


def budget_for_period(*, team_id: int | None = None, key_id: int | None = None, period: str) -> Budget:
    """The team's (team_id) or key's (key_id) budget for the period; 404 where it has none."""
    owner = {"team_id": team_id} if team_id is not None else {"key_id": key_id}
    budget = Budget.objects.filter(**owner, period=period).first()
    if budget is None:
        raise Http404("Not found.")
    return budget


def team_budgets(*, team_id: int):
    return Budget.objects.filter(team_id=team_id).order_by("period")


def key_budgets(*, key_id: int):
    return Budget.objects.filter(key_id=key_id).order_by("period")


def budget_json(budget: Budget, *, now: datetime | None = None) -> dict:
    used = budget_used(budget, now=now)
    start, reset = period_bounds(budget.period, now)
    return {
        "id": budget.pk,
        "team": budget.team_id,
        "key": budget.key_id,
        "tokens": budget.tokens,
        "period": budget.period,
        "mode": budget.mode,
        "used": used,
        "percent": round(100 * used / budget.tokens, 1) if budget.tokens else 0.0,
        "period_start": start.isoformat(),
        "resets_at": reset.isoformat(),
    }


def visible_teams(*, user):
    team_ids = visible_team_ids(user)
    return Team.objects.all() if team_ids is None else Team.objects.filter(pk__in=team_ids)
