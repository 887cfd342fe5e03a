"""Usage and budgets, the console's side (endpoints.usage, docs/usage.md): the usage API and its CSV (inert cells),
accelerator-hours from the replicas' event log, the budgets' API and forms, each filtered to the user's teams (another
team's team or key is a 404) and checked against their team role. The usage rows are made directly, as the gateway
writes them (endpoints.gateway.models.UsageHour)."""

import csv
import io
from datetime import UTC, datetime, timedelta

import pytest
from django.test import Client
from django.utils import timezone

from console.models import AuditEvent, Team, TeamMembership
from console.roles import ADMIN, VIEWER
from endpoints.gateway.models import Budget, UsageHour
from endpoints.gateway.services import key_create
from endpoints.models import Endpoint, EndpointEvent, Replica
from endpoints.usage import selectors, services
from models_registry.models import Artifact, Model
from tests.conftest import ApiClient, _client_for
from tests.support.accounts import make_user

HOUR = datetime(2026, 3, 2, 10, tzinfo=UTC)


def row(
    team,
    key,
    *,
    hour=HOUR,
    endpoint=None,
    model="m",
    adapter="",
    requests=1,
    errors=0,
    interrupted=0,
    prompt=10,
    completion=5,
):
    return UsageHour.objects.create(
        hour=hour,
        team=team,
        key=key,
        key_name=key.name if key else "",
        endpoint_id=endpoint.pk if endpoint else None,
        endpoint_name=endpoint.name if endpoint else "",
        model=model,
        adapter=adapter,
        requests=requests,
        errors=errors,
        interrupted=interrupted,
        prompt_tokens=prompt,
        completion_tokens=completion,
    )


@pytest.fixture
def teams(db, cpu_node, admin):
    research = Team.objects.create(name="Research", slug="research")
    default = Team.objects.get(slug=Team.DEFAULT_SLUG)
    ana = make_user("ana", None)  # Admin of Research alone
    TeamMembership.objects.create(team=research, user=ana, role=ADMIN)
    vic = make_user("vic", None)  # Viewer of Research alone
    TeamMembership.objects.create(team=research, user=vic, role=VIEWER)
    ours, _ = key_create(name="app-ours", team_id=research.pk)
    theirs, _ = key_create(name="app-theirs", team_id=default.pk)
    model = Model.objects.create(name="m-ours", team=research)
    artifact = Artifact.objects.create(model=model, format="hf", dtype="float32", path="/models/ours")
    endpoint = Endpoint.objects.create(
        name="ep-ours", artifact=artifact, node=cpu_node, served_model_name="m", team=research
    )
    return {
        "research": research,
        "default": default,
        "ana": ana,
        "vic": vic,
        "ours": ours,
        "theirs": theirs,
        "endpoint": endpoint,
    }


def window(**extra) -> str:
    since = HOUR - timedelta(hours=1)
    until = HOUR + timedelta(days=2)
    query = f"since={since.isoformat().replace('+', '%2B')}&until={until.isoformat().replace('+', '%2B')}"
    return query + "".join(f"&{k}={v}" for k, v in extra.items())


def test_usage_api_groups_sums_and_filters_to_the_users_teams(teams):
    research, default = teams["research"], teams["default"]
    row(research, teams["ours"], endpoint=teams["endpoint"], prompt=10, completion=5)
    row(research, teams["ours"], hour=HOUR + timedelta(hours=1), endpoint=teams["endpoint"], adapter="sql", errors=1)
    # Two requests, one of them in flight on a gateway that died (its tokens unknown).
    row(
        research,
        teams["ours"],
        hour=HOUR + timedelta(days=1),
        model="other",
        requests=2,
        interrupted=1,
        prompt=100,
        completion=1,
    )
    row(default, teams["theirs"], prompt=1000, completion=1000)
    vic = ApiClient(teams["vic"])
    totals = vic.get(f"/api/v1/usage?{window()}")
    assert totals.status_code == 200, totals.content
    assert totals.json()["rows"] == [
        {
            "requests": 4,
            "errors": 1,
            "interrupted": 1,
            "prompt_tokens": 120,
            "completion_tokens": 11,
            "total_tokens": 131,
        }
    ]
    by_day_model = vic.get(f"/api/v1/usage?{window(group_by='day,model')}").json()["rows"]
    assert [(r["day"][:10], r["model"], r["total_tokens"]) for r in by_day_model] == [
        ("2026-03-02", "m", 30),
        ("2026-03-03", "other", 101),
    ]
    by_adapter = vic.get(f"/api/v1/usage?{window(group_by='adapter', endpoint='ep-ours')}").json()["rows"]
    assert [(r["adapter"], r["requests"]) for r in by_adapter] == [("", 1), ("sql", 1)]
    by_hour_key = vic.get(f"/api/v1/usage?{window(group_by='hour,key', model='m')}").json()["rows"]
    assert [(r["hour"], r["key"], r["key_id"]) for r in by_hour_key] == [
        (HOUR.isoformat(), "app-ours", teams["ours"].pk),
        ((HOUR + timedelta(hours=1)).isoformat(), "app-ours", teams["ours"].pk),
    ]
    by_team = ApiClient(teams["ana"]).get(f"/api/v1/usage?{window(group_by='team')}").json()["rows"]
    assert [r["team"] for r in by_team] == ["Research"]


