"""What the gateway adds: the same load against the replicas directly and through the gateway, in one run.

    .venv/bin/python benchmarks/gateway.py [--requests 400] [--concurrency 1 32] [--upstream fake|URL ...]
                                           [--fake-delay-ms 5] [--fake-slots 4] [--model NAME] [--json]

--upstream fake (default) starts two small OpenAI-protocol servers (uvicorn, a fixed answer after
--fake-delay-ms, at most --fake-slots requests at a time, like a replica's batch) so the figures are
the gateway's own cost, not the model's noise; give real replica URLs (e.g. vLLM on :8500) instead
to measure against them (``--model`` is then their served model name).

It makes a scratch SQLite console database, registers the replicas as a ready endpoint, creates a
gateway key, starts ``manage.py gateway`` and, for each concurrency: direct to replica 1, through
the gateway with 1 replica, and through the gateway with 2 replicas. Reports P50/P99 latency, the
added latency (gateway - direct, goals: P50 <= 2 ms, P99 <= 10 ms), throughput vs direct (goal
>= 95 %) and the gain of two replicas over one.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
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
    body = json.dumps({"id": "x", "object": "text_completion", "model": "bench", "choices": [
        {"index": 0, "text": "hello", "finish_reason": "length"}],
        "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5}}).encode()

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
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
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


async def run_load(url: str, key: str | None, model: str, n: int, concurrency: int) -> dict:
    # aiohttp, as vLLM's own benchmark client: a light client leaves the cores to what is measured.
    import aiohttp

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    payload = {"model": model, "prompt": "Hello", "max_tokens": 1, "temperature": 0}
    latencies, errors = [], 0
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as client:
        async def post() -> int:
            async with client.post(url + "/v1/completions", json=payload, headers=headers) as r:
                await r.read()
                return r.status

        for _ in range(min(20, n)):  # warm-up: connections and caches
            await post()
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
    latencies.sort()
    pick = lambda q: latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1000  # noqa: E731
    return {"p50_ms": pick(0.5), "p99_ms": pick(0.99), "mean_ms": statistics.mean(latencies) * 1000,
            "rps": n / wall, "errors": errors}


def stop_processes(procs: list[subprocess.Popen]):
    """Terminate them all, then wait for each (killed after 10 s)."""
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()


def setup_console(db_path: Path, upstreams: list[str], model: str, env: dict) -> str:
    """Migrate a scratch database, register the upstreams as replicas, return a gateway key."""
    subprocess.run([PY, "manage.py", "migrate", "-v", "0"], cwd=ROOT, env=env, check=True)
    script = f"""
import django; django.setup()
from urllib.parse import urlsplit
from endpoints.models import Endpoint, Replica
from endpoints.gateway.services import key_create
from models_registry.models import Artifact, Model
from workers.models import Node
m = Model.objects.create(name="bench")
a = Artifact.objects.create(model=m, format="hf", path="/bench")
for i, url in enumerate({upstreams!r}):
    u = urlsplit(url)
    node = Node.objects.create(name=f"bench-{{i}}", address=u.hostname)
    ep = Endpoint.objects.create(name=f"bench-{{i}}", artifact=a, node=node, served_model_name={model!r}, state="ready")
    Replica.objects.create(endpoint=ep, index=0, node=node, state="ready", port=u.port, port_host=f"b{{i}}")
print(key_create(name="bench")[1])
"""
    out = subprocess.run([PY, "-c", script], cwd=ROOT, env=env, check=True, capture_output=True, text=True)
    return out.stdout.strip().splitlines()[-1]


def set_replicas(env: dict, count: int):
    script = f"""
import django; django.setup()
from endpoints.models import Endpoint
for ep in Endpoint.objects.order_by("name"):
    Endpoint.objects.filter(pk=ep.pk).update(desired_state="running" if int(ep.name.split("-")[1]) < {count} else "stopped")
