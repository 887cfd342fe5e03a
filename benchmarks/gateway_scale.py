"""What scaling the gateway out costs and gives (docs/gateway-scale-out.md), against benchmarks/gateway.py's fake
upstream (a fixed answer after --fake-delay-ms, --fake-slots at a time), in one run:

    .venv/bin/python benchmarks/gateway_scale.py [--concurrency 1 8 16] [--requests 300] [--rounds 3]
                                                 [--gateways 3] [--seed 0] [--fake-delay-ms 5] [--fake-slots 16]

1. The shared limits' cost: one gateway, two keys, interleaved in seeded random order each round: one with no limit
   (no Redis round trip: the gateway as before the shared limits) and one with a request and a token limit far above
   the load (one Redis script per admission and one per settlement, endpoints/gateway/limits.py). P50/P99 and the
   P50 the shared limits add, at each concurrency.
2. One gateway against --gateways gateways, each behind HAProxy with the deployment's configuration
   (endpoints/gateway/balancer.py), same load: throughput and the gateways' CPU time per request (all their
   processes, the compiled data paths included). On a machine with fewer cores than gateways the throughput cannot
   grow; the CPU per request says whether each gateway's cost per request stays the same. Each pool's CPU while
   idle (--idle-seconds: its flushes, route refreshes, HAProxy's health checks, the shared routing publishes) is
   measured first; "beyond idle" is the CPU a load's requests added to that rate over the load's wall time (the
   background runs more often under load, 10 ms publishes instead of 50 ms: it is counted in "beyond idle").

Needs Redis (REDIS_URL, a database of its own, and the next two: each pool of section 2 shares its limits and
routing state in one of them, so that one pool's load does not set the other's gateways publishing every
period) and haproxy (make haproxy).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.gateway import (  # noqa: E402
    PY,
    cpu_seconds,
    free_port,
    run_load,
    setup_console,
    start_fake,
    stop_processes,
    summary,
    wait_http,
)


def start_gateway(env: dict, procs: list) -> tuple[str, subprocess.Popen]:
    port = free_port()
    proc = subprocess.Popen(
        [PY, "manage.py", "gateway", "--port", str(port)],
        cwd=ROOT,
        env={**env, "GATEWAY_MAX_CONNECTIONS_PER_ADDRESS": "0"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    procs.append(proc)
    wait_http(f"http://127.0.0.1:{port}/healthz")
    return f"127.0.0.1:{port}", proc


def start_balancer(servers: list[str], work: Path, procs: list) -> str:
    from endpoints.gateway.balancer import haproxy_config

    port = free_port()
    config = work / f"haproxy-{port}.cfg"
    # No per-request log lines here: the figures are the gateways', not the log's.
    quiet = ("    log global", "    option httplog", "    option log-separate-errors")
    text = "\n".join(x for x in haproxy_config(bind=f"127.0.0.1:{port}", servers=servers).split("\n") if x not in quiet)
    config.write_text(text)
    procs.append(
        subprocess.Popen(
            ["haproxy", "-W", "-db", "-f", str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
    )
    wait_http(f"http://127.0.0.1:{port}/healthz")
    time.sleep(2.5)  # every server's first health check passed
    return f"http://127.0.0.1:{port}"


def make_keys(env: dict) -> tuple[str, str]:
    script = """
