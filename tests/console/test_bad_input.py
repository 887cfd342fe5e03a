"""Bad input anywhere gets a 4xx with a message naming what was wrong, never a 500, and creates nothing."""

import html

import pytest
from django.contrib.auth import get_user_model

from console.models import ApiToken
from endpoints.models import Endpoint
from models_registry.models import Model
from tests.support.tiny_models import build_tiny_llama_hf


def page_text(response) -> str:
    return html.unescape(response.content.decode())


@pytest.mark.django_db
def test_bad_input_answers_4xx_with_a_message_and_creates_nothing(as_admin, admin, api_for, model_root, redis_conn):
    api = api_for(admin)
    build_tiny_llama_hf(model_root / "t")
    r = api.post("/api/v1/models", {"name": "t", "path": str(model_root / "t")})
    aid = r.json()["artifacts"][0]["id"]
    users, tokens, models = get_user_model().objects.count(), ApiToken.objects.count(), Model.objects.count()

    # Pages: a bad filter or page number is refused, naming the field.
    audit = as_admin.get("/audit/?page=-1&since=x")
    assert audit.status_code == 400
    assert "since: Enter a date as YYYY-MM-DD." in page_text(audit)
    assert "page: Enter a whole number between 1 and 1000000." in page_text(audit)
    assert as_admin.get("/audit/?since=2020-01-01").status_code == 200
    # Filters these pages ignore when they are not numbers: the page shows its defaults.
    for url in ["/jobs/?model=abc&page=zz", f"/artifacts/{aid}/?util=abc", f"/artifacts/{aid}/?util=99"]:
        assert as_admin.get(url).status_code == 200, url
    for url in ["/models/999999/", "/jobs/99999/status", "/endpoints/999/", "/nodes/999/"]:
        assert as_admin.get(url).status_code == 404, url

    # The API: 422 naming the query or path parameter, 404 for what does not exist.
    for url, loc, msg in [
        ("/api/v1/jobs?limit=abc", ["query", "limit"], "valid integer"),
        ("/api/v1/jobs?limit=-5", ["query", "limit"], "greater than or equal to 1"),
        ("/api/v1/jobs?limit=501", ["query", "limit"], "less than or equal to 500"),
        ("/api/v1/audit?limit=0", ["query", "limit"], "greater than or equal to 1"),
        ("/api/v1/models/abc", ["path", "model_id"], "valid integer"),
    ]:
        resp = api.get(url)
        assert resp.status_code == 422, (url, resp.content)
        [error] = resp.json()["detail"]
        assert error["loc"] == loc and msg in error["msg"], (url, error)
    assert api.get("/api/v1/artifacts/999999/capacity?memory_utilization=7").status_code == 404

    # Forms: 400, the message on the page, nothing created.
    for path, data, message in [
        ("/models/register", {"name": "x\x00", "path": "/\x00"}, "Use letters, digits, '.', '_' and '-'"),
        (
            f"/artifacts/{aid}/convert",
            {"to": "om", "batch_size": "x", "seq_len": "1e9"},
            "Enter a whole number between 1 and 64.",
        ),
        ("/endpoints/launch", {"name": "a", "artifact": "zz", "devices": "a,b"}, "Choose an existing artifact."),
        (
            "/endpoints/launch",
            {"name": "a", "artifact": str(aid), "extra_args": "{bad json", "replicas": "-1"},
            "Expecting property name enclosed in double quotes",
        ),
        ("/endpoints/launch", {"name": "a", "artifact": str(aid)}, "No node has registered"),
        ("/users/create", {"username": "", "role": ""}, "Enter a username."),
        ("/tokens/create", {"name": "", "expires_days": "x"}, "Give the token a name"),
        (
            "/tokens/create",
            {"name": "ci", "expires_days": "x"},
            "Expiry must be a whole number of days, between 1 and 3650.",
        ),
    ]:
        resp = as_admin.post(path, data)
        assert resp.status_code == 400, (path, resp.status_code)
        assert message in page_text(resp), (path, message)
    assert get_user_model().objects.count() == users and ApiToken.objects.count() == tokens
    assert Model.objects.count() == models and not Endpoint.objects.exists()

    c = api.client
    resp = c.post("/api/v1/models", data="not json", content_type="application/json", headers=api._headers())
    assert resp.status_code == 400 and resp.json()["detail"] == "Cannot parse request body"
    resp = api.post("/api/v1/endpoints", {"name": "x", "artifact": 99999})
    assert resp.status_code == 400 and resp.json()["errors"]["artifact"] == ["Choose an existing artifact."]
    resp = api.post(
        "/api/v1/endpoints",
        {"name": "x", "artifact": aid, "extra_args": {"--block-size": "abc"}, "env": {"VLLM_X": "\x00"}},
    )
    assert resp.status_code == 400 and "node" in resp.json()["errors"], resp.content
    assert Model.objects.count() == models and not Endpoint.objects.exists()
