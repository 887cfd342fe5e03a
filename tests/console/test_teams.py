"""Teams (console.teams, the selectors of each app): a team's objects are seen by its members and the console Admin
only; another team's object is a 404 on every page and API path that names it (never a 403, which would tell it
exists), and lists leave it out; a team Admin manages their team's gateway keys and no other's; the teams API; the
migration that puts existing data in the default team, reversed and applied again."""

import time

import pytest
from django.core.management import call_command
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.test import Client

from console.models import AuditEvent, Team, TeamMembership
from console.roles import ADMIN, VIEWER, user_role
from console.services import api_token_create
from endpoints.bench.models import BenchmarkRun, BenchmarkSweep
from endpoints.gateway.services import key_create
from endpoints.models import Endpoint
from endpoints.profiling.models import Profile
from models_registry.models import Artifact, Model
from tests.conftest import ApiClient, _client_for
from tests.support.accounts import make_user
from workers.telemetry.models import Series


def objects_of(team: Team, node, suffix: str) -> dict:
    """One of each thing a team owns, made the way the services make them (the team follows the parent)."""
    model = Model.objects.create(name=f"model-{suffix}", team=team)
    artifact = Artifact.objects.create(model=model, format="hf", dtype="float32", path=f"/models/{suffix}")
    endpoint = Endpoint.objects.create(name=f"ep-{suffix}", artifact=artifact, node=node, served_model_name=suffix)
    sweep = BenchmarkSweep.objects.create(endpoint=endpoint, endpoint_name=endpoint.name)
    run = BenchmarkRun.objects.create(endpoint=endpoint, endpoint_name=endpoint.name, num_prompts=8, status="succeeded")
    profile = Profile.objects.create(endpoint=endpoint, endpoint_name=endpoint.name, replica_index=0, duration_s=5)
    key, _ = key_create(name=f"app-{suffix}", team_id=team.pk)
    return {
        "model": model,
        "artifact": artifact,
        "endpoint": endpoint,
        "sweep": sweep,
        "run": run,
        "profile": profile,
        "key": key,
    }


@pytest.fixture
def two_teams(db, cpu_node, admin):
    research = Team.objects.create(name="Research", slug="research")
    ana = make_user("ana", None)  # no console role: an Operator and Admin of Research alone
    TeamMembership.objects.create(team=research, user=ana, role=ADMIN)
    vic = make_user("vic", None)
    TeamMembership.objects.create(team=research, user=vic, role=VIEWER)
    return {
        "research": research,
        "default": Team.objects.get(slug=Team.DEFAULT_SLUG),
        "ana": ana,
        "vic": vic,
        "ours": objects_of(research, cpu_node, "ours"),
        "theirs": objects_of(Team.objects.get(slug=Team.DEFAULT_SLUG), cpu_node, "theirs"),
    }


def pages(o: dict) -> list[str]:
    return [
        f"/models/{o['model'].pk}/",
        f"/artifacts/{o['artifact'].pk}/",
        f"/artifacts/{o['artifact'].pk}/jobs",
        f"/artifacts/{o['artifact'].pk}/served-by",
        f"/endpoints/{o['endpoint'].pk}/",
        f"/endpoints/{o['endpoint'].pk}/live",
        f"/benchmarks/{o['run'].pk}/",
        f"/benchmarks/sweeps/{o['sweep'].pk}/",
        f"/profiles/{o['profile'].pk}/",
        f"/gateway/keys/{o['key'].pk}/",
    ]


def api_paths(o: dict) -> list[str]:
    return [
        f"/api/v1/models/{o['model'].pk}",
        f"/api/v1/artifacts/{o['artifact'].pk}",
        f"/api/v1/endpoints/{o['endpoint'].pk}",
        f"/api/v1/benchmarks/{o['run'].pk}",
        f"/api/v1/benchmarks/sweeps/{o['sweep'].pk}",
        f"/api/v1/endpoints/{o['endpoint'].pk}/profiles/{o['profile'].pk}",
        f"/api/v1/gateway/keys/{o['key'].pk}",
    ]


def writes(o: dict) -> list[str]:
    """POSTs a team Admin may make on their own team's objects."""
    return [
        f"/endpoints/{o['endpoint'].pk}/stop",
        f"/gateway/keys/{o['key'].pk}/revoke",
        f"/models/{o['model'].pk}/delete",
        f"/profiles/{o['profile'].pk}/delete",
    ]


def test_another_teams_objects_are_404_on_pages_and_api(two_teams):
    ana = Client()
    ana.force_login(two_teams["ana"])
    for path in pages(two_teams["theirs"]):
        assert ana.get(path).status_code == 404, path
    for path in writes(two_teams["theirs"]):
        assert ana.post(path).status_code == 404, path
    for path in api_paths(two_teams["theirs"]):
        response = ana.get(path)
        assert response.status_code == 404 and response.json() == {"detail": "Not found."}, (path, response.content)
    assert ana.delete(f"/api/v1/endpoints/{two_teams['theirs']['endpoint'].pk}").status_code == 404
    # Nothing of theirs changed.
    theirs = two_teams["theirs"]
    assert Endpoint.objects.get(pk=theirs["endpoint"].pk).desired_state == theirs["endpoint"].desired_state
    assert Model.objects.get(pk=theirs["model"].pk).deleted_at is None
    # Their own: seen.
    for path in pages(two_teams["ours"]):
        assert ana.get(path).status_code == 200, path
    for path in api_paths(two_teams["ours"]):
        assert ana.get(path).status_code == 200, path


