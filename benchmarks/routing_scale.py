"""Do two gateways pile onto one replica? The shared routing state (endpoints/gateway/shared_routing.py) against
each gateway routing alone, and what sharing costs a request (docs/gateway-scale-out.md, "Routing with several
gateways"):

    REDIS_URL=redis://127.0.0.1:6379/N .venv/bin/python benchmarks/routing_scale.py [--replicas 4]
        [--clients 4 8] [--rates 10 15] [--service-ms 200] [--slots 1] [--seconds 20] [--concurrency 1 8 16]
        [--requests 300] [--rounds 2] [--seed 0]

0. Each gateway's CPU while idle (--idle-seconds), sharing off and on: what publishing every period costs.
1. Piling: --replicas fake replicas (in this process: a fixed --service-ms per request, --slots at a time, the rest
   queued, as a replica's batch would slow down), one endpoint routing least-outstanding, two gateways; each of
   --clients closed-loop clients sends completions to one of the gateways (half each) for --seconds. Arms: sharing
   off (GATEWAY_SHARED_ROUTING_SECONDS=0: each gateway sees its own requests only) and on (--sharing-seconds, 0.01 s,
   the default). Every 5 ms each replica's requests in flight (queued included) are sampled: the mean spread
   (busiest replica minus idlest), the share of samples with a replica running 2 or more while another is idle
   ("piled"), each replica's peak, and the clients' P50/P99 latency. Then the same with requests arriving at random
   (--rates a second, Poisson), each to a gateway drawn at random: closed loops of equal clients settle into a
   pattern in which each gateway's own share is even; arrivals at random, as from many users, do not.
2. The added latency: one gateway with sharing on and one with it off in front of fast fakes (5 ms, 64 slots), the
   two arms interleaved in seeded random order each round, at each --concurrency: least outstanding (no Redis on
   the request's path) and prefix-aware with every prompt new (the worst case: one claim, one Redis round trip,
   per request).

Needs Redis (REDIS_URL, a database of its own). Gateways use the compiled data path if it is built (the default).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.gateway import PY, cpu_seconds, free_port, stop_processes, summary, wait_http  # noqa: E402

ANSWER = (
    b'{"id":"x","object":"text_completion","model":"m","choices":[{"index":0,"text":"hello","finish_reason":"length"}],'
    b'"usage":{"prompt_tokens":4,"completion_tokens":1,"total_tokens":5}}'
)


class Fake:
    """A replica: a fixed service time, `slots` requests at a time, the rest queued; counts its requests in flight."""

    def __init__(self, service_s: float, slots: int):
        self.service_s, self.slots, self.in_flight, self.port = service_s, slots, 0, free_port()
        self.sem: asyncio.Semaphore | None = None

    async def start(self):
        from aiohttp import web

        self.sem = asyncio.Semaphore(self.slots)

        async def health(request):
            return web.json_response({"status": "ok"})

        async def complete(request):
            await request.read()
            self.in_flight += 1
            try:
                assert self.sem is not None
                async with self.sem:
                    await asyncio.sleep(self.service_s)
            finally:
                self.in_flight -= 1
            return web.Response(body=ANSWER, content_type="application/json")

        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_get("/v1/models", health)
        app.router.add_post("/v1/completions", complete)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()


def register(env: dict, endpoints: dict[str, tuple[list[int], str]]) -> str:
    """Endpoints (served name -> (replica ports, routing)) in the scratch console database; a gateway key."""
    script = f"""
import django; django.setup()
from endpoints.models import Endpoint, Replica
from endpoints.gateway.services import key_create
from models_registry.models import Artifact, Model
from workers.models import Node
a = Artifact.objects.create(model=Model.objects.create(name="bench"), format="hf", path="/bench")
for name, (ports, routing) in {endpoints!r}.items():
    ep = None
    for i, port in enumerate(ports):
        node = Node.objects.create(name=f"{{name}}-{{i}}", address="127.0.0.1")
        if ep is None:
            ep = Endpoint.objects.create(name=name, artifact=a, node=node, served_model_name=name, state="ready",
                                         replicas=len(ports), routing=routing)
        Replica.objects.create(endpoint=ep, index=i, node=node, state="ready", port=port, port_host=f"{{name}}{{i}}")
