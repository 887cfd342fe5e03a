"""The job system on real Redis and real RQ workers: conversions end to end, progress,
cancel, retry, duplicate and disk-space refusals, and reaping of a killed worker."""

import os
import signal
import time
from pathlib import Path

import pytest
from django.utils import timezone

from console.exceptions import Conflict
from models_registry.models import Artifact
from tests.support.jobs import run_queued_jobs, start_worker
from tests.support.tiny_models import build_slow_to_convert_hf, build_tiny_llama_gguf, build_tiny_llama_hf
from workers.jobs.services import reap_jobs
from workers.models import Job


def _register(api, name, path):
    response = api.post("/api/v1/models", {"name": name, "path": str(path)})
    assert response.status_code == 201, response.content
    return response.json()["artifacts"][0]["id"]


def _leftovers(store: Path):
    return [p for p in store.rglob("*") if ".staging" in p.name] if store.exists() else []


@pytest.mark.django_db(transaction=True)
def test_gguf_to_hf_conversion_job(operator, api_for, model_root, redis_conn, settings):
    api = api_for(operator)
    source = _register(api, "tiny", build_tiny_llama_gguf(model_root / "tiny.gguf"))
    response = api.post(f"/api/v1/artifacts/{source}/convert", {"to": "hf", "dtype": "bfloat16"})
    assert response.status_code == 202, response.content
    job_id = response.json()["job"]
    assert api.get(f"/api/v1/jobs/{job_id}").json()["status"] == "queued"
    run_queued_jobs("convert", "default")
    job = api.get(f"/api/v1/jobs/{job_id}").json()
    assert job["status"] == "succeeded", job
    assert job["progress"] == 100 and job["result_artifact"]
    out = api.get(f"/api/v1/artifacts/{job['result_artifact']}").json()
    assert out["format"] == "hf" and out["dtype"] == "bfloat16" and out["parent"] == source
    assert out["status"] == "ready" and out["producing_job"] == job_id and out["sha256"]
    assert out["inspection"]["dtype"] == "bfloat16" and out["inspection"]["has_tokenizer"]
    assert Path(out["path"]).is_dir() and not _leftovers(Path(settings.ARTIFACT_STORE))
    assert "dequantising the GGUF" in Job.objects.get(pk=job_id).log  # the job's logging is captured
    assert Job.objects.get(pk=job_id).result["reproducibility"]["threads"] >= 1  # recorded as a quantization's
    # The same conversion again: refused with a link to what exists.
    again = api.post(f"/api/v1/artifacts/{source}/convert", {"to": "hf", "dtype": "bfloat16"})
    assert again.status_code == 409 and again.json()["link"] == f"/artifacts/{out['id']}/"


@pytest.mark.django_db(transaction=True)
def test_a_folder_holding_one_gguf_converts_to_hf(operator, api_for, model_root, redis_conn):
    """Registered as the GGUF it holds (inspection.inspect_path); its conversion opened the folder as the file."""
    api = api_for(operator)
    folder = model_root / "tiny-gguf"
    folder.mkdir()
    build_tiny_llama_gguf(folder / "tiny.gguf")
    source = _register(api, "tiny-folder", folder)
    assert api.get(f"/api/v1/artifacts/{source}").json()["format"] == "gguf"
    job_id = api.post(f"/api/v1/artifacts/{source}/convert", {"to": "hf", "dtype": "bfloat16"}).json()["job"]
    run_queued_jobs("convert", "default")
    job = api.get(f"/api/v1/jobs/{job_id}").json()
    assert job["status"] == "succeeded", job
    assert api.get(f"/api/v1/artifacts/{job['result_artifact']}").json()["format"] == "hf"


