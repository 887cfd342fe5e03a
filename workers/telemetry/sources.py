"""What telemetry learns from the apps above it, by registration (AppConfig.ready()):
collectors that add readings to a node's pass, and the facts about served things that the
alert rules, the fleet summary and the Prometheus exposition report."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from workers.models import Node


@dataclass
class Contribution:
    """A collector's part of one pass. `owners` maps a PID to what it serves
    ({"endpoint_id", "endpoint", "replica"}), so device processes can be attributed."""

    readings: list = field(default_factory=list)  # of workers.telemetry.services.Reading
    errors: list[str] = field(default_factory=list)
    owners: dict[int, dict] = field(default_factory=dict)


@dataclass(frozen=True)
class ServedFact:
    """One endpoint that should be serving: its id, name, state, node, and whether it is ready."""

    id: int
    name: str
    state: str
    node_id: int | None
    ready: bool
    team_id: int | None = None  # its team: the fleet summary and /metrics count it for that team's readers only


Collector = Callable[[Node], Contribution]
_collectors: dict[str, Collector] = {}
_served_facts: list[Callable[[], list[ServedFact]]] = []
_endpoint_names: list[Callable[[set[int]], dict[int, str]]] = []


def register_collector(name: str, collector: Collector) -> None:
    """collector(node) runs in each telemetry pass of that node's agent, beside the device sample."""
    _collectors[name] = collector


def registered_collectors() -> list[Collector]:
    return list(_collectors.values())


def register_served_facts(provider: Callable[[], list[ServedFact]]) -> None:
    if provider not in _served_facts:
        _served_facts.append(provider)


def served_facts() -> list[ServedFact]:
    return [fact for provider in _served_facts for fact in provider()]


def register_endpoint_names(provider: Callable[[set[int]], dict[int, str]]) -> None:
    """provider(ids) -> {id: name} of the endpoints that exist among ids (series and alerts keep an endpoint's id)."""
    if provider not in _endpoint_names:
        _endpoint_names.append(provider)


def endpoint_names(ids: set[int]) -> dict[int, str]:
    names: dict[int, str] = {}
    for provider in _endpoint_names:
        names.update(provider(ids))
    return names


TeamsOf = Callable[[], dict[int, int]]  # {object id: team id}


def _register(providers: list[TeamsOf], provider: TeamsOf) -> None:
    if provider not in providers:
        providers.append(provider)


def _other_teams(providers: list[TeamsOf], team_ids: set[int] | None) -> set[int]:
    """The ids of the objects whose team is not in `team_ids` (None: every team's seen)."""
    if team_ids is None:
        return set()
    return {obj for provider in providers for obj, team in provider().items() if team not in team_ids}


# The team of each gateway key, from the gateway (endpoints): its per-key series (gk<id>.*) are that team's members'
# to read (console.teams), in the series API and on /metrics.
_key_teams: list[TeamsOf] = []
# The team of each endpoint, from serving: its series (e<id>.*, the gateway's per-endpoint ones), alerts, readiness
# and place in the fleet summary are that team's members' to read (console.teams).
_endpoint_teams: list[TeamsOf] = []
# The team of each token budget (a key's budget: the key's team), from the gateway (endpoints): the budget alerts it
# raises (subject "budget:<id>:…") are that team's members' to read.
_budget_teams: list[TeamsOf] = []


def register_key_teams(provider: TeamsOf) -> None:
    _register(_key_teams, provider)


def register_endpoint_teams(provider: TeamsOf) -> None:
    _register(_endpoint_teams, provider)


def register_budget_teams(provider: TeamsOf) -> None:
    _register(_budget_teams, provider)


def hidden_endpoints(team_ids: set[int] | None) -> set[int]:
    """The ids of the endpoints of teams not in `team_ids` (None: every team's seen)."""
    return _other_teams(_endpoint_teams, team_ids)


def processes_seen(latest: dict | None, hidden: set[int]) -> list[dict]:
    """A device's processes (its latest reading) as a user sees them: one serving an endpoint in `hidden` (another
    team's: hidden_endpoints) keeps its pid, name and memory, loses which endpoint it serves and is marked
    `other_team`. The node is shared, the endpoint is not."""
    seen = []
    for proc in (latest or {}).get("processes", []):
        if proc.get("endpoint_id") in hidden:
            proc = {k: v for k, v in proc.items() if k not in ("endpoint_id", "endpoint", "replica")}
            proc["other_team"] = True
        seen.append(proc)
    return seen


def hidden_keys(team_ids: set[int] | None) -> set[str]:
    """The ids (as in the series' keys) of the gateway keys of teams not in `team_ids` (None: every team's seen)."""
    return {str(key) for key in _other_teams(_key_teams, team_ids)}


def hidden_budgets(team_ids: set[int] | None) -> set[int]:
    """The ids of the token budgets of teams not in `team_ids` (None: every team's seen)."""
    return _other_teams(_budget_teams, team_ids)