print(key_create(name="bench")[1])
"""
    out = subprocess.run([PY, "-c", script], cwd=ROOT, env=env, check=True, capture_output=True, text=True)
    return out.stdout.strip().splitlines()[-1]


def start_gateway(env: dict, procs: list, sharing: float) -> tuple[str, int]:
    port = free_port()
    procs.append(
        subprocess.Popen(
            [PY, "manage.py", "gateway", "--port", str(port)],
            cwd=ROOT,
            env={**env, "GATEWAY_SHARED_ROUTING_SECONDS": str(sharing), "GATEWAY_MAX_CONNECTIONS_PER_ADDRESS": "0"},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    )
    wait_http(f"http://127.0.0.1:{port}/healthz")
    return f"http://127.0.0.1:{port}", procs[-1].pid


async def closed_loop(session, url: str, key: str, model: str, until: float, latencies: list, prompt=None) -> int:
    errors, n = 0, 0
    while time.monotonic() < until:
        n += 1
        payload = {"model": model, "prompt": prompt(n) if prompt else "Hello", "max_tokens": 1}
        t = time.perf_counter()
        async with session.post(url + "/v1/completions", json=payload, headers={"Authorization": f"Bearer {key}"}) as r:
            await r.read()
            errors += r.status != 200
        latencies.append(time.perf_counter() - t)
    return errors


async def one(session, url: str, key: str, model: str, latencies: list) -> int:
    t = time.perf_counter()
    payload = {"model": model, "prompt": "Hello", "max_tokens": 1}
    async with session.post(url + "/v1/completions", json=payload, headers={"Authorization": f"Bearer {key}"}) as r:
        await r.read()
    latencies.append(time.perf_counter() - t)
    return r.status != 200


async def open_loop(session, gateways: list[str], key: str, until: float, latencies: list, rate: float, rng) -> int:
    """Requests arriving at random (Poisson, `rate` a second), each to a gateway drawn at random."""
    tasks = []
    while time.monotonic() < until:
        tasks.append(asyncio.create_task(one(session, rng.choice(gateways), key, "pile", latencies)))
        await asyncio.sleep(rng.expovariate(rate))
    return sum(await asyncio.gather(*tasks))


async def piling(
    gateways: list[str], key: str, fakes: list[Fake], clients: int, seconds: float, rate: float = 0, rng=None
) -> dict:
    """`clients` closed-loop clients split over the gateways for `seconds` (or, with `rate`, open-loop arrivals);
    the replicas' in-flight samples."""
    import aiohttp

    samples: list[list[int]] = []
    latencies: list[float] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        until = time.monotonic() + seconds

        async def sample():
            while time.monotonic() < until:
                samples.append([f.in_flight for f in fakes])
                await asyncio.sleep(0.005)

        sampler = asyncio.create_task(sample())
        if rate:
            errors = [await open_loop(session, gateways, key, until, latencies, rate, rng)]
        else:
            errors = await asyncio.gather(
                *(
                    closed_loop(session, gateways[i % len(gateways)], key, "pile", until, latencies)
                    for i in range(clients)
                )
            )
        await sampler
    steady = samples[len(samples) // 10 :]  # the first tenth: clients still starting
    latencies.sort()
    return {
        "spread": statistics.mean(max(s) - min(s) for s in steady),
        "piled": sum(1 for s in steady if max(s) >= 2 and min(s) == 0) / len(steady),
        "peaks": [max(s[i] for s in steady) for i in range(len(fakes))],
        "means": [statistics.mean(s[i] for s in steady) for i in range(len(fakes))],
        "p50_ms": latencies[len(latencies) // 2] * 1000,
        "p99_ms": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] * 1000,
        "requests": len(latencies),
        "errors": sum(errors),
    }


def means(rs: list[dict], replicas: int) -> str:
    return " ".join(f"{statistics.mean(r['means'][i] for r in rs):.2f}" for i in range(replicas))


async def latency_run(url: str, key: str, model: str, n: int, concurrency: int, unique: bool) -> dict:
    import aiohttp

    latencies: list[float] = []
    errors = 0
    counter = iter(range(10**9))
    prompt = (lambda _: f"{random.random()} a prompt seen once") if unique else None
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:
        for _ in range(2):  # warm-up: connections open on each hop
            await asyncio.gather(
                *(closed_loop(session, url, key, model, time.monotonic() + 0.05, []) for _ in range(concurrency))
            )
        queue = iter(range(n))
        start = time.perf_counter()

        async def worker():
            nonlocal errors
            for _ in queue:
                payload = {"model": model, "prompt": prompt(next(counter)) if prompt else "Hello", "max_tokens": 1}
                t = time.perf_counter()
                headers = {"Authorization": f"Bearer {key}"}
                async with session.post(url + "/v1/completions", json=payload, headers=headers) as r:
                    await r.read()
                    errors += r.status != 200
                latencies.append(time.perf_counter() - t)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return {"latencies": latencies, "wall": wall, "errors": errors}


async def main_async(args, env: dict, procs: list):
    rng = random.Random(args.seed)
    pile = [Fake(args.service_ms / 1000, args.slots) for _ in range(args.replicas)]
    fast = {name: [Fake(0.005, 64) for _ in range(2)] for name in ("fast-lo", "fast-prefix")}
    for f in [*pile, *fast["fast-lo"], *fast["fast-prefix"]]:
        await f.start()
    key = await asyncio.to_thread(
        register,
        env,
        {
            "pile": ([f.port for f in pile], "least-outstanding"),
            "fast-lo": ([f.port for f in fast["fast-lo"]], "least-outstanding"),
            "fast-prefix": ([f.port for f in fast["fast-prefix"]], "prefix"),
        },
    )
    arms = {"off": 0.0, "on": args.sharing_seconds}
    started = {
        arm: [await asyncio.to_thread(start_gateway, env, procs, s) for _ in range(2)] for arm, s in arms.items()
    }
    pairs = {arm: [url for url, _ in members] for arm, members in started.items()}
    await asyncio.sleep(2)  # every gateway's routing table read
    before = {arm: sum(cpu_seconds(pid) for _, pid in members) for arm, members in started.items()}
    await asyncio.sleep(args.idle_seconds)
    idle = {
        arm: 1000 * (sum(cpu_seconds(pid) for _, pid in members) - before[arm]) / args.idle_seconds / 2
        for arm, members in started.items()
    }
    print(
        f"routing_scale.py: {args.replicas} fake replicas of {args.service_ms:g} ms, {args.slots} slot(s) each; "
        f"2 gateways; seed {args.seed}; sharing on = GATEWAY_SHARED_ROUTING_SECONDS {args.sharing_seconds:g} s"
    )
    print(f"\n0. A gateway's CPU while idle: sharing off {idle['off']:.1f} ms/s, on {idle['on']:.1f} ms/s")
    print("\n1. Piling: clients split over two gateways, least outstanding")
    loads = [(c, 0.0) for c in args.clients] + [(0, r) for r in args.rates]
    for clients, rate in loads:
        results: dict[str, list[dict]] = {arm: [] for arm in arms}
        for _ in range(args.rounds):
            for arm in rng.sample(list(arms), len(arms)):
                results[arm].append(await piling(pairs[arm], key, pile, clients, args.seconds, rate, rng))
        load = f"{clients} clients" if clients else f"{rate:g} req/s at random"
        for arm in arms:
            rs = results[arm]
            avg = lambda name: statistics.mean(r[name] for r in rs)  # noqa: B023, E731
            print(
                f"  {load}, sharing {arm:<3}: spread (busiest - idlest) {avg('spread'):.2f}, "
                f"piled {100 * avg('piled'):.0f} % of the time, peak per replica "
                f"{max(max(r['peaks']) for r in rs)}, mean per replica {means(rs, args.replicas)}, "
                f"P50 / P99 {avg('p50_ms'):.0f} / {avg('p99_ms'):.0f} ms, "
                f"{sum(r['requests'] for r in rs)} requests, errors {sum(r['errors'] for r in rs)}"
            )

    print("\n2. Added latency, one gateway, fakes of 5 ms: P50 / P99 ms, req/s")
    for model, unique in (("fast-lo", False), ("fast-prefix", True)):
        label = "least outstanding" if not unique else "prefix, every prompt new (one claim per request)"
        print(f"  {label}")
        for c in args.concurrency:
            runs: dict[str, list[dict]] = {arm: [] for arm in arms}
            for _ in range(args.rounds):
                for arm in rng.sample(list(arms), len(arms)):
                    runs[arm].append(await latency_run(pairs[arm][0], key, model, args.requests, c, unique))
            off, on = summary(runs["off"], None), summary(runs["on"], None)
            print(
                f"    c={c:<3} sharing off {off['p50_ms']:.2f} / {off['p99_ms']:.2f} ms {off['rps']:.0f}/s   "
                f"on {on['p50_ms']:.2f} / {on['p99_ms']:.2f} ms {on['rps']:.0f}/s   added P50 "
                f"{on['p50_ms'] - off['p50_ms']:+.2f} ms   errors {off['errors'] + on['errors']}"
            )
    print(f"\n  measured on {os.cpu_count()} CPUs; clients, fakes, gateways and Redis share them")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--clients", type=int, nargs="*", default=[4, 8])
    parser.add_argument("--rates", type=float, nargs="*", default=[10, 15], help="open-loop arrivals a second")
    parser.add_argument("--service-ms", type=float, default=200)
    parser.add_argument("--slots", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--concurrency", type=int, nargs="*", default=[1, 8, 16])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--sharing-seconds", type=float, default=0.01)
    parser.add_argument("--idle-seconds", type=float, default=10, help="how long the gateways' idle CPU is measured")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="routing-scale-"))
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "console.settings",
        "DATA_DIR": str(tmp),
        "DATABASE_URL": f"sqlite:///{tmp / 'bench.sqlite3'}",
        "SECRET_KEY": "bench-" + "x" * 50,
        "GATEWAY_TELEMETRY_SECONDS": "10",
        "GATEWAY_QUEUE_DEPTH": "10000",
    }
    subprocess.run([PY, "manage.py", "migrate", "-v", "0"], cwd=ROOT, env=env, check=True)
    procs: list = []
    try:
        asyncio.run(main_async(args, env, procs))
    finally:
        stop_processes(procs)


if __name__ == "__main__":
    main()
