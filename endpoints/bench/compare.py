"""The compare table: set-up | QPS | P99 latency | cost efficiency relative to a baseline.

Cost of a set-up = devices it used × cost per device-hour of their type
(settings.BENCH_COST_PER_DEVICE_HOUR, overridable per comparison). Cost efficiency is
throughput per unit of cost, divided by the baseline's:

    efficiency(run) = (QPS(run) / cost(run)) / (QPS(baseline) / cost(baseline))

so the baseline reads 1.00 and 1.20 means 20 % more requests for the same money."""

import csv
import io

from django.conf import settings

COLUMNS = (
    ("id", "Run"),
    ("setup", "Set-up"),
    ("endpoint", "Endpoint"),
    ("state", "State"),
    ("quantization", "Quantization"),
    ("device_type", "Device type"),
    ("device_count", "Devices"),
    ("tensor_parallel_size", "TP"),
    ("max_concurrency", "Concurrency"),
    ("request_rate", "Request rate"),
    ("num_prompts", "Prompts"),
    ("input_len", "Input len"),
    ("output_len", "Output len"),
    ("request_throughput", "QPS"),
    ("output_throughput", "Output tok/s"),
    ("total_token_throughput", "Total tok/s"),
    ("p99_e2el_ms", "P99 latency ms"),
    ("median_e2el_ms", "Median latency ms"),
    ("p99_ttft_ms", "P99 TTFT ms"),
    ("median_tpot_ms", "Median TPOT ms"),
    ("p99_tpot_ms", "P99 TPOT ms"),
    ("failed", "Failed"),
    ("cost_per_device_hour", "Cost / device-hour"),
    ("cost_per_hour", "Cost / hour"),
    ("cost_per_million_output_tokens", "Cost / 1M output tokens"),
    ("qps_vs_baseline", "QPS × baseline"),
    ("p99_vs_baseline", "P99 × baseline"),
    ("cost_efficiency", "Cost efficiency × baseline"),
)
METRICS = (
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "p99_e2el_ms",
    "median_e2el_ms",
    "p99_ttft_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "failed",
)


def cost_rates(overrides: dict | None = None) -> dict[str, float]:
    """Cost per device-hour by device type (lower-case keys), settings first, then overrides."""
    rates = {str(k).strip().lower(): float(v) for k, v in getattr(settings, "BENCH_COST_PER_DEVICE_HOUR", {}).items()}
    for key, value in (overrides or {}).items():
        if value in (None, ""):
            continue
        value = float(value)
        if value < 0:
            raise ValueError(f"cost for {key} must not be negative")
        rates[str(key).strip().lower()] = value
    return rates


def rate_for(config: dict, rates: dict[str, float]) -> tuple[str | None, float | None]:
    """The rate that applies: device name (e.g. 910b4), then kind (npu/gpu/cpu), platform, default."""
    for key in (config.get("device_type"), config.get("device_kind"), config.get("platform"), "default"):
        if key and str(key).lower() in rates:
            return str(key).lower(), rates[str(key).lower()]
    return None, None


def _ratio(a, b):
    if a is None or b in (None, 0):
        return None
    return a / b


def compare_rows(runs, *, baseline_id: int | None = None, rates: dict[str, float] | None = None) -> dict:
    """Rows for the compare table, in the order given; `baseline` is a run id among them
    (default: the first run with a result)."""
    rates = cost_rates() if rates is None else rates
    rows = []
    for run in runs:
        config = run.config or {}
        result = run.result or {}
        row = {
            "id": run.pk,
            "setup": run.setup,
            "endpoint": run.endpoint_name,
            "state": run.state,
            "quantization": config.get("quantization"),
            "device_type": config.get("device_type"),
            "device_count": config.get("device_count"),
            "tensor_parallel_size": config.get("tensor_parallel_size"),
            "max_concurrency": run.max_concurrency,
            "request_rate": run.request_rate,
            "num_prompts": run.num_prompts,
            "input_len": run.input_len,
            "output_len": run.output_len,
            **{m: result.get(m) for m in METRICS},
        }
        key, rate = rate_for(config, rates)
        row["cost_key"], row["cost_per_device_hour"] = key, rate
        count = config.get("device_count")
        row["cost_per_hour"] = rate * count if rate is not None and count else None
        qps, out_tps, cost = row["request_throughput"], row["output_throughput"], row["cost_per_hour"]
        row["qps_per_cost"] = _ratio(qps, cost)  # requests/s per (cost unit / hour)
        row["cost_per_million_output_tokens"] = (
            (cost / (out_tps * 3600) * 1e6) if cost is not None and out_tps else None
        )
        rows.append(row)
    with_result = [r for r in rows if r["request_throughput"] is not None]
    base = next((r for r in with_result if r["id"] == baseline_id), with_result[0] if with_result else None)
    for row in rows:
        row["baseline"] = base is not None and row["id"] == base["id"]
        row["qps_vs_baseline"] = _ratio(row["request_throughput"], base and base["request_throughput"])
        row["p99_vs_baseline"] = _ratio(row["p99_e2el_ms"], base and base["p99_e2el_ms"])
        row["cost_efficiency"] = _ratio(row["qps_per_cost"], base and base["qps_per_cost"])
    return {
        "baseline": base["id"] if base else None,
        "rates": rates,
        "currency": getattr(settings, "BENCH_COST_CURRENCY", ""),
        "rows": rows,
    }


def to_csv(table: dict) -> str:
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow([title for _, title in COLUMNS] + ["Baseline"])
    for row in table["rows"]:
        writer.writerow([_cell(row.get(key)) for key, _ in COLUMNS] + ["yes" if row["baseline"] else ""])
    return out.getvalue()


def _cell(value):
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, str):
        return csv_text(value)
    return value


#: What makes a spreadsheet read a cell as a formula (OWASP, "CSV Injection"): = + - @, and a tab or carriage
#: return before one.
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def csv_text(value: str) -> str:
    """A text cell of an exported CSV, inert in a spreadsheet: one that would start a formula gets a leading
    single quote, which Excel, LibreOffice and Google Sheets show as text (numbers are not text: not changed)."""
    return "'" + value if value.startswith(FORMULA_STARTS) else value


def plotly_text(value: str) -> str:
    """A label for a Plotly trace name, tick or annotation: Plotly renders <a href>, <b> and others in them, and
    turns &amp; &lt; &gt; back into the characters after it has looked for tags, so a label shows as typed."""
    return str(value).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