import django; django.setup()
from endpoints.gateway.services import key_create
print(key_create(name="bench-unlimited")[1])
print(key_create(name="bench-limited", rpm_limit=10_000_000, tpm_limit=10_000_000)[1])
"""
    out = subprocess.run([PY, "-c", script], cwd=ROOT, env=env, check=True, capture_output=True, text=True)
    unlimited, limited = out.stdout.strip().splitlines()[-2:]
    return unlimited, limited


def next_database(url: str, offset: int) -> str:
    """REDIS_URL with its database number moved on by `offset`."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path=f"/{int(parts.path.strip('/') or 0) + offset}"))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument("--gateways", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fake-delay-ms", type=float, default=5)
    parser.add_argument("--fake-slots", type=int, default=16)
    parser.add_argument("--idle-seconds", type=float, default=10, help="how long each pool's idle CPU is measured")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    procs: list = []
    tmp = Path(tempfile.mkdtemp(prefix="gw-scale-"))
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "console.settings",
        "DATA_DIR": str(tmp),
        "DATABASE_URL": f"sqlite:///{tmp / 'bench.sqlite3'}",
        "SECRET_KEY": "bench-" + "x" * 50,
        "GATEWAY_TELEMETRY_SECONDS": "10",
        "GATEWAY_QUEUE_DEPTH": "10000",
    }
    os.environ.update({k: env[k] for k in ("DJANGO_SETTINGS_MODULE", "DATA_DIR", "DATABASE_URL", "SECRET_KEY")})
    try:
        upstream = start_fake(args, procs)
        setup_console(tmp / "bench.sqlite3", [upstream], "bench", env)
        unlimited, limited = make_keys(env)
        print(f"gateway_scale.py: fake upstream {args.fake_delay_ms:g} ms, {args.fake_slots} slots; seed {args.seed}")

        # 1. The shared limits' cost, one gateway, the two keys interleaved.
        address, _ = start_gateway(env, procs)
        url = f"http://{address}"
        runs = {(k, c): [] for k in ("no limit", "shared limits") for c in args.concurrency}
        for _ in range(args.rounds):
            order = [(k, c) for k in ("no limit", "shared limits") for c in args.concurrency]
            rng.shuffle(order)
            for name, c in order:
                key = unlimited if name == "no limit" else limited
                runs[(name, c)].append(asyncio.run(run_load(url, key, "bench", args.requests, c)))
        print("\n1. Shared limits (Redis) on one gateway: P50 / P99 ms, req/s")
        for c in args.concurrency:
            base, shared = summary(runs[("no limit", c)], None), summary(runs[("shared limits", c)], None)
            print(
                f"  c={c:<3} no limit {base['p50_ms']:.2f} / {base['p99_ms']:.2f} ms {base['rps']:.0f}/s   "
                f"shared limits {shared['p50_ms']:.2f} / {shared['p99_ms']:.2f} ms {shared['rps']:.0f}/s   "
                f"added P50 {shared['p50_ms'] - base['p50_ms']:+.2f} ms, throughput "
                f"{100 * shared['rps'] / base['rps']:.0f} %   errors {base['errors'] + shared['errors']}"
            )
        stop_processes(procs[-1:])
        procs.pop()

        # 2. One gateway against several, each pool behind HAProxy.
        print(f"\n2. 1 vs {args.gateways} gateways behind HAProxy (shared-limits key): req/s, gateway CPU ms/request")
        pools = {}
        for offset, n in enumerate((1, args.gateways), start=1):
            pool_env = {**env, "REDIS_URL": next_database(env.get("REDIS_URL", "redis://127.0.0.1:6379/0"), offset)}
            members = [start_gateway(pool_env, procs) for _ in range(n)]
            pools[n] = (start_balancer([a for a, _ in members], tmp, procs), [p for _, p in members])
        idle = {}  # pool size -> its gateways' CPU seconds per second, idle
        for n, (_, members) in pools.items():
            before = sum(cpu_seconds(p.pid) for p in members)
            time.sleep(args.idle_seconds)
            idle[n] = (sum(cpu_seconds(p.pid) for p in members) - before) / args.idle_seconds
        results = {(n, c): [] for n in pools for c in args.concurrency}
        cpu = dict.fromkeys(results, 0.0)
        for _ in range(args.rounds):
            order = list(results)
            rng.shuffle(order)
            for n, c in order:
                balancer, members = pools[n]
                before = sum(cpu_seconds(p.pid) for p in members)
                results[(n, c)].append(asyncio.run(run_load(balancer, limited, "bench", args.requests, c)))
                cpu[(n, c)] += sum(cpu_seconds(p.pid) for p in members) - before
        for c in args.concurrency:
            measured = {n: summary(results[(n, c)], cpu[(n, c)]) for n in pools}
            one, many = measured[1], measured[args.gateways]
            beyond = {
                n: 1000 * (cpu[(n, c)] - idle[n] * sum(r["wall"] for r in results[(n, c)])) / figures["requests"]
                for n, figures in measured.items()
            }
            print(
                f"  c={c:<3} 1 gateway {one['rps']:.0f}/s, {one['cpu_ms_per_request']:.2f} ms CPU/req "
                f"({beyond[1]:.2f} beyond idle), P50 {one['p50_ms']:.2f} ms   {args.gateways} gateways "
                f"{many['rps']:.0f}/s ({many['rps'] / one['rps']:.2f}x), {many['cpu_ms_per_request']:.2f} ms CPU/req "
                f"({beyond[args.gateways]:.2f} beyond idle), P50 {many['p50_ms']:.2f} ms   "
                f"errors {one['errors'] + many['errors']}"
            )
        print(
            "  idle: " + ", ".join(f"{n} gateway{'s' * (n > 1)} {1000 * rate:.1f} ms CPU/s" for n, rate in idle.items())
        )
        print(f"\n  measured on {os.cpu_count()} CPUs; load generator, HAProxy, gateways and upstream share them")
    finally:
        stop_processes(procs)


if __name__ == "__main__":
    main()