def test_usage_api_refuses_an_unseen_team_or_key_and_unknown_groups(teams, admin):
    vic = ApiClient(teams["vic"])
    for query in (f"team={teams['default'].pk}", f"key={teams['theirs'].pk}", "team=99999", "key=99999"):
        answer = vic.get(f"/api/v1/usage?{query}")
        assert answer.status_code == 404 and answer.json() == {"detail": "Not found."}, query
    assert vic.get(f"/api/v1/usage?team={teams['research'].pk}&key={teams['ours'].pk}").status_code == 200
    bad = vic.get("/api/v1/usage?group_by=hour,colour")
    assert bad.status_code == 400 and "group_by" in bad.json()["errors"], bad.content
    backwards = vic.get("/api/v1/usage?since=2026-03-02T10:00:00&until=2026-03-01T10:00:00")
    assert backwards.status_code == 400 and "since" in backwards.json()["errors"], backwards.content
    garbled = vic.get("/api/v1/usage?since=yesterday")
    assert garbled.status_code == 422 and "since" in str(garbled.json()["detail"]), garbled.content
    row(teams["default"], teams["theirs"])
    seen = ApiClient(admin).get(f"/api/v1/usage?{window(group_by='team')}").json()["rows"]
    assert [r["team"] for r in seen] == ["Default"]
    assert Client().get("/api/v1/usage").status_code == 401


def test_usage_csv_makes_formula_cells_inert(teams):
    key, _ = key_create(name="=HYPERLINK(1)", team_id=teams["research"].pk)
    row(teams["research"], key, model="+cmd", adapter="@sum", prompt=3, completion=4)
    row(teams["research"], key, model="-x", adapter="\tTab", hour=HOUR + timedelta(hours=1))
    vic = ApiClient(teams["vic"])
    for path in (
        f"/api/v1/usage.csv?{window(group_by='key,model,adapter')}",
        f"/api/v1/usage?{window(group_by='key,model,adapter', format='csv')}",
    ):
        answer = vic.get(path)
        assert answer.status_code == 200 and answer["Content-Type"].startswith("text/csv"), answer.content
        rows = list(csv.reader(io.StringIO(answer.content.decode())))
        assert rows[0] == [
            "key",
            "key_id",
            "model",
            "adapter",
            "requests",
            "errors",
            "interrupted",
            "prompt_tokens",
            "completion_tokens",
            "total_tokens",
        ]
        assert rows[1:] == [
            ["'=HYPERLINK(1)", str(key.pk), "'+cmd", "'@sum", "1", "0", "0", "3", "4", "7"],
            ["'=HYPERLINK(1)", str(key.pk), "'-x", "'\tTab", "1", "0", "0", "10", "5", "15"],
        ]


def test_accelerator_hours_come_from_the_replicas_runs(teams, cpu_node):
    endpoint = teams["endpoint"]
    Replica.objects.create(endpoint=endpoint, index=0, node=cpu_node, devices=[0, 1])
    Replica.objects.create(endpoint=endpoint, index=1, node=cpu_node, devices=[2])

    def event(index, kind, at):
        EndpointEvent.objects.create(endpoint=endpoint, replica_index=index, kind=kind, message=kind, created_at=at)

    # Replica 0 (2 devices): 10:30 -> 12:00, then again 12:30 -> crash 12:45. Replica 1 (1 device): 11:00 -> 11:30.
    event(0, "started", HOUR + timedelta(minutes=30))
    event(0, "ready", HOUR + timedelta(minutes=40))  # not an end
    event(0, "stopped", HOUR + timedelta(hours=2))
    event(0, "started", HOUR + timedelta(hours=2, minutes=30))
    event(0, "crashed", HOUR + timedelta(hours=2, minutes=45))
    event(1, "started", HOUR + timedelta(hours=1))
    event(1, "stopped", HOUR + timedelta(hours=1, minutes=30))
    vic = ApiClient(teams["vic"])
    got = vic.get(f"/api/v1/usage?{window(team=teams['research'].pk)}").json()["accelerator_hours"]
    assert [(r["hour"][11:16], r["replica_hours"], r["accelerator_hours"], r["team"]) for r in got] == [
        ("10:00", 0.5, 1.0, "Research"),
        ("11:00", 1.5, 2.5, "Research"),
        ("12:00", 0.25, 0.5, "Research"),
    ]
    # Another team's member sees none of it.
    other = make_user("olga", None)
    TeamMembership.objects.create(team=teams["default"], user=other, role=VIEWER)
    assert ApiClient(other).get(f"/api/v1/usage?{window()}").json()["accelerator_hours"] == []