def test_lists_show_the_users_teams_only(two_teams):
    ana = _client_for(two_teams["ana"])
    ours, theirs = two_teams["ours"], two_teams["theirs"]
    for path, name in (("/api/v1/models", "name"), ("/api/v1/endpoints", "name"), ("/api/v1/gateway/keys", "name")):
        names = {item[name] for item in ana.get(path).json()}
        assert any(n.endswith("ours") for n in names) and not any(n.endswith("theirs") for n in names), (path, names)
    runs = ana.get("/api/v1/benchmarks").json()
    assert [r["id"] for r in runs] == [ours["run"].pk]
    for path, mine, other in (
        ("/models/", "model-ours", "model-theirs"),
        ("/endpoints/", "ep-ours", "ep-theirs"),
        ("/gateway/", "app-ours", "app-theirs"),
        ("/benchmarks/", f"/benchmarks/{ours['run'].pk}/", f"/benchmarks/{theirs['run'].pk}/"),
    ):
        html = ana.get(path).content.decode()
        assert mine in html and other not in html, path
    compare = ana.get(f"/api/v1/benchmarks/compare?runs={ours['run'].pk},{theirs['run'].pk}").json()
    assert [row["id"] for row in compare["rows"]] == [ours["run"].pk]


def test_audit_rows_about_another_teams_objects_are_hidden(two_teams, as_admin):
    ana = _client_for(two_teams["ana"])
    theirs, ours = two_teams["theirs"]["key"], two_teams["ours"]["key"]
    about = {(e["object_type"], e["object_id"]) for e in ana.get("/api/v1/audit?limit=1000").json()}
    assert ("gatewaykey", str(ours.pk)) in about and ("gatewaykey", str(theirs.pk)) not in about
    page = ana.get("/audit/?object_type=gatewaykey").content.decode()
    assert "app-ours" in page and "app-theirs" not in page
    everything = {(e["object_type"], e["object_id"]) for e in as_admin.get("/api/v1/audit?limit=1000").json()}
    assert ("gatewaykey", str(theirs.pk)) in everything


def test_per_key_series_and_metrics_labels_are_the_keys_teams(two_teams, as_admin, settings):
    """The gateway's per-key telemetry (gk<id>.*), in the series API and on /metrics: a member of another team sees
    neither the series nor the key's name and id; the console Admin and the shared METRICS_TOKEN see both."""
    now = int(time.time())
    keys = {"ours": two_teams["ours"]["key"], "theirs": two_teams["theirs"]["key"]}
    for key in keys.values():
        Series.objects.create(
            key=f"gk{key.pk}.gk.requests_pm", metric="gk.requests_pm", label=key.name, last_ts=now, last_value=7.0
        )
    ana = _client_for(two_teams["ana"])
    found = ana.get("/api/v1/telemetry/series", {"metric": "gk.requests_pm", "range": "15m"}).json()
    assert [s["label"] for s in found["series"]] == ["app-ours"], found
    theirs = ana.get("/api/v1/telemetry/series", {"metric": "gk.requests_pm", "gateway_key": keys["theirs"].pk})
    assert theirs.json()["series"] == []
    metrics = ana.get("/metrics").content.decode()
    assert (
        'key="app-ours"' in metrics and "app-theirs" not in metrics and f'key_id="{keys["theirs"].pk}"' not in metrics
    )
    _, raw = api_token_create(user=two_teams["ana"], name="prometheus")
    by_token = Client().get("/metrics", HTTP_AUTHORIZATION=f"Bearer {raw}").content.decode()
    assert "app-ours" in by_token and "app-theirs" not in by_token
    assert "app-theirs" in as_admin.get("/metrics").content.decode()
    settings.METRICS_TOKEN = "shared-scrape-token"
    fleet = Client().get("/metrics", HTTP_AUTHORIZATION="Bearer shared-scrape-token").content.decode()
    assert "app-ours" in fleet and "app-theirs" in fleet


def test_the_console_admin_sees_every_team(two_teams, as_admin):
    names = {m["name"] for m in as_admin.get("/api/v1/models").json()}
    assert {"model-ours", "model-theirs"} <= names
    for path in api_paths(two_teams["ours"]) + api_paths(two_teams["theirs"]):
        assert as_admin.get(path).status_code == 200, path


