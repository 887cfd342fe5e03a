"""Evaluations without an engine: the task catalogue (shipped, uploaded, cached registry tasks), a registry task
that needs a download failing fast in the real lm-eval child, the comparison's noise rule on recorded lm-eval
figures, the API's refusals and its job, uploads validated before anything is kept, samples confined."""

import json
import subprocess
import sys
import time

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile

from console.models import AuditEvent
from evaluations import tasks as catalogue
from evaluations.compare import compare_rows
from evaluations.models import Evaluation, UploadedTask
from evaluations.services import results_rows
from tests.evaluations.conftest import changed
from tests.support import ROOT
from tests.support.demo import demo_hf_float32
from tests.support.gateway import make_endpoint
from workers.models import Job


def test_the_shipped_suites_are_listed_with_their_documents():
    shipped = {t.name: t for t in catalogue.shipped_tasks()}
    assert set(catalogue.DEFAULT_SUITE) <= set(shipped)
    assert (shipped["console_mc"].output_type, shipped["console_mc"].documents) == ("multiple_choice", 40)
    assert (shipped["console_gen"].output_type, shipped["console_gen"].documents) == ("generate_until", 30)
    for line in (catalogue.SUITES_DIR / "console_mc.jsonl").read_text().splitlines():
        doc = json.loads(line)
        assert len(doc["choices"]) == 4 and 0 <= doc["answer"] < 4


def test_registry_tasks_are_listed_only_when_their_dataset_is_cached(tmp_path):
    # lm-eval 0.4.13's own task files name the datasets: arc_easy reads allenai/ai2_arc.
    assert catalogue.registry_datasets()["arc_easy"] == "allenai/ai2_arc"
    assert catalogue.registry_tasks(tmp_path) == []
    (tmp_path / "hub" / "datasets--allenai--ai2_arc").mkdir(parents=True)
    names = {t.name for t in catalogue.registry_tasks(tmp_path)}
    assert {"arc_easy", "arc_challenge"} <= names and "hellaswag" not in names


def test_a_registry_task_that_needs_a_download_says_so_instead_of_hanging(tmp_path, settings):
    """The real child, offline as the job runs it: the dataset is not cached, so it stops at once with a message
    that names the task and the download; no request is made (no server at the URL)."""
    spec = {
        "base_url": "http://127.0.0.1:9",
        "model": "demo",
        "tokenizer": str(demo_hf_float32()),  # the demo's real tokenizer: the child loads it before any dataset
        "tasks": ["arc_easy"],
        "include_path": None,
        "limit": 2,
        "seed": 1,
    }
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(tmp_path),
        "HF_HOME": str(tmp_path / "hf"),
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": str(ROOT),
    }
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "evaluations.harness", str(tmp_path / "spec.json"), str(tmp_path)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        timeout=300,
    )
    assert proc.returncode != 0
    error = json.loads((tmp_path / "error.json").read_text())["error"]
    assert time.monotonic() - started < 300
    assert "A task needs a download" in error and "arc_easy" in error and "allenai/ai2_arc" in error, error


def test_results_rows_pair_each_metric_with_its_standard_error(recorded_summary):
    rows = {(r["task"], r["metric"]): r for r in results_rows(recorded_summary)}
    assert set(rows) == {
        ("console_mc", "acc,none"),
        ("console_mc", "acc_norm,none"),
        ("console_gen", "exact_match,strip"),
    }
    mc = rows[("console_mc", "acc,none")]
    assert mc["value"] == pytest.approx(0.675) and mc["stderr"] == pytest.approx(0.075) and mc["n"] == 40


def test_a_difference_is_beyond_noise_past_twice_its_standard_error(recorded_rows):
    same = compare_rows(recorded_rows, recorded_rows)
    assert all(r["diff"] == 0 and r["beyond_noise"] is False for r in same)
    # se 0.075 on both sides: 2·√(2·0.075²) = 0.2121
    near = {r["metric"]: r for r in compare_rows(recorded_rows, changed(recorded_rows, **{"acc,none": 0.675 - 0.21}))}
    far = {r["metric"]: r for r in compare_rows(recorded_rows, changed(recorded_rows, **{"acc,none": 0.675 - 0.22}))}
    assert near["acc,none"]["noise"] == pytest.approx(0.2121, abs=1e-4)
    assert near["acc,none"]["beyond_noise"] is False and far["acc,none"]["beyond_noise"] is True
    missing = changed(recorded_rows)
    missing[0]["stderr"] = None
    assert compare_rows(missing, recorded_rows)[0]["beyond_noise"] is None


