"""Reading what the gateway routes on: the ready replicas per served model name (the
console's registry, refreshed by the gateway every GATEWAY_ROUTES_REFRESH_SECONDS) and keys."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from django.conf import settings
from django.db.models import F, Q, Sum

from console.models import hash_token
from console.roles import ADMIN
from console.teams import visible, visible_get
from endpoints.gateway.models import Budget, GatewayEndpoint, GatewayKey, UsageHour
from endpoints.gateway.rollout import Sample
from endpoints.models import Endpoint, Replica
from endpoints.selectors import unhealthy_replica_ids
from models_registry.models import Artifact
from workers.telemetry.models import Point, Series


@dataclass(frozen=True)
class Backend:
    """One ready replica as the gateway sees it."""

    url: str
    endpoint_id: int
    endpoint_name: str
    replica_index: int
    queue_depth: int
    scope_names: frozenset = field(default_factory=frozenset)  # endpoint names a key scope may use
    node_name: str = ""
    api_key: str = ""  # the replica's own key (Replica.api_key), never the client's
    prefix: bool = False  # its endpoint routes prefix-aware (Endpoint.routing), else least outstanding
    staged: bool = False  # the staged side of a blue-green pair taking a canary share
    canary_percent: int = 0  # that share (on the staged side's backends)
    role: str = ""  # "prefill" / "decode" on a disaggregated endpoint (the gateway relays P then D), else ""
    engine_headers: bool = False  # its endpoint takes vLLM's routing headers from clients (GatewayEndpoint)
    team_id: int | None = None  # its endpoint's team: only that team's keys reach it (KeyInfo.allows_backend)


@dataclass(frozen=True)
class Wakeable:
    """An endpoint scaled to zero (autoscaled, min_replicas 0) with no ready replica: a request for its
    model wakes it (replicas 0) or waits for the replica it is starting."""

    endpoint_id: int
    endpoint_name: str
    replicas: int  # 0: asleep, the request wakes it; more: waking already
    scope_names: frozenset = field(default_factory=frozenset)  # as Backend's, for a key's scope
    team_id: int | None = None  # as Backend's


@dataclass(frozen=True)
class Loadable:
    """A registered LoRA adapter that no replica of this endpoint holds, which the endpoint lets the gateway load on
    request (Endpoint.adapters_on_demand): a request naming it is held while it loads on every ready replica."""

    endpoint_id: int
    endpoint_name: str
    adapter_id: int
    scope_names: frozenset = field(default_factory=frozenset)  # as Backend's, for a key's scope
    team_id: int | None = None  # as Backend's


@dataclass
class RoutingTable:
    backends: dict[str, list[Backend]]  # served model name -> ready replicas taking traffic
    known: dict[str, set[str]]  # served model name -> endpoint names (running or not): 503 vs 404
    max_queue: dict[int, int]  # endpoint id -> queue depth
    canary: dict[str, int] = field(default_factory=dict)  # served model name -> the staged side's share (%)
    prefix: set[str] = field(default_factory=set)  # served model names with a prefix-routed endpoint
    wakeable: dict[str, list[Wakeable]] = field(default_factory=dict)  # model -> its endpoints scaled to zero
    drain_due_at: datetime | None = None  # the earliest blue-green drain to finish (finish_drains), if any
    adapters: dict[str, set[int]] = field(default_factory=dict)  # LoRA adapter name -> the endpoints holding it
    loadable: dict[str, list[Loadable]] = field(default_factory=dict)  # adapter name -> where it may be loaded
    context: dict[str, int] = field(default_factory=dict)  # served model name -> its longest max_model_len
    # served model name -> the teams of the endpoints in `known`: a key reaches its own team's alone (a model
    # served only by other teams' endpoints is a 404 to it, as an unknown one)
    teams: dict[str, set[int]] = field(default_factory=dict)


def model_name(endpoint) -> str:
    return endpoint.served_model_name or endpoint.name


def routing_table() -> RoutingTable:
    pairs = {g.endpoint_id: g for g in GatewayEndpoint.objects.all()}
    # Blue-green: the side of each pair not serving gets no traffic (but is routable again on rollback),
    # unless it is the staged side with a canary share: then it takes that share of the requests.
    idle: set[int] = set()
    public_of: dict[int, int] = {}  # staged side -> its pair's public endpoint
    canary: dict[int, int] = {}
    for g in pairs.values():
        if g.staged_id:
            public_of[g.staged_id] = g.endpoint_id
            if g.serving == GatewayEndpoint.Serving.LIVE and g.canary_percent:
                canary[g.staged_id] = g.canary_percent
            else:
                idle.add(g.staged_id if g.serving == GatewayEndpoint.Serving.LIVE else g.endpoint_id)
    names: dict[int, str] = {}
    team_of: dict[str, int] = {}  # endpoint name -> its team
    for pk, name, team_id in Endpoint.objects.values_list("id", "name", "team_id"):
        names[pk] = name
        team_of[name] = team_id
    known: dict[str, set[str]] = {}
    max_queue: dict[int, int] = {}
    context: dict[str, int] = {}
    asleep = []
    # Only the columns used: the gateway reads this every second, and building whole rows was most of its
    # idle CPU (benchmarks/gateway.py).
    on_demand: dict[int, tuple[str, int]] = {}  # endpoint id -> (name, artifact id) of those loading adapters
    # vLLM's max_model_len: the endpoint's, else the model config's max_position_embeddings (what vLLM derives it
    # from), else GATEWAY_DEFAULT_CONTEXT. The token estimate's default for a request with no max_tokens. Read in
    # the same query (a key of the artifact's inspection), not the whole inspection.
    running = (
        Endpoint.objects.filter(desired_state=Endpoint.Desired.RUNNING)
        .only(
            "name",
            "served_model_name",
            "autoscale",
            "distributed",
            "replicas",
            "adapters_on_demand",
            "artifact",
            "max_model_len",
        )
        .annotate(config_length=F("artifact__inspection__max_position_embeddings"))
    )
    for ep in running:
        known.setdefault(model_name(ep), set()).add(ep.name)
        if ep.adapters_on_demand and ep.pk not in idle:
            on_demand[ep.pk] = (ep.name, ep.artifact_id)
        configured = ep.config_length if isinstance(ep.config_length, int) and ep.config_length > 0 else None
        length = ep.max_model_len or configured or settings.GATEWAY_DEFAULT_CONTEXT
        context[model_name(ep)] = max(context.get(model_name(ep), 0), length)
        if (ep.autoscale or {}).get("min_replicas") == 0 and not ep.distributed and ep.pk not in idle:
            asleep.append(ep)
        pair = pairs.get(ep.pk) or pairs.get(public_of.get(ep.pk, ep.pk))
        max_queue[ep.pk] = pair.queue_depth if pair and pair.queue_depth else settings.GATEWAY_QUEUE_DEPTH
    backends: dict[str, list[Backend]] = {}
    # A replica past its endpoint's count (scaled down) leaves routing at once, before its agent drains it.
    replicas = list(
        Replica.objects.filter(
            state=Endpoint.State.READY,
            port__isnull=False,
            endpoint__desired_state=Endpoint.Desired.RUNNING,
            index__lt=F("endpoint__replicas"),
        )
        .exclude(endpoint_id__in=idle)
        .select_related("endpoint", "node")
        .only(
            "index",
            "role",
            "port",
            "devices",
            "node__name",
            "node__address",
            "endpoint__name",
            "endpoint__served_model_name",
            "endpoint__routing",
        )
    )
    # A replica on a device that left OK (on its own node or, spanning nodes, a member's) gets no traffic
    # from the moment the agent records it, before its own reconcile pass moves or holds the replica.
    faulty = unhealthy_replica_ids(replicas)
    for r in replicas:
        url = r.url
        if r.pk in faulty or url is None:  # None: port 0, which the filter's port__isnull lets through
            continue
        endpoint = r.endpoint
        scope = {endpoint.name}
        if endpoint.pk in public_of:
            scope.add(names.get(public_of[endpoint.pk], ""))
        backends.setdefault(model_name(endpoint), []).append(
            Backend(
                url=url,
                endpoint_id=endpoint.pk,
                endpoint_name=endpoint.name,
                replica_index=r.index,
                queue_depth=max_queue.get(endpoint.pk, settings.GATEWAY_QUEUE_DEPTH),
                scope_names=frozenset(scope),
                node_name=r.node.name,
                api_key=r.api_key,
                prefix=endpoint.routing == Endpoint.Routing.PREFIX,
                staged=endpoint.pk in canary,
                canary_percent=canary.get(endpoint.pk, 0),
                role=r.role,
                engine_headers=bool(pair.engine_headers) if (pair := pairs.get(endpoint.pk)) else False,
                team_id=team_of.get(endpoint.name),
            )
        )
    adapters = _add_adapters(backends, known)
    ready = {b.endpoint_id for bs in backends.values() for b in bs}
    loadable = _loadable(
        {pk: v for pk, v in on_demand.items() if pk in ready}, adapters, known, public_of, names, team_of
    )
    wakeable: dict[str, list[Wakeable]] = {}
    for ep in asleep:
        if ep.pk not in ready:
            scope = {ep.name, names.get(public_of.get(ep.pk, ep.pk), "")} - {""}
            wakeable.setdefault(model_name(ep), []).append(
                Wakeable(
                    endpoint_id=ep.pk,
                    endpoint_name=ep.name,
                    replicas=ep.replicas,
                    scope_names=frozenset(scope),
                    team_id=team_of.get(ep.name),
                )
            )
    drains = [g.stop_idle_at for g in pairs.values() if g.stop_idle_at]
    return RoutingTable(
        backends=backends,
        known=known,
        max_queue=max_queue,
        wakeable=wakeable,
        drain_due_at=min(drains, default=None),
        adapters=adapters,
        loadable=loadable,
        canary={m: b.canary_percent for m, bs in backends.items() for b in bs if b.staged},
        prefix={m for m, bs in backends.items() if any(b.prefix for b in bs)},
        context=context,
        teams={model: {team_of[n] for n in eps if n in team_of} for model, eps in known.items()},
    )


def _loadable(on_demand, adapters, known, public_of, names, team_of) -> dict[str, list[Loadable]]:
    """The registered, ready adapters of each on-demand endpoint's model that it does not hold (two queries, made
    only when an endpoint with ready replicas loads adapters on demand). Each name is known (a 403 or a hold, not
    a 404) through its endpoint."""
    if not on_demand:
        return {}
    model_of = dict(Artifact.objects.filter(pk__in={a for _, a in on_demand.values()}).values_list("pk", "model_id"))
    found = (
        Artifact.objects.alive()
        .filter(format=Artifact.Format.LORA, status=Artifact.Status.READY, model_id__in=set(model_of.values()))
        .values_list("pk", "name", "model_id")
    )
    loadable: dict[str, list[Loadable]] = {}
    for adapter_id, name, model_id in found:
        for endpoint_id, (endpoint_name, artifact_id) in on_demand.items():
            if model_of.get(artifact_id) != model_id or endpoint_id in adapters.get(name, ()):
                continue
            scope = {endpoint_name, names.get(public_of.get(endpoint_id), "")} - {""}
            loadable.setdefault(name, []).append(
                Loadable(
                    endpoint_id,
                    endpoint_name,
                    adapter_id,
                    scope_names=frozenset(scope),
                    team_id=team_of.get(endpoint_name),
                )
            )
            known.setdefault(name, set()).add(endpoint_name)
    return loadable


def _add_adapters(backends: dict[str, list[Backend]], known: dict[str, set[str]]) -> dict[str, set[int]]:
    """LoRA: each adapter an endpoint holds (Endpoint.adapters, endpoints.lora) is a model of its own, served by
    that endpoint's ready replicas; the request's "model" reaches vLLM unchanged, which picks the adapter. Its key
    scope is the adapter's name (models) or the endpoint's (endpoints), as for any model. Returns {adapter name:
    endpoint ids} (for the usage counted per adapter)."""
    endpoint_names = {name for names in known.values() for name in names}
    held: dict[int, list[str]] = {}
    adapters: dict[str, set[int]] = {}
    through = Endpoint.adapters.through.objects.filter(endpoint__name__in=endpoint_names).exclude(
        artifact__status="deleted"
    )
    for endpoint_id, endpoint_name, adapter in through.values_list("endpoint_id", "endpoint__name", "artifact__name"):
        held.setdefault(endpoint_id, []).append(adapter)
        known.setdefault(adapter, set()).add(endpoint_name)
        adapters.setdefault(adapter, set()).add(endpoint_id)
    for backend in [b for bs in backends.values() for b in bs] if held else []:
        for adapter in held.get(backend.endpoint_id, ()):
            backends.setdefault(adapter, []).append(backend)
    return adapters


@dataclass(frozen=True)
class BudgetInfo:
    """One token budget as the gateway enforces it (a team's or the key's own; read with the key)."""

    id: int
    owner: str  # "team" or "key"
    owner_id: int  # the team's id, or the key's
    tokens: int
    period: str  # Budget.Period
    mode: str  # Budget.Mode

    @property
    def enforced(self) -> bool:
        """hard and queue refuse what does not fit; soft only counts (and alerts)."""
        return self.mode != Budget.Mode.SOFT


def period_bounds(period: str, now: datetime | None = None) -> tuple[datetime, datetime]:
    """The UTC calendar period (day or month) `now` is in: (its start, the next one's start: the reset)."""
    now = (now or datetime.now(UTC)).astimezone(UTC)
    day = now.replace(hour=0, minute=0, second=0, microsecond=0)
    if period == Budget.Period.DAY:
        return day, day + timedelta(days=1)
    start = day.replace(day=1)
    end = start.replace(year=start.year + 1, month=1) if start.month == 12 else start.replace(month=start.month + 1)
    return start, end


def tokens_metered(*, team_id: int | None = None, key_id: int | None = None, since: datetime) -> int:
    """The tokens (prompt + completion) metered in UsageHour for a team or a key since `since`."""
    rows = UsageHour.objects.filter(hour__gte=since)
    rows = rows.filter(team_id=team_id) if team_id is not None else rows.filter(key_id=key_id)
    total = rows.aggregate(t=Sum(F("prompt_tokens") + F("completion_tokens")))["t"]
    return int(total or 0)


def budget_used(*, budget: BudgetInfo, since: datetime) -> int:
    """The tokens metered against a budget's owner since the start of its period: what the shared counter starts
    from when Redis lost it (a restart)."""
    if budget.owner == "team":
        return tokens_metered(team_id=budget.owner_id, since=since)
    return tokens_metered(key_id=budget.owner_id, since=since)


@dataclass(frozen=True)
class KeyInfo:
    id: int
    name: str
    models: frozenset
    endpoints: frozenset
    rpm_limit: int | None
    tpm_limit: int | None
    # The key's name in the shared limits (Redis): part of its hash, so a key made anew never inherits the window
    # of a deleted one that had the same id.
    limits_id: str = ""
    team_id: int | None = None  # the key's team: it reaches that team's endpoints alone; its usage is metered to it
    budgets: tuple[BudgetInfo, ...] = ()  # the key's own and its team's, read with the key (same cache)

    @property
    def endpoint_names(self) -> frozenset:
        """The endpoints the scope names, "=name" (that endpoint alone) as its name."""
        return frozenset(e.removeprefix("=") for e in self.endpoints)

    def allows_model(self, model: str) -> bool:
        # A key scoped to endpoints may name their model; its backends are then filtered.
        return (not self.models and not self.endpoints) or model in self.models or bool(self.endpoints)

    def allows_backend(self, backend: Backend | Wakeable | Loadable, model: str) -> bool:
        """An endpoint scope also admits the staged side of the pair it names (its replicas carry the public
        name); "=name" admits that endpoint alone: an evaluation of one side of a canary (evaluations/). Never
        another team's endpoint."""
        if self.team_id is not None and backend.team_id is not None and backend.team_id != self.team_id:
            return False
        if not self.models and not self.endpoints:
            return True
        if model in self.models or bool(self.endpoints & backend.scope_names):
            return True
        return f"={backend.endpoint_name}" in self.endpoints


def key_info(raw: str) -> KeyInfo | None:
    """The active key with this raw value, or None (unknown, revoked or expired)."""
    key = GatewayKey.objects.active().filter(key_hash=hash_token(raw)).first()
    if key is None:
        return None
    return KeyInfo(
        id=key.pk,
        name=key.name,
        models=frozenset(key.models_scope),
        endpoints=frozenset(key.endpoints_scope),
        rpm_limit=key.rpm_limit,
        tpm_limit=key.tpm_limit,
        limits_id=key.key_hash[:20],
        team_id=key.team_id,
        budgets=tuple(
            BudgetInfo(
                id=b.pk,
                owner="key" if b.key_id else "team",
                owner_id=b.key_id if b.key_id is not None else int(b.team_id or 0),
                tokens=b.tokens,
                period=b.period,
                mode=b.mode,
            )
            for b in Budget.objects.filter(Q(key=key) | Q(team_id=key.team_id)).order_by("pk")
        ),
    )


# --- an SLO-gated rollout's inputs ---------------------------------------------------------------

_SAMPLE_METRICS = {"gw.qps": "qps", "gw.p99_s": "p99_s", "gw.ttft_p99_s": "ttft_p99_s", "gw.error_rate": "error_rate"}


def gateway_samples(endpoint_id: int, *, since: float, until: float) -> list[Sample]:
    """One endpoint's gateway flushes in (since, until], as rollout samples. The gateway stores a flush
    only for an endpoint that had requests in it, at GATEWAY_TELEMETRY_SECONDS apart; a flush's request
    count is its QPS times that interval."""
    series = dict(
        Series.objects.filter(
            endpoint_id=endpoint_id, key__in=[f"e{endpoint_id}.{m}" for m in _SAMPLE_METRICS]
        ).values_list("pk", "metric")
    )
    by_ts: dict[int, dict] = {}
    for series_id, ts, value in Point.objects.filter(
        series_id__in=list(series), ts__gt=int(since), ts__lte=int(until)
    ).values_list("series_id", "ts", "value"):
        by_ts.setdefault(ts, {})[_SAMPLE_METRICS[series[series_id]]] = value
    interval = settings.GATEWAY_TELEMETRY_SECONDS
    return [
        Sample(
            ts=ts,
            requests=round((v.get("qps") or 0.0) * interval),
            p99_s=v.get("p99_s"),
            ttft_p99_s=v.get("ttft_p99_s"),
            error_rate=v.get("error_rate"),
        )
        for ts, v in sorted(by_ts.items())
    ]


def auto_rollouts():
    """The pairs whose automatic rollout is on and whose canary runs (the live side serving)."""
    return GatewayEndpoint.objects.filter(
        rollout_auto=True, staged__isnull=False, serving=GatewayEndpoint.Serving.LIVE
    ).select_related("endpoint", "staged")


def key_list(*, user):
    """The gateway keys of the user's teams (every team's for the console Admin)."""
    return visible(GatewayKey.objects.all(), user)


def key_get(key_id: int, *, user, role: str = ADMIN) -> GatewayKey:
    """A key is its team's Admins' to see and manage (and the console Admin's): 404 for another team's key."""
    return visible_get(GatewayKey.objects.all(), user, role=role, pk=key_id)


def budget_teams() -> dict[int, int]:
    """Each token budget's team (a key's budget: the key's), for telemetry's budget alerts
    (workers.telemetry.sources.register_budget_teams)."""
    return {
        pk: team if team is not None else key_team
        for pk, team, key_team in Budget.objects.values_list("pk", "team_id", "key__team_id")
    }


def key_teams() -> dict[int, int]:
    """Each gateway key's team, for telemetry (workers.telemetry.sources.register_key_teams)."""
    return dict(GatewayKey.objects.values_list("pk", "team_id"))
