"""Teams at the gateway (issue 37): a key reaches its own team's endpoints alone, on both data paths (the `gateway`
fixture). A model served only by another team's endpoint is a 404 to it, as a model that does not exist; a model
served by both teams' endpoints reaches the key's team's replicas only; /v1/models lists its team's models."""

import pytest

from console.models import Team
from endpoints.gateway import services
from endpoints.models import Endpoint
from tests.support.gateway import chat, make_endpoint


@pytest.mark.django_db(transaction=True)
def test_a_key_reaches_its_own_teams_endpoints_alone(fakes, gateway, admin):
    research = Team.objects.create(name="Research", slug="research")
    make_endpoint("ep-default", [fakes("default")], model="tiny")
    ours = make_endpoint("ep-research", [fakes("research")], model="tiny")
    make_endpoint("ep-theirs-only", [fakes("theirs")], model="other")
    Endpoint.objects.filter(pk=ours.pk).update(team=research)
    _, research_raw = services.key_create(name="app-research", team_id=research.pk, actor=admin)
    _, default_raw = services.key_create(name="app-default", actor=admin)
    _, scoped_raw = services.key_create(name="app-scoped", endpoints=["ep-theirs-only"], team_id=research.pk)
    gw = gateway()
    gw.wait_routes("tiny", 2)
    gw.wait_routes("other", 1)

    # The model both teams serve: the research key lands on the research replica, every time.
    for _ in range(6):
        answer = gw.post("/v1/chat/completions", research_raw, chat("tiny"))
        assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"] == "hello from research"
    # The model only the default team serves: as unknown to the research key (even one whose scope names it).
    for raw in (research_raw, scoped_raw):
        denied = gw.post("/v1/chat/completions", raw, chat("other"))
        assert denied.status_code == 404 and denied.json()["error"]["type"] == "model_not_found", denied.content
    unknown = gw.post("/v1/chat/completions", research_raw, chat("nope"))
    assert unknown.status_code == 404 and unknown.json()["error"] == denied.json()["error"] | {
        "message": unknown.json()["error"]["message"]
    }
    listed = gw.client.get("/v1/models", headers={"Authorization": f"Bearer {research_raw}"}).json()
    assert [m["id"] for m in listed["data"]] == ["tiny"]
    # The default team's key: its own endpoints, never the research one.
    assert gw.post("/v1/chat/completions", default_raw, chat("other")).status_code == 200
    for _ in range(6):
        answer = gw.post("/v1/chat/completions", default_raw, chat("tiny"))
        assert answer.json()["choices"][0]["message"]["content"] == "hello from default"
    listed = gw.client.get("/v1/models", headers={"Authorization": f"Bearer {default_raw}"}).json()
    assert sorted(m["id"] for m in listed["data"]) == ["other", "tiny"]
