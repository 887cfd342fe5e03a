"""Teams in the web forms (issue 37): the model registration, endpoint launch and gateway key forms offer a team
among those where the user may make one (Operator; Admin for a key), left out where there is no choice; another
team posted is refused beside the field and nothing is made; the launch form offers the user's teams' artifacts
alone."""

from django.test import Client

from console.models import Team, TeamMembership
from console.roles import ADMIN
from endpoints.gateway.models import GatewayKey
from models_registry.models import Model
from tests.conftest import ApiClient
from tests.console.test_teams import two_teams  # noqa: F401 (a fixture)
from tests.support.tiny_models import build_tiny_llama_hf


def test_forms_offer_the_users_teams_where_there_is_a_choice(two_teams, model_root, redis_conn):  # noqa: F811
    ana = Client()
    ana.force_login(two_teams["ana"])
    # One team: no field to choose from.
    for path in ("/gateway/", "/models/register", "/endpoints/launch"):
        assert 'name="team"' not in ana.get(path).content.decode(), path
    lab = Team.objects.create(name="Lab", slug="lab")
    TeamMembership.objects.create(team=lab, user=two_teams["ana"], role=ADMIN)
    for path in ("/gateway/", "/models/register", "/endpoints/launch"):
        page = ana.get(path).content.decode()
        assert 'name="team"' in page and ">Lab<" in page and ">Research<" in page, path
        assert ">Default<" not in page, path  # not hers
    launch = ana.get("/endpoints/launch").content.decode()
    assert str(two_teams["theirs"]["artifact"]) not in launch  # another team's artifact is not offered

    made = ana.post("/gateway/keys/create", {"name": "lab-app", "team": lab.pk})
    assert made.status_code == 200 and GatewayKey.objects.get(name="lab-app").team == lab
    refused = ana.post("/gateway/keys/create", {"name": "sneaky", "team": two_teams["default"].pk})
    assert refused.status_code == 400 and "No team" in refused.content.decode()
    assert not GatewayKey.objects.filter(name="sneaky").exists()

    tiny = build_tiny_llama_hf(model_root / "tiny-hf")
    refused = ana.post("/models/register", {"name": "sneaky", "path": str(tiny), "team": two_teams["default"].pk})
    assert refused.status_code == 400 and "No team" in refused.content.decode()
    registered = ana.post("/models/register", {"name": "lab-model", "path": str(tiny), "team": lab.pk})
    assert registered.status_code == 302 and Model.objects.get(name="lab-model").team == lab
    assert not Model.objects.filter(name="sneaky").exists()

    api = ApiClient(two_teams["ana"])
    ours = two_teams["ours"]
    launch = api.post(
        "/api/v1/endpoints",
        {
            "name": "sneaky-ep",
            "artifact": ours["artifact"].pk,
            "node": ours["endpoint"].node_id,
            "team": two_teams["default"].pk,
        },
    )
    assert launch.status_code == 400 and "team" in launch.json()["errors"], launch.content
