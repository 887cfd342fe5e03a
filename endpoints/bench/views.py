import json

from django.contrib import messages
from django.core.paginator import Paginator
from django.http import FileResponse, Http404, HttpResponse, JsonResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.http import require_GET, require_POST

from console.exceptions import Conflict, ServiceUnavailable
from console.roles import OPERATOR, VIEWER, require_role
from endpoints.bench import compare, selectors, services, snapshots
from endpoints.bench.forms import BenchFilterForm, CompareForm
from endpoints.bench.models import BenchmarkRun, BenchmarkSweep
from endpoints.commands import format_for_shell
from endpoints.models import Endpoint


@require_role(VIEWER)
@require_GET
def bench_list(request):
    form = BenchFilterForm(
        request.GET,
        endpoints=Endpoint.objects.order_by("name").values_list("name", flat=True),
        states=selectors.STATES,
    )
    filters = form.values()
    runs = selectors.run_list(user=request.user, endpoint=filters["endpoint"] or None, state=filters["state"])
    page = Paginator(runs, 50).get_page(request.GET.get("page"))
    return render(
        request,
        "bench/bench_list.html",
        {"page": page, "form": form, "filters": filters, "sweeps": selectors.sweep_list(user=request.user)},
    )


def _run(request, run_id) -> BenchmarkRun:
    return selectors.run_get(run_id, user=request.user)


def _charts(run: BenchmarkRun) -> dict:
    detail = run.detail or {}
    ok = detail.get("ok") or []
    keep = lambda values: [v for i, v in enumerate(values or []) if (i >= len(ok) or ok[i]) and v is not None]  # noqa: E731
    return {
        "ttft_ms": keep(detail.get("ttft_ms")),
        "tpot_ms": keep(detail.get("tpot_ms")),
        "e2el_ms": keep(detail.get("e2el_ms")),
        "itl_ms": detail.get("itl_ms") or [],
        "timeline": detail.get("timeline") or {},
        "p99": {k: (run.result or {}).get(f"p99_{k}") for k in ("ttft_ms", "tpot_ms", "e2el_ms", "itl_ms")},
    }


LATENCY_ROWS = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "End-to-end"))


@require_role(VIEWER)
@require_GET
def bench_detail(request, run_id: int):
    run = _run(request, run_id)

    result = run.result or {}
    latency = [
        {"name": name, **{s: result.get(f"{s}_{key}_ms") for s in ("mean", "median", "p90", "p99")}}
        for key, name in LATENCY_ROWS
    ]
    return render(
        request,
        "bench/bench_detail.html",
        {
            "run": run,
            "result": result,
            "latency": latency,
            "charts": _charts(run),
            "command": format_for_shell(run.command, redact=True) if run.command else "",
            "config_json": json.dumps(run.config, indent=2, sort_keys=True),
            "telemetry_json": json.dumps(run.telemetry, indent=2, sort_keys=True)[:200_000],
            "telemetry_rows": snapshots.telemetry_summary(run.telemetry),
        },
    )


@require_role(VIEWER)
@require_GET
def bench_status(request, run_id: int):
    """The live part of a run's page, polled by htmx; the page reloads (charts) when it ends."""
    run = _run(request, run_id)
    response = render(request, "bench/_run_status.html", {"run": run})
    if not run.is_active and request.GET.get("was") == "active":
        response["HX-Refresh"] = "true"
    return response


@require_role(VIEWER)
@require_GET
def bench_result_json(request, run_id: int):
    """vLLM's saved result, as written (per-request arrays included)."""
    run = _run(request, run_id)
    if run.result_path:
        try:
            response = FileResponse(open(run.result_path, "rb"), content_type="application/json")
        except OSError:
            response = None
        if response is not None:
            response["Content-Disposition"] = f'attachment; filename="benchmark-{run.pk}.json"'
            return response
    if not run.result:
        raise Http404("No result yet.")
    response = JsonResponse(run.result)
    response["Content-Disposition"] = f'attachment; filename="benchmark-{run.pk}.json"'
    return response