# --- the API ------------------------------------------------------------------------------------------


@pytest.fixture
def served(tokenizer_dir):
    endpoint = make_endpoint("ev-demo", [], model="demo")
    endpoint.artifact.path = str(tokenizer_dir)
    endpoint.artifact.save(update_fields=["path"])
    return endpoint


@pytest.mark.django_db
def test_tasks_api_lists_the_suites_to_a_viewer(viewer, api_for):
    listed = api_for(viewer).get("/api/v1/evaluations/tasks")
    assert listed.status_code == 200
    names = {t["name"]: t for t in listed.json()}
    assert names["console_mc"]["source"] == "shipped" and names["console_gen"]["output_type"] == "generate_until"


@pytest.mark.django_db
def test_post_refuses_bad_input_naming_the_field_and_changes_nothing(operator, api_for, served, redis_conn):
    api = api_for(operator)
    for body, field, words in [
        ({"endpoint": served.pk, "tasks": ["nope"]}, "tasks", "not a task here"),
        ({"endpoint": served.pk, "tasks": ["arc_easy"]}, "tasks", "needs a download"),
        ({"endpoint": served.pk, "tasks": []}, "tasks", "Name one task"),
        ({"endpoint": served.pk, "tasks": ["console_mc"], "limit": 0}, "limit", "limit must be"),
        ({"endpoint": served.pk, "tasks": ["console_mc"], "api": "chat"}, "api", "log-likelihoods"),
        ({"tasks": ["console_mc"]}, "endpoint", "endpoint or an artifact"),
    ]:
        refused = api.post("/api/v1/evaluations", body)
        assert refused.status_code == 400, refused.content
        assert field in refused.json()["errors"] and words in refused.json()["detail"], refused.json()
    served.artifact.path = "/nowhere/model.gguf"
    served.artifact.save(update_fields=["path"])
    refused = api.post("/api/v1/evaluations", {"endpoint": served.pk, "tasks": ["console_mc"]})
    assert refused.status_code == 400 and "tokenizer" in refused.json()["detail"]
    assert not Evaluation.objects.exists() and not Job.objects.exists()


@pytest.mark.django_db
def test_post_queues_an_evaluate_job_and_get_answers_state_and_results(
    operator, viewer, api_for, served, redis_conn, recorded_summary
):
    created = api_for(operator).post(
        "/api/v1/evaluations", {"endpoint": "ev-demo", "tasks": "console_mc,console_gen", "limit": 5}
    )
    assert created.status_code == 202, created.content
    body = created.json()
    assert body["state"] == "queued" and body["tasks"] == ["console_mc", "console_gen"] and body["limit"] == 5
    assert body["measured"] == "served by an engine" and body["seed"] == 1234
    job = Job.objects.get(pk=body["job"])
    assert job.kind == "evaluate" and job.params == {"evaluation": body["id"]}
    assert AuditEvent.objects.filter(action="evaluation.create", actor=operator).count() == 1
    # What the job records at its end, from lm-eval's figures:
    Evaluation.objects.filter(pk=body["id"]).update(status="succeeded", results=results_rows(recorded_summary))
    job.status = "succeeded"
    job.save(update_fields=["status"])
    got = api_for(viewer).get(f"/api/v1/evaluations/{body['id']}").json()
    assert got["state"] == "succeeded"
    assert {"task": "console_mc", "metric": "acc,none", "value": 0.675, "stderr": 0.07499999999999998, "n": 40} in (
        got["results"]
    )


@pytest.mark.django_db
def test_an_evaluation_whose_job_was_cancelled_reads_failed(operator, api_for, served, redis_conn):
    body = api_for(operator).post("/api/v1/evaluations", {"endpoint": served.pk, "tasks": ["console_gen"]}).json()
    Job.objects.filter(pk=body["job"]).update(status="cancelled")
    got = api_for(operator).get(f"/api/v1/evaluations/{body['id']}").json()
    assert got["state"] == "failed" and "cancelled" in got["error"]