def test_a_running_replica_counts_until_now(teams, cpu_node):
    endpoint = teams["endpoint"]
    Replica.objects.create(endpoint=endpoint, index=0, node=cpu_node, devices=[0], pid=4242)
    started = timezone.now() - timedelta(minutes=90)
    EndpointEvent.objects.create(endpoint=endpoint, replica_index=0, kind="started", message="", created_at=started)
    query = selectors.usage_query(user=teams["vic"], since=started - timedelta(hours=1))
    total = sum(r["accelerator_hours"] for r in selectors.accelerator_hours(user=teams["vic"], query=query))
    assert 1.49 < total < 1.52


def test_budgets_api_set_replace_list_delete_and_audit(teams):
    research, ana = teams["research"], ApiClient(teams["ana"])
    row(
        research,
        teams["ours"],
        hour=timezone.now().replace(minute=0, second=0, microsecond=0),
        prompt=60,
        completion=40,
    )
    made = ana.post(f"/api/v1/teams/{research.pk}/budgets", {"tokens": 1000, "period": "day", "mode": "soft"})
    assert made.status_code == 201, made.content
    assert made.json()["used"] == 100 and made.json()["percent"] == 10.0 and made.json()["mode"] == "soft"
    again = ana.post(f"/api/v1/teams/{research.pk}/budgets", {"tokens": 500, "period": "day", "mode": "queue"})
    assert again.status_code == 201 and again.json()["id"] == made.json()["id"]
    ana.post(f"/api/v1/teams/{research.pk}/budgets", {"tokens": 9000, "period": "month"})
    listed = ApiClient(teams["vic"]).get(f"/api/v1/teams/{research.pk}/budgets").json()
    assert [(b["period"], b["tokens"], b["mode"], b["used"]) for b in listed] == [
        ("day", 500, "queue", 100),
        ("month", 9000, "hard", 100),
    ]
    assert AuditEvent.objects.filter(action="budget.set", team_id=research.pk).count() == 3
    key = teams["ours"]
    made = ana.post(f"/api/v1/gateway/keys/{key.pk}/budgets", {"tokens": 150, "period": "day", "mode": "hard"})
    assert made.status_code == 201 and made.json()["key"] == key.pk and made.json()["used"] == 100
    assert ana.get(f"/api/v1/gateway/keys/{key.pk}/budgets").json()[0]["tokens"] == 150
    assert AuditEvent.objects.filter(action="gateway_key.budget.set", object_id=str(key.pk), team_id=research.pk)
    assert ana.delete(f"/api/v1/gateway/keys/{key.pk}/budgets/day").status_code == 204
    assert ana.delete(f"/api/v1/teams/{research.pk}/budgets/month").status_code == 204
    assert ana.delete(f"/api/v1/teams/{research.pk}/budgets/month").status_code == 404
    assert list(Budget.objects.values_list("team_id", "period")) == [(research.pk, "day")]
    assert AuditEvent.objects.filter(action__endswith="budget.delete").count() == 2


def test_budget_validation_names_the_field(teams):
    ana, team_id = ApiClient(teams["ana"]), teams["research"].pk
    for body, field in (
        ({"tokens": 0, "period": "day"}, "tokens"),
        ({"tokens": 10, "period": "week"}, "period"),
        ({"tokens": 10, "period": "day", "mode": "loud"}, "mode"),
        ({"tokens": 10, "period": "day", "colour": "red"}, "colour"),
    ):
        answer = ana.post(f"/api/v1/teams/{team_id}/budgets", body)
        assert answer.status_code == 422 and field in str(answer.json()["detail"]), (body, answer.content)
    assert not Budget.objects.exists()
    with pytest.raises(Exception, match="tokens"):
        services.budget_set(team=teams["research"], tokens=0, period="day", mode="hard")


def test_budget_roles_and_other_teams(teams, viewer):
    research, default = teams["research"], teams["default"]
    vic = ApiClient(teams["vic"])
    # A team Viewer reads the team's budgets but sets none, and sees no key's budgets (keys are Admins').
    assert vic.post(f"/api/v1/teams/{research.pk}/budgets", {"tokens": 5, "period": "day"}).status_code == 403
    assert vic.get(f"/api/v1/gateway/keys/{teams['ours'].pk}/budgets").status_code == 403
    # Another team's team and key are 404 to its Admin.
    ana = ApiClient(teams["ana"])
    assert ana.get(f"/api/v1/teams/{default.pk}/budgets").status_code == 404
    assert ana.post(f"/api/v1/teams/{default.pk}/budgets", {"tokens": 5, "period": "day"}).status_code == 404
    assert (
        ana.post(f"/api/v1/gateway/keys/{teams['theirs'].pk}/budgets", {"tokens": 5, "period": "day"}).status_code
        == 404
    )
    assert ana.delete(f"/api/v1/gateway/keys/{teams['theirs'].pk}/budgets/day").status_code == 404
    assert not Budget.objects.exists()