"""
    subprocess.run([PY, "-c", script], cwd=ROOT, env=env, check=True)
    time.sleep(1.5)  # the gateway refreshes its routes every second


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--upstream", nargs="+", default=["fake"])
    parser.add_argument("--fake-delay-ms", type=float, default=5)
    parser.add_argument("--fake-slots", type=int, default=4)
    parser.add_argument("--model", default="bench")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--serve-fake", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_fake:
        import uvicorn

        uvicorn.run(fake_app(args.fake_delay_ms / 1000, args.fake_slots), host="127.0.0.1", port=args.serve_fake,
                    loop="uvloop", http="httptools", access_log=False, log_level="warning")
        return

    procs = []
    tmp = Path(tempfile.mkdtemp(prefix="gw-bench-"))
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "console.settings", "DATA_DIR": str(tmp),
           "DATABASE_URL": f"sqlite:///{tmp / 'bench.sqlite3'}", "SECRET_KEY": "bench-" + "x" * 50,
           "GATEWAY_TELEMETRY_SECONDS": "10", "GATEWAY_QUEUE_DEPTH": "10000"}
    try:
        upstreams = args.upstream
        if upstreams == ["fake"]:
            upstreams = []
            for _ in range(2):
                port = free_port()
                procs.append(subprocess.Popen([PY, __file__, "--serve-fake", str(port), "--fake-delay-ms",
                                               str(args.fake_delay_ms), "--fake-slots", str(args.fake_slots)]))
                upstreams.append(f"http://127.0.0.1:{port}")
            for u in upstreams:
                wait_http(u)
        key = setup_console(tmp / "bench.sqlite3", upstreams, args.model, env)
        gw_port = free_port()
        procs.append(subprocess.Popen([PY, "manage.py", "gateway", "--port", str(gw_port)], cwd=ROOT, env=env,
                                      stdout=subprocess.DEVNULL))
        gw = f"http://127.0.0.1:{gw_port}"
        wait_http(gw + "/healthz")
        results = {}
        for c in args.concurrency:
            set_replicas(env, 1)
            direct = asyncio.run(run_load(upstreams[0], None, args.model, args.requests, c))
            one = asyncio.run(run_load(gw, key, args.model, args.requests, c))
            entry = {"direct": direct, "gateway_1": one}
            if len(upstreams) > 1:
                set_replicas(env, 2)
                entry["gateway_2"] = asyncio.run(run_load(gw, key, args.model, args.requests, c))
            entry["added_p50_ms"] = one["p50_ms"] - direct["p50_ms"]
            entry["added_p99_ms"] = one["p99_ms"] - direct["p99_ms"]
            entry["throughput_vs_direct"] = one["rps"] / direct["rps"]
            if "gateway_2" in entry:
                entry["two_replicas_gain"] = entry["gateway_2"]["rps"] / one["rps"]
            results[f"c={c}"] = entry
        if args.json:
            print(json.dumps(results, indent=2))
            return
        print(f"upstream: {'fake (%.0f ms, %d slots)' % (args.fake_delay_ms, args.fake_slots) if args.upstream == ['fake'] else ', '.join(upstreams)}; "
              f"{args.requests} requests per run")
        for name, e in results.items():
            d, g = e["direct"], e["gateway_1"]
            print(f"{name}: direct P50 {d['p50_ms']:.2f} P99 {d['p99_ms']:.2f} ms {d['rps']:.0f} req/s | "
                  f"gateway P50 {g['p50_ms']:.2f} P99 {g['p99_ms']:.2f} ms {g['rps']:.0f} req/s | "
                  f"added P50 {e['added_p50_ms']:+.2f} ms (goal <= 2) P99 {e['added_p99_ms']:+.2f} ms (goal <= 10) | "
                  f"throughput {100 * e['throughput_vs_direct']:.0f}% of direct (goal >= 95)"
                  + (f" | 2 replicas: {e['gateway_2']['rps']:.0f} req/s, x{e['two_replicas_gain']:.2f}" if "gateway_2" in e else "")
                  + (f" | errors {d['errors']}/{g['errors']}" if d["errors"] or g["errors"] else ""))
    finally:
        stop_processes(procs)
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