def test_team_roles_decide_what_a_member_may_do(two_teams):
    vic = Client()
    vic.force_login(two_teams["vic"])  # a Viewer of Research
    ours = two_teams["ours"]
    assert vic.get(f"/endpoints/{ours['endpoint'].pk}/").status_code == 200
    assert vic.post(f"/endpoints/{ours['endpoint'].pk}/stop").status_code == 403
    assert vic.get(f"/gateway/keys/{ours['key'].pk}/").status_code == 403  # a key is its team Admins'
    assert user_role(two_teams["vic"]) == VIEWER and user_role(two_teams["ana"]) == ADMIN
    # A team Admin is no console Admin: users and nodes stay the console's.
    ana = Client()
    ana.force_login(two_teams["ana"])
    assert ana.get("/users/").status_code == 403
    assert 'href="/users/"' not in ana.get("/").content.decode()  # nor the link to them
    assert ana.get("/api/v1/users").status_code == 403
    # Their own team's key: revoked by its team Admin.
    assert ana.post(f"/gateway/keys/{ours['key'].pk}/revoke").status_code == 302
    ours["key"].refresh_from_db()
    assert ours["key"].revoked_at is not None


def test_new_objects_go_to_a_team_of_the_user(two_teams):
    ana = ApiClient(two_teams["ana"])
    created = ana.post("/api/v1/gateway/keys", {"name": "research-app"})
    assert created.status_code == 201 and created.json()["team"] == two_teams["research"].pk
    refused = ana.post("/api/v1/gateway/keys", {"name": "sneaky", "team": two_teams["default"].pk})
    assert refused.status_code == 400 and "team" in refused.json()["errors"], refused.content
    launch = ana.post(
        "/api/v1/endpoints",
        {
            "name": "sneaky-ep",
            "artifact": two_teams["theirs"]["artifact"].pk,
            "node": two_teams["theirs"]["endpoint"].node_id,
        },
    )
    assert launch.status_code == 400 and "artifact" in launch.json()["errors"], launch.content
    bench = ana.post("/api/v1/benchmarks", {"endpoint": two_teams["theirs"]["endpoint"].pk})
    assert bench.status_code == 400 and "endpoint" in bench.json()["errors"], bench.content


def test_teams_api(two_teams, admin):
    as_admin = ApiClient(admin)
    created = as_admin.post("/api/v1/teams", {"name": "Serving Ops"})
    assert created.status_code == 201 and created.json()["slug"] == "serving-ops"
    team_id = created.json()["id"]
    assert as_admin.post("/api/v1/teams", {"name": "serving ops"}).status_code == 400
    added = as_admin.post(f"/api/v1/teams/{team_id}/members", {"user": "vic", "role": "Operator"})
    assert added.status_code == 200 and added.json()["members"] == [{"user": "vic", "role": "Operator"}]
    assert AuditEvent.objects.filter(action="team.member", object_id=str(team_id)).exists()
    bad = as_admin.post(f"/api/v1/teams/{team_id}/members", {"user": "vic", "role": "Boss"})
    assert bad.status_code == 400 and "role" in bad.json()["errors"]
    nobody = as_admin.post(f"/api/v1/teams/{team_id}/members", {"user": "nobody-here", "role": "Viewer"})
    assert nobody.status_code == 400 and "user" in nobody.json()["errors"]

    ana = ApiClient(two_teams["ana"])  # Admin of Research only
    assert [t["slug"] for t in ana.get("/api/v1/teams").json()] == ["research"]
    assert ana.post("/api/v1/teams", {"name": "Mine"}).status_code == 403  # making teams is the console Admin's
    assert ana.post(f"/api/v1/teams/{team_id}/members", {"user": "ana", "role": "Admin"}).status_code == 404
    research = two_teams["research"].pk
    assert ana.post(f"/api/v1/teams/{research}/members", {"user": "vic", "role": "Operator"}).status_code == 200
    vic = ApiClient(two_teams["vic"])  # now an Operator of Research, not its Admin
    assert vic.post(f"/api/v1/teams/{research}/members", {"user": "vic", "role": "Admin"}).status_code == 403


@pytest.mark.django_db(transaction=True)
def test_the_default_team_migration_is_reversible(cpu_node):
    before = [
        ("console", "0003_external_identity"),
        ("models_registry", "0004_lora_adapters"),
        ("endpoints", "0014_lora_adapters"),
    ]
    executor = MigrationExecutor(connection)
    executor.migrate(before)
    executor.loader.build_graph()
    old = executor.loader.project_state(before).apps
    node = old.get_model("workers", "Node").objects.get(pk=cpu_node.pk)
    model = old.get_model("models_registry", "Model").objects.create(name="kept")
    artifact = old.get_model("models_registry", "Artifact").objects.create(model=model, format="hf", path="/m")
    old.get_model("endpoints", "Endpoint").objects.create(name="kept-ep", artifact=artifact, node=node)
    call_command("migrate", verbosity=0)
    default = Team.objects.get(slug=Team.DEFAULT_SLUG)
    assert Model.objects.get(name="kept").team == default
    assert Artifact.objects.get(path="/m").team == default and Endpoint.objects.get(name="kept-ep").team == default
    executor = MigrationExecutor(connection)
    executor.migrate(before)  # back: the column goes, the data stays
    executor.loader.build_graph()
    assert (
        executor.loader.project_state(before)
        .apps.get_model("models_registry", "Model")
        .objects.filter(name="kept")
        .exists()
    )
    call_command("migrate", verbosity=0)
    assert Model.objects.get(name="kept").team.slug == Team.DEFAULT_SLUG