@pytest.mark.django_db(transaction=True)
def test_precision_conversion_records_verification(operator, api_for, model_root, redis_conn):
    """The logits check is stored on the artifact with torch's thread count and the libraries' versions (a
    quantization records them; a conversion did not), and the artifact's building → ready is audited once."""
    import torch

    from console.models import AuditEvent

    api = api_for(operator)
    source = _register(api, "tiny", build_tiny_llama_hf(model_root / "tiny"))
    job_id = api.post(f"/api/v1/artifacts/{source}/convert", {"to": "fp16"}).json()["job"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the job runs in this process: the count it ran with is the one recorded
    try:
        run_queued_jobs("convert", "default")
    finally:
        torch.set_num_threads(threads)
    job = Job.objects.get(pk=job_id)
    assert job.status == "succeeded", job.error + job.traceback
    out = Artifact.objects.get(pk=job.result['artifact_id'])
    assert out.dtype == "float16" and out.inspection["dtype"] == "float16"
    assert out.verification["cosine_similarity"] > 0.999 and out.verification["max_abs_diff"] < 0.05
    assert "verifying logits" in job.log
    facts = out.verification["reproducibility"]
    assert facts == job.result["reproducibility"] and facts["threads"] == 1
    assert facts["versions"]["torch"] == torch.__version__ and facts["versions"]["transformers"]
    [ready] = AuditEvent.objects.filter(object_type="artifact", object_id=str(out.pk))
    assert (ready.action, ready.via, ready.actor_id, ready.changes["status"], ready.changes["job"]) == (
        "artifact.ready",
        "system",
        None,
        ["building", "ready"],
        job_id,
    )
    assert AuditEvent.objects.filter(action="job.succeeded.convert", object_id=str(job_id)).count() == 1


@pytest.mark.django_db(transaction=True)
def test_om_conversion_without_atc_keeps_onnx_and_says_what_to_do(
    operator, api_for, model_root, redis_conn, monkeypatch
):
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    api = api_for(operator)
    source = _register(api, "tiny", build_tiny_llama_hf(model_root / "tiny"))
    job_id = api.post(
        f"/api/v1/artifacts/{source}/convert",
        {"to": "om", "soc_version": "Ascend910B4", "batch_size": 1, "seq_len": 16},
    ).json()["job"]
    run_queued_jobs("convert", "default")
    job = api.get(f"/api/v1/jobs/{job_id}").json()
    assert job["status"] == "failed"
    assert job["error"] == "ATC not found on this node: install the CANN toolkit"
    onnx = Artifact.objects.get(producing_job_id=job_id, format="onnx")
    om = Artifact.objects.get(producing_job_id=job_id, format="om")
    assert onnx.status == "ready" and not onnx.servable and (Path(onnx.path) / "model.onnx").exists()
    assert om.status == "failed" and not Path(om.path).exists()
    # Once ATC is installed the OM can be tried again: the ready ONNX intermediate is not "this conversion".
    retried = api.post(f"/api/v1/jobs/{job_id}/retry")
    assert retried.status_code == 202, retried.content


def _conversion_writing_on_a_real_worker(api, model_root, settings, worker_env):
    """Queue a conversion big enough to take seconds, start a real forked RQ worker, and
    return (job_id, worker) once the job is running and writing into its staging directory."""
    source = _register(api, "wide", build_slow_to_convert_hf(model_root / "wide"))
    job_id = api.post(f"/api/v1/artifacts/{source}/convert", {"to": "bf16"}).json()["job"]
    env = {**worker_env, "ARTIFACT_STORE": str(settings.ARTIFACT_STORE), "MODEL_ROOTS": str(model_root)}
    worker = start_worker(env, "convert")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        job = Job.objects.get(pk=job_id)
        if job.status == "running" and job.staging_path:
            return job_id, worker
        if job.status not in ("queued", "running"):
            break
        time.sleep(0.05)
    os.killpg(worker.pid, signal.SIGKILL)
    pytest.fail(f"the job never started writing: {job.status} {job.error}")


@pytest.mark.django_db
@pytest.mark.parametrize(
    "options,field,message",
    [
        ({"to": "gif"}, "to", "Choose one of"),
        ({"to": "hf"}, "to", "needs a GGUF artifact"),
        ({"to": "fp32"}, "to", "Choose one of"),
        ({"to": "om"}, "soc_version", "Name the target chip"),
        ({"to": "om", "soc_version": "Ascend910B4; rm -rf /"}, "soc_version", "Invalid SoC version"),
        ({"to": "om", "soc_version": "Ascend999"}, "soc_version", "Invalid SoC version"),  # not ATC's: refused here
        ({"to": "om", "soc_version": "Ascend910B4", "batch_size": 0}, "batch_size", "between 1 and 64"),
        ({"to": "om", "soc_version": "Ascend910B4", "precision_mode": "yolo"}, "precision_mode", "Choose one of"),
        ({"to": "fp16", "dtype": "int3"}, "dtype", "applies to GGUF"),
        ({"to": "fp16", "bogus": 1}, "bogus", "Extra inputs are not permitted"),
    ],
)
def test_invalid_options_are_refused_before_anything_is_queued(
    options, field, message, operator, api_for, model_root, redis_conn
):
    api = api_for(operator)
    source = _register(api, "tiny", build_tiny_llama_hf(model_root / "tiny"))
    Job.objects.all().delete()
    response = api.post(f"/api/v1/artifacts/{source}/convert", options)
    assert response.status_code in (400, 422), response.content
    assert message in str(response.json()["detail"])
    assert not Job.objects.exists() and redis_conn.llen("rq:queue:convert") == 0


@pytest.mark.django_db
def test_same_dtype_and_disk_space_refusals(operator, api_for, model_root, redis_conn, settings):
    api = api_for(operator)
    source = _register(api, "tiny", build_tiny_llama_hf(model_root / "tiny", dtype="float16"))
    same = api.post(f"/api/v1/artifacts/{source}/convert", {"to": "fp16"})
    assert same.status_code == 400 and "already float16" in same.json()["detail"]
    settings.ARTIFACT_STORE_MIN_FREE_BYTES = 10**18  # keep more free than any disk has
    full = api.post(f"/api/v1/artifacts/{source}/convert", {"to": "bf16"})
    assert full.status_code == 400 and "Not enough room in the artifact store" in full.json()["detail"]
    assert not Job.objects.filter(kind="convert").exists()


@pytest.mark.django_db(transaction=True)
def test_a_conversion_whose_disk_filled_while_it_was_queued_fails_at_its_start(
    operator, api_for, model_root, redis_conn, settings
):
    """Free space was checked when the conversion was asked for, not again when its job started: a disk filled
    meanwhile failed the job half-way through its write. Now the same check runs first in the job."""
    from models_registry.services import convert_output_bytes

    api = api_for(operator)
    settings.ARTIFACT_STORE_MIN_FREE_BYTES = 0
    source = _register(api, "tiny", build_tiny_llama_hf(model_root / "tiny"))
    job_id = api.post(f"/api/v1/artifacts/{source}/convert", {"to": "bf16"}).json()["job"]
    settings.ARTIFACT_STORE_MIN_FREE_BYTES = 10**18  # the disk filled while the job waited
    run_queued_jobs("convert")
    job = Job.objects.get(pk=job_id)
    needed = convert_output_bytes(artifact=Artifact.objects.get(pk=source), to="bf16")
    assert job.status == "failed" and job.error.startswith("Not enough room in the artifact store"), job.error
    assert "this conversion needs about" in job.error and "(0 bytes) is available" in job.error
    assert f"({needed:,} bytes)" in job.error and "filled after the job was queued" in job.error
    assert not job.traceback and not Artifact.objects.filter(producing_job_id=job_id).exists()
    assert not _leftovers(Path(settings.ARTIFACT_STORE))


@pytest.mark.django_db
def test_duplicate_while_queued_is_refused_with_a_link(operator, api_for, model_root, redis_conn):
    api = api_for(operator)
    source = _register(api, "tiny", build_tiny_llama_hf(model_root / "tiny"))
    first = api.post(f"/api/v1/artifacts/{source}/convert", {"to": "bf16"}).json()["job"]
    second = api.post(f"/api/v1/artifacts/{source}/convert", {"to": "bf16"})
    assert second.status_code == 409
    assert second.json()["link"] == f"/jobs/{first}/" and "already queued" in second.json()["detail"]


@pytest.mark.django_db
def test_redis_down_gives_a_clear_error_not_a_500(operator, api_for, model_root, as_operator, monkeypatch):
    import redis

    import workers.jobs.queues

    api = api_for(operator)
    source_path = build_tiny_llama_hf(model_root / "tiny")
    # A real client pointed at a port where no Redis listens.
    monkeypatch.setattr(workers.jobs.queues, "redis_connection", lambda: redis.Redis(port=1, socket_connect_timeout=1))
    # Registration itself still works (its checksum job is best-effort).
    source = _register(api, "tiny", source_path)
    response = api.post(f"/api/v1/artifacts/{source}/convert", {"to": "bf16"})
    assert response.status_code == 503 and "unreachable" in response.json()["detail"]
    page = as_operator.post(f"/artifacts/{source}/convert", {"to": "bf16"}, follow=True)
    assert page.status_code == 200 and b"unreachable" in page.content
    assert not Job.objects.filter(kind="convert").exists()


@pytest.mark.django_db(transaction=True)
def test_cancel_and_retry(operator, api_for, model_root, redis_conn, settings, worker_env):
    """A real forked worker: cancel mid-run stops it, leaves nothing; retry runs it again."""
    api = api_for(operator)
    job_id, worker = _conversion_writing_on_a_real_worker(api, model_root, settings, worker_env)
    try:
        assert api.post(f"/api/v1/jobs/{job_id}/cancel").status_code == 200
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            reap_jobs()
            if not _leftovers(Path(settings.ARTIFACT_STORE)) and not Job.objects.get(pk=job_id).staging_path:
                break
            time.sleep(0.2)
        job = Job.objects.get(pk=job_id)
        assert job.status == "cancelled" and "Cancelled by" in job.error
        assert not _leftovers(Path(settings.ARTIFACT_STORE))
        assert not Artifact.objects.filter(producing_job_id=job_id, status="ready").exists()
        retry = api.post(f"/api/v1/jobs/{job_id}/retry")
        assert retry.status_code == 202
        new_id = retry.json()["job"]
        deadline = time.monotonic() + 180
        while Job.objects.get(pk=new_id).status in ("queued", "running") and time.monotonic() < deadline:
            time.sleep(0.2)
        new = Job.objects.get(pk=new_id)
        assert new.status == "succeeded", new.error
        assert new.retry_of_id == job_id and new.params == job.params
    finally:
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait()


@pytest.mark.django_db(transaction=True)
def test_killed_worker_job_is_reaped_within_60_seconds(operator, api_for, model_root, redis_conn, settings, worker_env):
    api = api_for(operator)
    job_id, worker = _conversion_writing_on_a_real_worker(api, model_root, settings, worker_env)
    job = Job.objects.get(pk=job_id)
    # kill -9 of the worker and of its work horse (RQ runs the horse in its own session),
    # as an OOM kill or a machine restart would.
    os.kill(job.pid, signal.SIGKILL)
    os.killpg(worker.pid, signal.SIGKILL)
    worker.wait()
    killed_at = timezone.now()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        reap_jobs()
        job = Job.objects.get(pk=job_id)
        if job.status != "running":
            break
        time.sleep(1)
    job = Job.objects.get(pk=job_id)
    assert job.status == "failed" and "stopped" in job.error and "heartbeat" in job.error
    assert (job.finished_at - killed_at).total_seconds() < 60
    assert not _leftovers(Path(settings.ARTIFACT_STORE))
    assert Artifact.objects.get(producing_job_id=job_id).status == "failed"


@pytest.mark.django_db(transaction=True)
def test_job_pages_show_progress_and_stop_polling_when_done(as_operator, operator, api_for, model_root, redis_conn):
    api = api_for(operator)
    source = _register(api, "tiny", build_tiny_llama_hf(model_root / "tiny"))
    page = as_operator.post(f"/artifacts/{source}/convert", {"to": "bf16"})
    job = Job.objects.get(kind="convert")
    assert page.status_code == 302 and page["Location"] == f"/jobs/{job.pk}/"
    live = as_operator.get(f"/jobs/{job.pk}/status").content.decode()
    assert 'hx-trigger="every 2s"' in live and "queued" in live
    run_queued_jobs("convert", "default")
    done = as_operator.get(f"/jobs/{job.pk}/status").content.decode()
    assert "hx-trigger" not in done and "succeeded" in done and 'id="job-result"' in done
    listing = as_operator.get("/jobs/?status=succeeded&kind=convert").content.decode()
    assert f"/jobs/{job.pk}/" in listing
    assert f"/jobs/{job.pk}/" not in as_operator.get("/jobs/?status=failed").content.decode()
    assert "succeeded" in as_operator.get(f"/artifacts/{source}/").content.decode()


@pytest.mark.django_db(transaction=True)
def test_per_node_queue_runs_only_on_that_node(operator, api_for, model_root, redis_conn, settings):
    """Work that must run on one host goes to its node queue; `jobs_worker` on that host takes it."""
    from django.core.management import call_command

    from workers.jobs.queues import node_queue
    from workers.jobs.services import job_enqueue

    api = api_for(operator)
    artifact_id = _register(api, "tiny", build_tiny_llama_hf(model_root / "tiny"))
    Job.objects.all().delete()
    artifact = Artifact.objects.get(pk=artifact_id)
    here = job_enqueue(
        kind="hash_artifact", params={"artifact": artifact_id}, target=artifact, queue=settings.NODE_QUEUE
    )
    elsewhere = job_enqueue(
        kind="hash_artifact", params={"artifact": artifact_id}, target=artifact, queue=node_queue("another-host")
    )
    call_command("jobs_worker", "default", "--burst")
    assert Job.objects.get(pk=here.pk).status == "succeeded"
    assert Job.objects.get(pk=elsewhere.pk).status == "queued"
    assert redis_conn.llen(f"rq:queue:{node_queue('another-host')}") == 1


@pytest.mark.django_db(transaction=True)
def test_a_new_job_runner_registers_itself_runs_and_retries(operator, redis_conn, monkeypatch):
    """A kind is one JobRunner subclass: defining it registers it; the runtime keeps no table of kinds."""
    from workers.jobs import registry
    from workers.jobs.runner import JobRunner
    from workers.jobs.services import job_enqueue, job_retry

    monkeypatch.setattr(registry, "_runners", dict(registry._runners))  # the test's kind goes with the test

    class Echo(JobRunner):
        name = "test_echo"
        queue = "default"
        timeout = 60

        def run(self, job, ctx):
            ctx.progress(50, "echoing")
            return {"echo": job.params["text"]}

    assert registry.runner_class("test_echo") is Echo and "test_echo" in registry.runner_kinds()
    job = job_enqueue(kind="test_echo", params={"text": "hi"}, user=operator)
    assert (job.queue, job.timeout_s) == ("default", 60)
    run_queued_jobs("default")
    job.refresh_from_db()
    assert job.status == "succeeded" and job.result == {"echo": "hi"} and job.progress == 100
    assert "echoing" in job.log
    retry = job_retry(job=job, user=operator)  # the default resubmit: same kind and parameters
    assert (retry.kind, retry.params, retry.retry_of_id) == ("test_echo", {"text": "hi"}, job.pk)
    with pytest.raises(ValueError):
        job_enqueue(kind="no_such_kind", params={}, user=operator)


@pytest.mark.django_db(transaction=True)
def test_migration_moves_job_links_to_the_generic_target_and_back():
    """0005 moves each job's registry links to its generic target (the artifact wins); reversible."""
    from django.db import connection
    from django.db.migrations.executor import MigrationExecutor

    before = [("workers", "0004_job_target")]
    after = [("workers", "0006_job_drop_registry_links")]
    executor = MigrationExecutor(connection)
    executor.migrate(before)
    old = executor.loader.project_state(before).apps
    OldJob = old.get_model("workers", "Job")
    model = old.get_model("models_registry", "Model").objects.create(name="m")
    artifact = old.get_model("models_registry", "Artifact").objects.create(model=model, format="hf", path="/x")
    on_artifact = OldJob.objects.create(
        kind="convert",
        queue="convert",
        rq_id="a",
        target_model=model,
        target_artifact=artifact,
        result_artifact=artifact,
        result={"artifact_id": artifact.pk},
    )
    on_model = OldJob.objects.create(kind="hash_artifact", queue="default", rq_id="b", target_model=model)
    on_nothing = OldJob.objects.create(kind="bench", queue="bench", rq_id="c")

    executor = MigrationExecutor(connection)
    executor.migrate(after)
    # The models as of `after` (today's Job has columns later migrations add).
    jobs = {j.rq_id: j for j in executor.loader.project_state(after).apps.get_model("workers", "Job").objects.all()}
    assert (jobs["a"].target_type.model, jobs["a"].target_id) == ("artifact", artifact.pk)
    assert jobs["a"].result["artifact_id"] == artifact.pk
    assert (jobs["b"].target_type.model, jobs["b"].target_id) == ("model", model.pk)
    assert (jobs["c"].target_type, jobs["c"].target_id) == (None, None)

    executor = MigrationExecutor(connection)
    executor.migrate(before)
    old = executor.loader.project_state(before).apps
    back = {j.rq_id: j for j in old.get_model("workers", "Job").objects.all()}
    assert (back["a"].target_artifact_id, back["a"].target_model_id, back["a"].result_artifact_id) == (
        artifact.pk,
        model.pk,
        artifact.pk,
    )
    assert (back["b"].target_artifact_id, back["b"].target_model_id) == (None, model.pk)
    assert (back["c"].target_artifact_id, back["c"].target_model_id) == (None, None)
    assert on_artifact.pk and on_model.pk and on_nothing.pk
    # Back to the newest state (not just `after`): later migrations are the tests' schema too.
    latest = MigrationExecutor(connection)
    latest.migrate(latest.loader.graph.leaf_nodes())


def _job_with_children_running(tmp_path, queue):
    """Enqueues tests.support.jobs.job_with_children on `queue`; (rq job, [horse, child, grandchild] pids) once
    they all run."""
    import django_rq
    from rq import Queue

    from tests.support.jobs import job_with_children

    pid_file = tmp_path / "pids"
    rq_job = Queue(queue, connection=django_rq.get_connection("default")).enqueue(
        job_with_children, str(pid_file), job_timeout=600
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not pid_file.exists():
        time.sleep(0.1)
    assert pid_file.exists(), "the job never started"
    time.sleep(0.2)
    return rq_job, [int(p) for p in pid_file.read_text().split()]


def _job_worker(env, queue, command="jobs_worker"):
    """`manage.py jobs_worker QUEUE`, or the convert and quantize workers' `rqworker QUEUE --worker-class
    workers.jobs.worker.JobWorker` (deploy/), in a session of its own."""
    import subprocess
    import sys

    from tests.support import ROOT

    argv = [queue] if command == "jobs_worker" else [queue, "--worker-class", "workers.jobs.worker.JobWorker"]
    return subprocess.Popen(
        [sys.executable, "manage.py", command, *argv],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _all_gone(pids, within=20.0) -> bool:
    import psutil

    def running(pid):
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not any(running(p) for p in pids):
            return True
        time.sleep(0.1)
    for pid in pids:  # leave nothing behind
        if running(pid):
            os.kill(pid, signal.SIGKILL)
    return False


@pytest.mark.django_db(transaction=True)
def test_a_cancelled_jobs_children_end_with_it(redis_conn, worker_env, tmp_path):
    """RQ stops a job (Cancel, its timeout) by SIGKILL to the work horse's process group: a job's children
    (a vLLM server for a serving check, ATC, a load client) are started in that group
    (workers.jobs.children), so they go with it; in sessions of their own they ran on, unseen."""
    from rq.command import send_stop_job_command

    worker = _job_worker(worker_env, "children-test")
    try:
        rq_job, pids = _job_with_children_running(tmp_path, "children-test")
        send_stop_job_command(redis_conn, rq_job.id)
        assert _all_gone(pids), pids
    finally:
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait()


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("command, queue", [("jobs_worker", "children-test"), ("rqworker", "convert")])
def test_stopping_the_job_worker_stops_its_job_and_the_jobs_children(redis_conn, worker_env, tmp_path, command, queue):
    """The console's workers (`jobs_worker`; the convert and quantize workers' `rqworker --worker-class
    workers.jobs.worker.JobWorker`) on SIGTERM take their running job down with them (RQ's cold shutdown): a
    supervisor kills the worker alone seconds later, and the job's work horse, in a process group of its own,
    ran on after the console stopped."""
    worker = _job_worker(worker_env, queue, command)
    try:
        _, pids = _job_with_children_running(tmp_path, queue)
        worker.send_signal(signal.SIGTERM)  # the worker only, as supervisord's stopasgroup reaches
        worker.wait(timeout=30)
        assert _all_gone(pids), (pids, worker.stdout.read().decode()[-2000:])
    finally:
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait()


@pytest.mark.django_db(transaction=True)
def test_the_heartbeat_outlives_a_database_error_and_a_reaped_job_commits_nothing(settings, tmp_path, monkeypatch):
    """One failed heartbeat write (a PostgreSQL restart, SQLite's lock timeout) ended the heartbeat thread, so
    the reaper failed a healthy job 30 s later while it ran on, and the job then moved its output into place
    anyway. Now the beat goes on; and a job whose row no longer says running stops before committing."""
    import threading

    from django.db import OperationalError

    from workers.jobs import runner
    from workers.jobs.context import JobCancelled, JobContext

    job = Job.objects.create(
        kind="convert",
        queue="convert",
        rq_id="r",
        status=Job.Status.RUNNING,
        heartbeat_at=timezone.now() - timezone.timedelta(minutes=5),
    )
    writes = []

    class FlakyRows:
        @staticmethod
        def filter(**lookups):
            writes.append(lookups)
            if len(writes) == 1:
                raise OperationalError("server closed the connection unexpectedly")
            return Job.objects.filter(**lookups)

    monkeypatch.setattr(runner, "Job", type("Job", (), {"objects": FlakyRows, "Status": Job.Status}))
    settings.JOB_HEARTBEAT_SECONDS = 0.05
    stop = threading.Event()
    beat = threading.Thread(target=runner._heartbeat, args=(job.pk, stop))
    beat.start()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and len(writes) < 3:
        time.sleep(0.02)
    stop.set()
    beat.join(timeout=5)
    assert len(writes) >= 3 and not beat.is_alive()
    assert (timezone.now() - Job.objects.get(pk=job.pk).heartbeat_at).total_seconds() < 5

    ctx = JobContext(job)
    staging = ctx.staging_dir(tmp_path / "out" / "model")
    (staging / "weights").write_text("w")
    Job.objects.filter(pk=job.pk).update(status=Job.Status.FAILED, error="worker stopped (no heartbeat)")
    with pytest.raises(JobCancelled):
        ctx.commit_staging(staging, tmp_path / "out" / "model")
    assert not (tmp_path / "out" / "model").exists()


@pytest.mark.django_db
def test_queued_jobs_whose_rq_job_is_gone_or_ended_unclaimed_are_failed(redis_conn):
    """A queued row whose RQ job Redis lost, or whose RQ job ended without the job ever claiming the row (its
    work horse died first: RQ keeps it in the failed registry 7 days), is failed with the reason, so its
    Retry is offered and its dedupe key stops blocking the same work. One still waiting in RQ stays queued."""
    old = timezone.now() - timezone.timedelta(minutes=5)
    lost, unclaimed, waiting = (
        Job.objects.create(kind="hash_artifact", queue="default", rq_id=f"reaper-{name}", created_at=old)
        for name in ("lost", "unclaimed", "waiting")
    )
    redis_conn.hset("rq:job:reaper-unclaimed", mapping={"status": "failed"})
    redis_conn.hset("rq:job:reaper-waiting", mapping={"status": "queued"})
    try:
        assert sorted(reap_jobs()) == sorted([lost.pk, unclaimed.pk])
    finally:
        redis_conn.delete("rq:job:reaper-unclaimed", "rq:job:reaper-waiting")
    lost, unclaimed, waiting = (Job.objects.get(pk=j.pk) for j in (lost, unclaimed, waiting))
    assert lost.status == "failed" and "lost from the queue" in lost.error
    assert unclaimed.status == "failed" and "never started (RQ: failed" in unclaimed.error
    assert waiting.status == "queued"


@pytest.mark.django_db(transaction=True)
def test_a_job_whose_process_dies_between_failing_and_cleaning_up_is_cleaned_up_by_the_reaper(
    tiny_artifact, monkeypatch, settings
):
    """Failing a job and its kind's cleanup (its 'building' artifact marked failed) were two steps: a process that
    died between them left the artifact 'building' for ever. The failure now sets cleanup_pending in the same
    UPDATE, and the reaper runs the cleanup once the worker has had its grace."""
    import logging

    from models_registry.jobs import ArtifactJobRunner
    from workers.jobs import registry, runner
    from workers.jobs.context import JobFailed
    from workers.jobs.services import job_enqueue

    monkeypatch.setattr(registry, "_runners", dict(registry._runners))

    class BuildsThenFails(ArtifactJobRunner):
        name = "test_builds_then_fails"
        queue = "default"

        def work(self, job, ctx):
            Artifact.objects.create(
                model=tiny_artifact.model,
                parent=tiny_artifact,
                producing_job=job,
                format="hf",
                dtype="float32",
                path=str(tiny_artifact.path) + "-copy",
                status=Artifact.Status.BUILDING,
            )
            raise JobFailed("the conversion's output failed its check")

    class ProcessDied(BaseException):
        """Stands in for SIGKILL after the job's row was written failed: nothing after it runs."""

    def dies(job):
        raise ProcessDied

    job = job_enqueue(kind="test_builds_then_fails", params={}, target=tiny_artifact)
    with monkeypatch.context() as dying, pytest.raises(ProcessDied):
        dying.setattr(runner, "cleanup_after_failure", dies)
        runner.run_job(job.pk)
    job_log = logging.getLogger("console.job")  # the dead run never detached its log handler
    for handler in [h for h in job_log.handlers if isinstance(h, runner._RowLogHandler)]:
        job_log.removeHandler(handler)
    job.refresh_from_db()
    built = Artifact.objects.get(producing_job=job)
    assert job.status == "failed" and job.cleanup_pending and built.status == "building"

    reap_jobs()  # within the grace: the worker may still be cleaning up itself
    assert Artifact.objects.get(pk=built.pk).status == "building"
    later = job.finished_at + timezone.timedelta(seconds=settings.JOB_STALE_SECONDS + 1)
    reap_jobs(now=later)
    built.refresh_from_db()
    assert built.status == "failed" and built.note == "the conversion's output failed its check"
    assert not Job.objects.get(pk=job.pk).cleanup_pending


@pytest.mark.django_db(transaction=True)
def test_a_cancelled_jobs_late_writes_are_cleaned_up_once_its_process_has_gone(
    tiny_artifact, operator, settings, redis_conn
):
    """A Cancel cleans up at once, but the running job may write once more before RQ kills it (an OM conversion
    past its last cancel check makes its next artifact 'building'). The cleanup stays pending, and the reaper
    runs it again once the job's heartbeat, written whatever the row says, has stopped."""
    from workers.jobs.services import job_cancel

    started = timezone.now()
    job = Job.objects.create(
        kind="convert",
        queue="convert",
        rq_id="cancel-race",
        status=Job.Status.RUNNING,
        started_at=started,
        heartbeat_at=started,
    )
    job_cancel(job=job, user=operator)
    job.refresh_from_db()
    assert job.status == "cancelled" and job.cleanup_pending
    Job.objects.filter(pk=job.pk).update(finished_at=started)  # the reaper's passes below are timed from here
    late = Artifact.objects.create(
        model=tiny_artifact.model,
        parent=tiny_artifact,
        producing_job=job,
        format="om",
        path=str(tiny_artifact.path) + "-om",
        status=Artifact.Status.BUILDING,
    )
    stale = timezone.timedelta(seconds=settings.JOB_STALE_SECONDS + 1)
    Job.objects.filter(pk=job.pk).update(heartbeat_at=started + stale)  # its process still beats
    reap_jobs(now=started + stale + timezone.timedelta(seconds=2))
    assert Artifact.objects.get(pk=late.pk).status == "building"
    reap_jobs(now=started + 3 * stale)  # the heartbeat stopped: the process has gone
    assert Artifact.objects.get(pk=late.pk).status == "failed" and not Job.objects.get(pk=job.pk).cleanup_pending
    with pytest.raises(Conflict):
        job_cancel(job=Job.objects.get(pk=job.pk), user=operator)


@pytest.mark.django_db(transaction=True)
def test_a_staging_directory_on_another_host_is_left_to_that_hosts_worker(settings, tmp_path, redis_conn):
    """A benchmark's staging lies on its endpoint's node; the reaper, on the console's host, found no such path
    there and forgot it, and the directory stayed on the node with nothing pointing at it. Now the reaper keeps
    the record, and each host's job worker removes its own ended jobs' staging (at start, then every 10 min)."""
    from django.db import connection
    from rq import Queue

    from workers.jobs.worker import JobWorker

    ended = {"status": Job.Status.FAILED, "finished_at": timezone.now()}
    elsewhere = Job.objects.create(
        kind="bench",
        queue="node-npu-2",
        rq_id="on-npu-2",
        node="npu-2",
        staging_path=str(tmp_path / "on-npu-2" / ".staging-job1-7"),
        **ended,
    )
    reap_jobs()
    assert Job.objects.get(pk=elsewhere.pk).staging_path == elsewhere.staging_path

    staging = tmp_path / "runs" / ".staging-job2-8"
    (staging / "client.log").parent.mkdir(parents=True)
    (staging / "client.log").write_text("half a run")
    here = Job.objects.create(
        kind="bench", queue="default", rq_id="here", node=settings.NODE_NAME, staging_path=str(staging), **ended
    )
    JobWorker([Queue("default", connection=redis_conn)], connection=redis_conn).run_maintenance_tasks()
    assert connection.connection is None  # RQ forks each job from the worker: it must hold no connection
    assert not staging.exists() and Job.objects.get(pk=here.pk).staging_path == ""
    assert Job.objects.get(pk=elsewhere.pk).staging_path == elsewhere.staging_path


@pytest.mark.django_db(transaction=True)
def test_the_heartbeat_goes_on_after_a_cancel_and_a_cancel_takes_a_job_that_started_meanwhile(
    operator, settings, redis_conn
):
    """The heartbeat says the process lives whatever the row says (the reaper's cleanup waits for it to stop);
    a Cancel of a job read as queued that a worker claimed meanwhile cancels it running."""
    import threading

    from workers.jobs import runner
    from workers.jobs.services import job_cancel

    old = timezone.now() - timezone.timedelta(minutes=5)
    cancelled = Job.objects.create(
        kind="convert", queue="convert", rq_id="beats", status=Job.Status.CANCELLED, finished_at=old, heartbeat_at=old
    )
    settings.JOB_HEARTBEAT_SECONDS = 0.05
    stop = threading.Event()
    beat = threading.Thread(target=runner._heartbeat, args=(cancelled.pk, stop))
    beat.start()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and Job.objects.get(pk=cancelled.pk).heartbeat_at == old:
        time.sleep(0.05)
    stop.set()
    beat.join(timeout=5)
    assert Job.objects.get(pk=cancelled.pk).heartbeat_at > old

    read_queued = Job.objects.create(kind="convert", queue="convert", rq_id="claimed-meanwhile")
    Job.objects.filter(pk=read_queued.pk).update(
        status=Job.Status.RUNNING, started_at=timezone.now(), heartbeat_at=timezone.now()
    )
    job = job_cancel(job=read_queued, user=operator)  # the object still says queued
    assert job.status == "cancelled" and Job.objects.get(pk=job.pk).cleanup_pending  # cancelled running: kept


@pytest.mark.django_db(transaction=True)
def test_a_cancel_is_audited_with_its_status_even_when_the_cleanup_after_it_fails(operator, redis_conn, monkeypatch):
    """The entry was written after the Redis call and the kind's cleanup (an rmtree of a large partial output):
    one that raised left a cancelled job with no entry (every other end of a job audits in its own write)."""
    from console.models import AuditEvent
    from workers.jobs import services

    def cleanup_fails(job, *, settled=True):
        raise OSError("Device or resource busy: staging")

    monkeypatch.setattr(services, "cleanup_after_failure", cleanup_fails)
    job = Job.objects.create(kind="convert", queue="convert", rq_id="cancel-audit")
    with pytest.raises(OSError):
        services.job_cancel(job=job, user=operator)
    assert Job.objects.get(pk=job.pk).status == "cancelled"
    entry = AuditEvent.objects.get(action="job.cancel", object_id=str(job.pk))
    assert entry.actor_name == operator.username and entry.changes["status"] == ["queued", "cancelled"]


@pytest.mark.django_db(transaction=True)
def test_a_cancel_between_the_commit_and_ready_wins_and_removes_the_output(
    operator, api_for, model_root, admin, redis_conn, settings, monkeypatch
):
    """The output was moved into the store, then a Cancel landed before the artifact was marked ready: the job
    marked it ready anyway (cancelled job, ready artifact), and a job killed there left a complete folder no row
    pointed at. Now ready is conditional on the job still running, and the cleanup removes the folder. An
    artifact still being built cannot be deleted under its job either."""
    from models_registry import jobs as registry_jobs

    source = _register(api_for(operator), "tiny", build_tiny_llama_hf(model_root / "tiny"))
    job_id = api_for(operator).post(f"/api/v1/artifacts/{source}/convert", {"to": "bf16"}).json()["job"]
    real_inspect = registry_jobs.inspect_path
    seen = {}

    def cancelled_meanwhile(path):  # _ready inspects the committed output first: the Cancel lands now
        built = Artifact.objects.get(producing_job_id=job_id)
        seen["deletable"] = api_for(admin).delete(f"/api/v1/artifacts/{built.pk}").status_code
        seen["path"] = Path(path)
        assert api_for(operator).post(f"/api/v1/jobs/{job_id}/cancel").status_code == 200
        return real_inspect(path)

    monkeypatch.setattr(registry_jobs, "inspect_path", cancelled_meanwhile)
    run_queued_jobs("convert")
    built = Artifact.objects.get(producing_job_id=job_id)
    assert seen["deletable"] == 409 and Job.objects.get(pk=job_id).status == "cancelled"
    assert built.status == "failed" and built.deleted_at is None
    assert seen["path"] == Path(built.path) and not seen["path"].exists()  # the committed output is gone


@pytest.mark.django_db(transaction=True)
def test_a_source_deleted_after_its_conversion_was_queued_is_not_converted(
    operator, api_for, model_root, redis_conn, settings
):
    """The delete's check (no active job) and the conversion's (a ready source) ran at the same moment, both
    passed, and the job converted a deleted artifact into a ready child nobody could see."""
    source = _register(api_for(operator), "tiny", build_tiny_llama_hf(model_root / "tiny"))
    job_id = api_for(operator).post(f"/api/v1/artifacts/{source}/convert", {"to": "bf16"}).json()["job"]
    Artifact.objects.filter(pk=source).update(status="deleted", deleted_at=timezone.now())  # the delete won
    run_queued_jobs("convert")
    job = Job.objects.get(pk=job_id)
    assert (
        job.status == "failed"
        and job.error == f"Artifact #{source} was deleted after this job was queued: nothing was read."
    )
    assert not Artifact.objects.filter(producing_job_id=job_id).exists()
    assert not _leftovers(Path(settings.ARTIFACT_STORE))


@pytest.mark.django_db(transaction=True)
def test_a_jobs_outcome_and_its_artifacts_ends_are_audited_once_as_the_system(
    tiny_artifact, operator, redis_conn, settings, monkeypatch
):
    """Job-made state changes were only in the job's log and on the rows: now a finished job and a failed job each
    leave one audit entry as the system (kind, target, error), and so does a 'building' artifact marked failed,
    however often the failure's cleanup runs (the worker, then the reaper); progress writes nothing."""
    from console.models import AuditEvent
    from models_registry.jobs import ArtifactJobRunner
    from workers.jobs import registry
    from workers.jobs.context import JobFailed
    from workers.jobs.runner import JobRunner
    from workers.jobs.services import cleanup_after_failure, job_enqueue

    monkeypatch.setattr(registry, "_runners", dict(registry._runners))

    class Counts(JobRunner):
        name = "test_counts"

        def run(self, job, ctx):
            for pct in (10, 50, 90):
                ctx.progress(pct, f"counting {pct}")
            return {"counted": 3}

    class BuildsThenFails(ArtifactJobRunner):
        name = "test_audit_fails"

        def work(self, job, ctx):
            ctx.progress(20, "building")
            Artifact.objects.create(
                model=tiny_artifact.model,
                parent=tiny_artifact,
                producing_job=job,
                format="hf",
                path=str(tiny_artifact.path) + "-copy",
                status=Artifact.Status.BUILDING,
            )
            raise JobFailed("the output failed its check")

    done = job_enqueue(kind="test_counts", params={}, user=operator, target=tiny_artifact)
    failed = job_enqueue(kind="test_audit_fails", params={}, user=operator, target=tiny_artifact)
    run_queued_jobs("default")
    failed.refresh_from_db()
    assert Job.objects.get(pk=done.pk).status == "succeeded" and failed.status == "failed"
    cleanup_after_failure(failed)  # the cleanup again (as the reaper runs it): no second entry
    reap_jobs(now=timezone.now() + timezone.timedelta(seconds=settings.JOB_STALE_SECONDS + 1))

    def ends(job):
        return list(
            AuditEvent.objects.filter(object_type="job", object_id=str(job.pk)).exclude(
                action__startswith="job.enqueue"
            )
        )

    [succeeded] = ends(done)
    assert (succeeded.action, succeeded.via, succeeded.actor_id, succeeded.actor_name) == (
        "job.succeeded.test_counts",
        "system",
        None,
        "",
    )
    assert succeeded.changes == {
        "status": ["running", "succeeded"],
        "kind": "test_counts",
        "target": {"type": "artifact", "id": tiny_artifact.pk},
    }
    [failure] = ends(failed)
    assert failure.action == "job.failed.test_audit_fails" and failure.via == "system"
    assert (
        failure.changes["status"] == ["running", "failed"] and failure.changes["error"] == "the output failed its check"
    )
    built = Artifact.objects.get(producing_job=failed)
    [marked] = AuditEvent.objects.filter(object_type="artifact", object_id=str(built.pk))
    assert (marked.action, marked.via, marked.changes["status"], marked.changes["job"]) == (
        "artifact.failed",
        "system",
        ["building", "failed"],
        failed.pk,
    )


@pytest.mark.django_db(transaction=True)
def test_a_reaped_job_is_audited_once_and_its_late_end_is_not(tiny_artifact, settings):
    """The reaper's failure is the job's one outcome entry: the worker's own end, written later, finds the row
    ended and writes neither the row nor the audit log."""
    from console.models import AuditEvent
    from workers.jobs import runner

    old = timezone.now() - timezone.timedelta(minutes=5)
    job = Job.objects.create(
        kind="convert",
        queue="convert",
        rq_id="reaped-audit",
        status=Job.Status.RUNNING,
        started_at=old,
        heartbeat_at=old,
        target=tiny_artifact,
    )
    assert reap_jobs() == [job.pk]
    assert not runner._finish(job, Job.Status.SUCCEEDED, progress=100)
    [entry] = AuditEvent.objects.filter(object_type="job", object_id=str(job.pk))
    assert entry.action == "job.failed.convert" and entry.via == "system" and "no heartbeat" in entry.changes["error"]