def test_usage_page_and_budget_forms(teams, admin):
    research = teams["research"]
    row(
        research,
        teams["ours"],
        hour=timezone.now().replace(minute=0, second=0, microsecond=0),
        endpoint=teams["endpoint"],
    )
    ana = _client_for(teams["ana"])
    page = ana.get("/usage/")
    assert page.status_code == 200 and b"Usage of team Research" in page.content
    assert b"app-ours" in page.content and b'id="usage-data"' in page.content and b"/api/v1/usage.csv?" in page.content
    refused = ana.post(f"/usage/teams/{research.pk}/budgets", {"tokens": "0", "period": "day", "mode": "hard"})
    assert refused.status_code == 400 and b'id="id_tokens-errors"' in refused.content
    saved = ana.post(f"/usage/teams/{research.pk}/budgets", {"tokens": "100", "period": "day", "mode": "hard"})
    assert saved.status_code == 302
    page = ana.get(f"/usage/?team={research.pk}")
    assert b"<progress max=\"100\" value=\"15\"" in page.content, page.content.decode()[:3000]
    # A Viewer sees the budget and no form; another team's page is a 404.
    vic = _client_for(teams["vic"])
    seen = vic.get("/usage/")
    assert seen.status_code == 200 and b"team-budget-table" in seen.content and b"team-budget-form" not in seen.content
    assert (
        vic.post(f"/usage/teams/{research.pk}/budgets", {"tokens": "5", "period": "day", "mode": "hard"}).status_code
        == 403
    )
    assert vic.get(f"/usage/?team={teams['default'].pk}").status_code == 404
    assert (
        ana.post(
            f"/usage/teams/{teams['default'].pk}/budgets", {"tokens": "5", "period": "day", "mode": "hard"}
        ).status_code
        == 404
    )
    # The key's budgets: a fragment of its page, and its form.
    key = teams["ours"]
    assert b"key-budgets-panel" in ana.get(f"/gateway/keys/{key.pk}/").content
    saved = ana.post(f"/gateway/keys/{key.pk}/budgets/set", {"tokens": "50", "period": "month", "mode": "soft"})
    assert saved.status_code == 302
    assert b"50/month (soft)" in ana.get("/gateway/").content  # on the key's row of the keys list
    fragment = ana.get(f"/gateway/keys/{key.pk}/budgets")
    assert fragment.status_code == 200 and b"per month" in fragment.content and b"soft" in fragment.content
    assert ana.get(f"/gateway/keys/{teams['theirs'].pk}/budgets").status_code == 404
    assert ana.post(f"/gateway/keys/{key.pk}/budgets/month/delete").status_code == 302
    assert not Budget.objects.filter(key=key).exists()
    # The console Admin picks among the teams.
    everyone = _client_for(admin).get("/usage/")
    assert b'id="id_team"' in everyone.content


def test_a_budgets_usage_counts_its_current_utc_period_only(teams):
    research, key = teams["research"], teams["ours"]
    row(research, key, hour=datetime(2026, 2, 28, 23, tzinfo=UTC), prompt=1000, completion=0)  # last month
    row(research, key, hour=datetime(2026, 3, 1, 23, tzinfo=UTC), prompt=100, completion=0)  # yesterday
    row(research, key, hour=HOUR, prompt=10, completion=5)  # today
    row(research, None, hour=HOUR, prompt=7, completion=0)  # the team's, of no key
    now = HOUR + timedelta(hours=2)
    day = services.budget_set(team=research, tokens=100, period="day")
    month = services.budget_set(key=key, tokens=100, period="month")
    assert selectors.budget_json(day, now=now) | {"id": 0} == {
        "id": 0,
        "team": research.pk,
        "key": None,
        "tokens": 100,
        "period": "day",
        "mode": "hard",
        "used": 22,
        "percent": 22.0,
        "period_start": "2026-03-02T00:00:00+00:00",
        "resets_at": "2026-03-03T00:00:00+00:00",
    }
    got = selectors.budget_json(month, now=now)
    assert (got["used"], got["percent"], got["period_start"], got["resets_at"]) == (
        115,
        115.0,
        "2026-03-01T00:00:00+00:00",
        "2026-04-01T00:00:00+00:00",
    )
    december = selectors.budget_json(month, now=datetime(2026, 12, 31, 23, 59, tzinfo=UTC))
    assert december["resets_at"] == "2027-01-01T00:00:00+00:00"