# --- uploads ---------------------------------------------------------------------------------------------

MC_DOCS = (
    b'{"q": "Two plus two?", "options": ["3", "4"], "gold": 1}\n{"q": "Sky?", "options": ["blue", "red"], "gold": 0}\n'
)


def _upload(client, **fields):
    data = {
        "name": "my_mc",
        "output_type": "multiple_choice",
        "doc_to_text": "Q: {{q}}\nA:",
        "doc_to_target": "{{gold}}",
        "doc_to_choice": "{{options}}",
        "file": SimpleUploadedFile("docs.jsonl", MC_DOCS),
        **fields,
    }
    return client.post("/evaluations/tasks/upload", data, follow=True)


@pytest.mark.django_db
def test_an_operator_uploads_a_task_validated_on_every_document(client, operator, settings, tmp_path):
    settings.EVALUATION_DATA_DIR = tmp_path / "evaluations"
    client.force_login(operator)
    for fields, words in [
        ({"name": "Bad Name"}, "lower-case"),
        ({"name": "console_mc"}, "exists already"),
        ({"name": "arc_easy"}, "registry task"),
        ({"doc_to_text": "Q: {{question}}"}, "Document 1"),
        ({"doc_to_target": "{{options}}"}, "not a choice"),
        ({"doc_to_choice": ""}, "doc_to_choice"),
        ({"file": SimpleUploadedFile("d.jsonl", b'{"q": 1}\nnot json\n')}, "line 2 is not JSON"),
    ]:
        page = _upload(client, **fields)
        assert words in page.content.decode(), (fields, page.content.decode()[:3000])
    assert not UploadedTask.objects.exists()
    settings.EVALUATION_TASK_MAX_BYTES = 10
    assert "at most 10 are accepted" in _upload(client).content.decode()
    settings.EVALUATION_TASK_MAX_BYTES = 5 * 1024**2
    assert "Task my_mc added (2 documents)" in _upload(client).content.decode()
    task = UploadedTask.objects.get()
    assert (settings.EVALUATION_DATA_DIR / "tasks" / "my_mc.jsonl").read_bytes() == MC_DOCS
    config = catalogue.uploaded_config(task)
    assert config["dataset_kwargs"]["data_files"]["test"] == task.path and config["doc_to_choice"] == "{{options}}"
    assert "my_mc" in {t.name for t in catalogue.available_tasks()}
    written = catalogue.write_include_dir(["my_mc", "console_mc"], tmp_path / "inc")
    assert sorted(p.name for p in written.iterdir()) == ["console_mc.yaml", "my_mc.yaml"]
    assert AuditEvent.objects.filter(action="evaluation_task.upload", actor=operator).exists()


@pytest.mark.django_db
def test_a_viewer_may_not_upload_or_start(client, viewer):
    client.force_login(viewer)
    assert _upload(client).status_code == 403
    assert client.post("/evaluations/new", {"tasks": ["console_mc"]}).status_code == 403


@pytest.mark.django_db
def test_samples_download_only_the_recorded_file_inside_the_data_dir(client, viewer, settings, tmp_path):
    settings.EVALUATION_DATA_DIR = tmp_path / "evaluations"
    inside = tmp_path / "evaluations" / "runs" / "1" / "samples.jsonl"
    inside.parent.mkdir(parents=True)
    inside.write_text('{"task": "console_mc", "doc_id": 0}\n')
    outside = tmp_path / "secret.jsonl"
    outside.write_text("secret")
    kept = Evaluation.objects.create(tasks=["console_mc"], status="succeeded", samples_path=str(inside))
    escaped = Evaluation.objects.create(tasks=["console_mc"], status="succeeded", samples_path=str(outside))
    client.force_login(viewer)
    got = client.get(f"/evaluations/{kept.pk}/samples.jsonl")
    assert got.status_code == 200 and b"".join(got.streaming_content).startswith(b'{"task": "console_mc"')
    assert client.get(f"/evaluations/{escaped.pk}/samples.jsonl").status_code == 404
