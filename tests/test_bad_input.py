"""Bad input anywhere gets a 4xx with a message, never a 500."""
import pytest
from tests.tiny_models import build_tiny_llama_hf

@pytest.mark.django_db
def test_bad_input_never_answers_500(as_admin, admin, api_for, model_root, redis_conn):
    api = api_for(admin)
    build_tiny_llama_hf(model_root / "t")
    r = api.post("/api/v1/models", {"name": "t", "path": str(model_root / "t")}); aid = r.json()["artifacts"][0]["id"]
    urls = ["/jobs/?model=abc&page=zz", "/audit/?page=-1&since=x", f"/artifacts/{aid}/?util=abc", f"/artifacts/{aid}/?util=99",
            "/models/999999/", "/jobs/99999/status", "/endpoints/999/", "/nodes/999/", "/api/v1/jobs?limit=abc", "/api/v1/jobs?limit=-5",
            "/api/v1/models/abc", "/api/v1/artifacts/999999/capacity?memory_utilization=7"]
    for u in urls:
        resp = as_admin.get(u) if not u.startswith("/api") else api.get(u)
        assert resp.status_code < 500
    for path, data in [("/models/register", {"name": "x\x00", "path": "/\x00"}), (f"/artifacts/{aid}/convert", {"to": "om", "batch_size": "x", "seq_len": "1e9"}),
                       ("/endpoints/launch", {"name": "a", "artifact": "zz", "devices": "a,b"}), ("/endpoints/launch", {"name": "a", "artifact": str(aid), "extra_args": "{bad json", "replicas": "-1"}),
                       ("/users/create", {"username": "", "role": ""}), ("/tokens/create", {"name": "", "expires_days": "x"})]:
        resp = as_admin.post(path, data); assert resp.status_code < 500
    c = api.client
    resp = c.post("/api/v1/models", data="not json", content_type="application/json", headers=api._headers()); assert resp.status_code < 500
    resp = api.post("/api/v1/endpoints", {"name": "x", "artifact": 99999}); assert resp.status_code < 500
    resp = api.post("/api/v1/endpoints", {"name": "x", "artifact": aid, "extra_args": {"--block-size": "abc"}, "env": {"VLLM_X": "\x00"}}); assert resp.status_code < 500
