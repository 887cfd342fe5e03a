"""Time and measure the demo model's conversions, each in a fresh subprocess.

    .venv/bin/python benchmarks/conversion.py [--gguf PATH] [--workdir DIR] [--keep] [--json]

Runs, one subprocess each:

1. baseline  -- only ``import torch, transformers`` (+ the conversion module), so the conversions'
                own memory is visible;
2. gguf->hf  -- ``gguf_to_hf(GGUF, dtype="bfloat16")``;
3. bf16->fp16 -- ``convert_precision(<output of 2>, dtype="float16")``.

For each: wall time, peak RSS (the child's exact ``ru_maxrss`` from ``wait4``, and the peak seen by
psutil polling every 10 ms), output size, and peak RSS / output size.  The goal is a peak RSS under
2.5x the output size.  The GGUF defaults to $DEMO_GGUF, else /tmp/demo/gguf/SmolLM2-135M-Instruct.Q4_1.gguf.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_GGUF = "/tmp/demo/gguf/SmolLM2-135M-Instruct.Q4_1.gguf"
GOAL_RATIO = 2.5

BASELINE_CODE = """
import torch, transformers
import models_registry.convert
"""

GGUF_TO_HF_CODE = """
import json, sys
from pathlib import Path
from models_registry.convert import gguf_to_hf
result = gguf_to_hf(Path(sys.argv[1]), Path(sys.argv[2]), dtype="bfloat16")
print("RESULT " + json.dumps(result))
"""

TO_FP16_CODE = """
import json, sys
from pathlib import Path
from models_registry.convert import convert_precision
result = convert_precision(Path(sys.argv[1]), Path(sys.argv[2]), dtype="float16")
print("RESULT " + json.dumps(result))
"""


def _poll_rss(pid: int, stop: threading.Event, peak: list[int]) -> None:
    try:
        import psutil
    except ImportError:
        return
    try:
        proc = psutil.Process(pid)
    except psutil.Error:
        return
    while not stop.is_set():
        try:
            rss = proc.memory_info().rss + sum(c.memory_info().rss for c in proc.children(recursive=True))
        except psutil.Error:
            break
        peak[0] = max(peak[0], rss)
        stop.wait(0.01)


def run_child(code: str, *args: str) -> dict:
    """Run ``python -c code args`` from the repository root; measure it."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), TOKENIZERS_PARALLELISM="false")
    started = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-c", code, *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    stop, polled = threading.Event(), [0]
    poller = threading.Thread(target=_poll_rss, args=(proc.pid, stop, polled), daemon=True)
    poller.start()
    # read the pipes on threads so a chatty child cannot block; reap with wait4 for its own rusage
    out_chunks: list[str] = []
    err_chunks: list[str] = []
    readers = [
        threading.Thread(target=lambda s=s, b=b: b.append(s.read()), daemon=True)
        for s, b in ((proc.stdout, out_chunks), (proc.stderr, err_chunks))
    ]
    for r in readers:
        r.start()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - started
    proc.returncode = os.waitstatus_to_exitcode(status)
    stop.set()
    poller.join()
    for r in readers:
        r.join()
    stdout, stderr = "".join(out_chunks), "".join(err_chunks)
    if proc.returncode != 0:
        raise SystemExit(f"child failed (exit {proc.returncode}):\n{stderr[-3000:]}")
    result = None
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT ") :])
    return {
        "wall_s": wall,
        "peak_rss": usage.ru_maxrss * 1024,  # Linux reports KiB
        "polled_peak_rss": polled[0],
        "result": result,
    }


def dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def mib(n: float) -> str:
    return f"{n / 2**20:8.1f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", default=os.environ.get("DEMO_GGUF", DEFAULT_GGUF))
    parser.add_argument("--workdir", help="where outputs go (default: a temporary directory)")
    parser.add_argument("--keep", action="store_true", help="keep the converted models")
    parser.add_argument("--json", action="store_true", help="also print the figures as JSON")
    args = parser.parse_args(argv)

    gguf = Path(args.gguf)
    if not gguf.is_file():
        print(f"GGUF not found: {gguf} (pass --gguf or set DEMO_GGUF)", file=sys.stderr)
        return 2
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="conv-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    hf_dir, fp16_dir = work / "hf-bf16", work / "hf-fp16"
    for d in (hf_dir, fp16_dir):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir()

    print(
        f"GGUF: {gguf} ({gguf.stat().st_size / 2**20:.1f} MiB); python {sys.version.split()[0]}; {os.cpu_count()} CPUs"
    )
    try:
        baseline = run_child(BASELINE_CODE)
        to_hf = run_child(GGUF_TO_HF_CODE, str(gguf), str(hf_dir))
        to_hf["output_bytes"] = dir_size(hf_dir)
        to_fp16 = run_child(TO_FP16_CODE, str(hf_dir), str(fp16_dir))
        to_fp16["output_bytes"] = dir_size(fp16_dir)
    finally:
        if not args.keep and not args.workdir:
            shutil.rmtree(work, ignore_errors=True)

    base = baseline["peak_rss"]
    print()
    print(
        f"{'step':<12} {'wall s':>7} {'peak RSS MiB':>13} {'(polled)':>9} {'own MiB':>9} "
        f"{'output MiB':>11} {'peak/out':>9} {'own/out':>8}"
    )
    print(
        f"{'baseline':<12} {baseline['wall_s']:7.2f} {mib(base):>13} {mib(baseline['polled_peak_rss']):>9} "
        f"{'':>9} {'':>11} {'':>9} {'':>8}"
    )
    rows = {"baseline": {"wall_s": baseline["wall_s"], "peak_rss": base}}
    ok = True
    for name, step in (("gguf->hf", to_hf), ("bf16->fp16", to_fp16)):
        out = step["output_bytes"]
        ratio = step["peak_rss"] / out
        own = step["peak_rss"] - base
        ok = ok and ratio < GOAL_RATIO
        print(
            f"{name:<12} {step['wall_s']:7.2f} {mib(step['peak_rss']):>13} {mib(step['polled_peak_rss']):>9} "
            f"{mib(own):>9} {mib(out):>11} {ratio:9.2f} {own / out:8.2f}"
        )
        rows[name] = {
            "wall_s": step["wall_s"],
            "peak_rss": step["peak_rss"],
            "polled_peak_rss": step["polled_peak_rss"],
            "output_bytes": out,
            "peak_over_output": ratio,
            "own_over_output": own / out,
            "result": step["result"],
        }
    print()
    print(
        f"goal: peak RSS < {GOAL_RATIO}x output size -> {'met' if ok else 'NOT met'} "
        f"('own' = peak minus the baseline process's peak)"
    )
    if args.keep or args.workdir:
        print(f"outputs kept in {work}")
    if args.json:
        print(json.dumps(rows, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