def _cancel(request, job, what, target):
    if job is None:
        messages.error(request, f"{what} has no job to cancel.")
        return redirect(target)
    try:
        services.benchmark_cancel(job=job, user=request.user, request=request)
        messages.success(request, f"{what} cancelled.")
    except (Conflict, ServiceUnavailable) as exc:
        messages.error(request, str(exc))
    return redirect(target)


@require_role(OPERATOR)
@require_POST
def bench_cancel(request, run_id: int):
    run = selectors.run_get(run_id, user=request.user, role=OPERATOR)
    return _cancel(request, run.job, f"Benchmark #{run.pk}", run)


@require_role(OPERATOR)
@require_POST
def bench_sweep_cancel(request, sweep_id: int):
    sweep = selectors.sweep_get(sweep_id, user=request.user, role=OPERATOR)
    return _cancel(request, sweep.job, f"Sweep #{sweep.pk}", sweep)


@require_role(VIEWER)
@require_GET
def bench_sweep_detail(request, sweep_id: int):
    try:
        sweep = selectors.sweep_get(sweep_id, user=request.user)
    except BenchmarkSweep.DoesNotExist:
        raise Http404 from None
    points = selectors.sweep_points(sweep)
    ids = ",".join(str(p["run"]) for p in points if p["request_throughput"] is not None)
    return render(
        request,
        "bench/sweep_detail.html",
        {
            "sweep": sweep,
            "points": points,
            "compare_ids": ids,
            "active": sweep.state in ("queued", "running"),
        },
    )


def _compare_table(request):
    ids = selectors.parse_ids(request.GET.getlist("runs"))
    baseline = request.GET.get("baseline", "")
    overrides = {k[5:]: v for k, v in request.GET.items() if k.startswith("cost_")}
    try:
        rates = compare.cost_rates(overrides)
        error = ""
    except ValueError as exc:
        rates, error = compare.cost_rates(), f"Costs: {exc}. Using the configured costs."
    runs = selectors.runs_by_ids(ids, user=request.user)
    table = compare.compare_rows(runs, baseline_id=int(baseline) if baseline.isdigit() else None, rates=rates)
    return ids, table, overrides, error


@require_role(VIEWER)
@require_GET
def bench_compare(request):
    ids, table, _, error = _compare_table(request)
    types = sorted({r["device_type"] for r in table["rows"] if r["device_type"]})
    query = request.GET.urlencode()
    return render(
        request,
        "bench/compare.html",
        {
            "table": table,
            "ids": ids,
            "error": error,
            "query": query,
            "form": CompareForm(
                request.GET,
                rows=table["rows"],
                device_types=types,
                default_rates={t: compare.rate_for({"device_type": t}, compare.cost_rates())[1] for t in types},
            ),
            "chart": {
                "labels": [compare.plotly_text(f"#{r['id']} {r['setup']}") for r in table["rows"]],
                "qps": [r["request_throughput"] for r in table["rows"]],
                "p99": [r["p99_e2el_ms"] for r in table["rows"]],
                "efficiency": [r["cost_efficiency"] for r in table["rows"]],
            },
        },
    )


@require_role(VIEWER)
@require_GET
def bench_compare_csv(request):
    _, table, _, _ = _compare_table(request)
    response = HttpResponse(compare.to_csv(table), content_type="text/csv; charset=utf-8")
    response["Content-Disposition"] = 'attachment; filename="benchmark-compare.csv"'
    return response


@require_role(VIEWER)
@require_GET
def bench_compare_json(request):
    _, table, _, _ = _compare_table(request)
    response = JsonResponse(table)
    response["Content-Disposition"] = 'attachment; filename="benchmark-compare.json"'
    return response


def compare_url(ids) -> str:
    return reverse("bench_compare") + "?" + "&".join(f"runs={i}" for i in ids)
