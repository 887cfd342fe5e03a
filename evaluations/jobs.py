"""The `evaluate` job kind: lm-evaluation-harness scores a served model through the console's gateway, with a
gateway key of its own (scoped to the one endpoint, revoked when the job ends). An artifact's evaluation first
launches an endpoint for it and removes it afterwards. Imported by EvaluationsConfig.ready()."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
from django.conf import settings
from django.utils import timezone

from console.env import child_environment
from endpoints.endpoint_spec import EndpointSpec
from endpoints.gateway.selectors import model_name
from endpoints.gateway.services import key_create, key_revoke
from endpoints.models import Endpoint, Replica
from endpoints.services import endpoint_create, endpoint_delete, endpoint_stop
from evaluations import gates, services
from evaluations import tasks as catalogue
from evaluations.models import Evaluation, EvaluationStatus
from workers.jobs.children import start_job_child, stop_job_child
from workers.jobs.context import JobCancelled, JobFailed
from workers.jobs.runner import JobRunner

log = logging.getLogger("console.job")
VIA = "evaluation"
ROUTE_WAIT_SECONDS = 60  # the gateway picks up a key and a newly ready endpoint within a few seconds


class Evaluate(JobRunner):
    name = "evaluate"
    queue = "default"
    timeout = 4 * 3600

    def run(self, job, ctx) -> dict:
        evaluation = Evaluation.objects.select_related("endpoint", "artifact", "created_by").get(
            pk=job.params["evaluation"]
        )
        try:
            result = execute(evaluation, ctx)
            gates.settle_for(evaluation)
            return result
        except JobCancelled:
            services.record_failure(evaluation, "Cancelled.")
            raise
        except JobFailed as exc:
            services.record_failure(evaluation, str(exc))
            raise
        except Exception as exc:
            services.record_failure(evaluation, f"{type(exc).__name__}: {exc}")
            raise
        finally:
            if evaluation.status == EvaluationStatus.FAILED:
                gates.settle_for(evaluation)

    def on_failure(self, job) -> None:
        """Cancelled or reaped: the evaluation ends failed, and a quantize gate waiting on it settles."""
        evaluation = Evaluation.objects.filter(pk=job.params.get("evaluation")).first()
        if evaluation is not None and evaluation.status not in (EvaluationStatus.SUCCEEDED, EvaluationStatus.FAILED):
            services.record_failure(evaluation, job.error or f"The job ended {job.status}.")
            gates.settle_for(evaluation)

    def result_object(self, job):
        return Evaluation.objects.filter(pk=job.params.get("evaluation")).first()


def execute(evaluation: Evaluation, ctx) -> dict:
    services.record_status(evaluation, EvaluationStatus.RUNNING, started_at=timezone.now())
    launched = None
    key = None
    try:
        endpoint = evaluation.endpoint
        if evaluation.launched:
            services.record_status(evaluation, EvaluationStatus.LAUNCHING)
            endpoint = launched = _launch(evaluation, ctx)
            services.record_status(evaluation, EvaluationStatus.RUNNING)
        if endpoint is None:
            raise JobFailed("The endpoint was deleted.")
        key, raw = key_create(
            name=f"evaluation #{evaluation.pk}",
            endpoints=[f"={endpoint.name}"],  # this endpoint alone, not the other side of a canary pair
            team_id=endpoint.team_id,  # a key reaches its own team's endpoints alone
            expires_days=1,
            via=VIA,
        )
        spec = _spec(endpoint)
        Evaluation.objects.filter(pk=evaluation.pk).update(
            gateway_key_prefix=key.prefix, spec=spec, engine=spec["engine"]
        )
        served = model_name(endpoint)
        _wait_for_route(raw, served, endpoint, ctx)
        summary = _run_harness(evaluation, endpoint=endpoint, served=served, raw_key=raw, ctx=ctx)
    finally:
        if key is not None:
            key_revoke(key=key, via=VIA)
        if launched is not None:
            _remove(launched)
    rows = services.results_rows(summary)
    services.record_status(
        evaluation,
        EvaluationStatus.SUCCEEDED,
        results=rows,
        versions={**summary.get("versions", {}), "lm_eval_model": summary.get("model", "")},
        finished_at=timezone.now(),
    )
    ctx.progress(100, "done")
    return {"evaluation": evaluation.pk, "results": rows}


def _spec(endpoint: Endpoint) -> dict:
    replica = Replica.objects.filter(endpoint=endpoint).select_related("node").order_by("index").first()
    artifact = endpoint.artifact
    node = replica.node if replica else endpoint.node
    return {
        "endpoint": endpoint.name,
        "artifact": artifact.pk,
        "artifact_name": str(artifact),
        "artifact_sha256": artifact.sha256,
        "dtype": endpoint.dtype or "auto",
        "quantization": endpoint.quantization or None,
        "tensor_parallel_size": endpoint.tensor_parallel_size,
        "max_model_len": endpoint.max_model_len,
        "max_num_seqs": endpoint.max_num_seqs,
        "enforce_eager": endpoint.enforce_eager,
        "node": node.name if node else "",
        "platform": node.platform if node else "",
        "engine": dict(node.engine or {}) if node else {},
        "argv": list(replica.argv or []) if replica else [],
    }


def _launch(evaluation: Evaluation, ctx) -> Endpoint:
    """An endpoint for the artifact alone, with the launch defaults (the demo on CPU nodes: float32, eager)."""
    node = evaluation.spec.get("node") or None
    spec = EndpointSpec(
        name=f"eval-{evaluation.pk}",
        artifact=evaluation.artifact_id,
        node=node,
        enforce_eager=True,
        max_model_len=1024,
        max_num_seqs=8,
    )
    endpoint = endpoint_create(spec=spec, user=evaluation.created_by)
    Evaluation.objects.filter(pk=evaluation.pk).update(endpoint=endpoint, endpoint_name=endpoint.name)
    deadline = time.monotonic() + settings.EVALUATION_LAUNCH_TIMEOUT_SECONDS
    ctx.progress(2, f"waiting for {endpoint.name} to be ready")
    while True:
        endpoint.refresh_from_db()
        if endpoint.state == Endpoint.State.READY:
            return endpoint
        if endpoint.state == Endpoint.State.FAILED:
            raise JobFailed(f"The endpoint launched for {evaluation.artifact_label} failed: {endpoint.state}.")
        if time.monotonic() > deadline:
            raise JobFailed(
                f"The endpoint launched for {evaluation.artifact_label} was not ready within "
                f"{settings.EVALUATION_LAUNCH_TIMEOUT_SECONDS} s (EVALUATION_LAUNCH_TIMEOUT_SECONDS)."
            )
        ctx.check_cancelled()
        time.sleep(2)


def _remove(endpoint: Endpoint) -> None:
    """Stop the endpoint launched for the evaluation and delete it once its replicas have stopped."""
    try:
        endpoint_stop(endpoint=endpoint, user=None)
        deadline = time.monotonic() + settings.ENDPOINT_STOP_GRACE_SECONDS + 60
        while time.monotonic() < deadline:
            if not Replica.objects.filter(endpoint=endpoint).exclude(state=Endpoint.State.STOPPED).exists():
                endpoint_delete(endpoint=endpoint, user=None)
                return
            time.sleep(1)
        log.warning("evaluation: %s did not stop in time; it is stopped, not deleted", endpoint.name)
    except Exception:  # the evaluation's own outcome stands; the endpoint stays for an operator
        log.exception("evaluation: could not remove %s", endpoint.name)


def _wait_for_route(raw_key: str, served: str, endpoint: Endpoint, ctx) -> None:
    """Until the gateway knows the key and routes the model (its caches refresh every second or two)."""
    deadline = time.monotonic() + ROUTE_WAIT_SECONDS
    last = ""
    ctx.progress(3, "waiting for the gateway to route the endpoint")
    with httpx.Client(base_url=settings.GATEWAY_URL, timeout=10) as client:
        while time.monotonic() < deadline:
            try:
                answer = client.get("/v1/models", headers={"Authorization": f"Bearer {raw_key}"})
                if answer.status_code == 200 and served in {m.get("id") for m in answer.json().get("data", [])}:
                    return
                last = f"HTTP {answer.status_code}"
            except httpx.HTTPError as exc:
                last = str(exc) or type(exc).__name__
            ctx.check_cancelled()
            time.sleep(1)
    raise JobFailed(
        f"The gateway at {settings.GATEWAY_URL} did not route {served!r} ({endpoint.name}) within "
        f"{ROUTE_WAIT_SECONDS} s ({last}). Is `manage.py gateway` running?"
    )


def _run_harness(evaluation: Evaluation, *, endpoint: Endpoint, served: str, raw_key: str, ctx) -> dict:
    directory = Path(settings.EVALUATION_DATA_DIR) / "runs" / str(evaluation.pk)
    shutil.rmtree(directory, ignore_errors=True)
    include = catalogue.write_include_dir(evaluation.tasks, directory / "tasks")
    spec = {
        "base_url": settings.GATEWAY_URL,
        "model": served,
        "api": evaluation.api,
        "tokenizer": endpoint.artifact.path,
        "tasks": evaluation.tasks,
        "include_path": str(include),
        "limit": evaluation.limit,
        "seed": evaluation.seed,
        # One request at a time: a batch's make-up changes float sums on CPU and GPU, and a gate compares two runs.
        "num_concurrent": 1,
        "max_length": endpoint.max_model_len or 2048,
    }
    (directory / "spec.json").write_text(json.dumps(spec, indent=1))
    env = child_environment(
        {
            "OPENAI_API_KEY": raw_key,  # what lm-eval's local-completions sends as its bearer token
            "HF_HOME": str(settings.EVALUATION_HF_HOME),
            "HF_DATASETS_OFFLINE": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "PYTHONPATH": str(settings.BASE_DIR),
            "TOKENIZERS_PARALLELISM": "false",
        }
    )
    argv = [sys.executable, "-m", "evaluations.harness", str(directory / "spec.json"), str(directory)]
    log.info("lm-eval %s on %s (%s) through %s", ",".join(evaluation.tasks), served, endpoint.name, spec["base_url"])
    with open(directory / "harness.log", "wb") as out:
        proc = start_job_child(argv, cwd=directory, env=env, stdout=out, stderr=subprocess.STDOUT)
        ctx.progress(10, f"scoring {', '.join(evaluation.tasks)} (lm-eval's log: {directory / 'harness.log'})")
        try:
            while proc.poll() is None:
                ctx.check_cancelled()
                time.sleep(2)
        finally:
            stop_job_child(proc, grace=10)
    if (directory / "error.json").is_file():
        raise JobFailed(json.loads((directory / "error.json").read_text())["error"])
    if proc.returncode != 0 or not (directory / "results.json").is_file():
        tail = (directory / "harness.log").read_text(errors="replace")[-1500:]
        raise JobFailed(f"lm-eval exited with {proc.returncode}: {tail.strip().splitlines()[-1:] or ''}")
    samples = directory / "samples.jsonl"
    Evaluation.objects.filter(pk=evaluation.pk).update(
        samples_path=str(samples) if samples.is_file() else "",
        samples_bytes=samples.stat().st_size if samples.is_file() else 0,
    )
    return json.loads((directory / "results.json").read_text())
