"""Links planted below a registered model after registration (sub/etc -> a folder outside the roots, a file
swapped for a link to a secret) are never followed out of MODEL_ROOTS / the artifact store: not by the hash
job, inspection, conversions, quantization's copies, nor the artifact store's writes. Each case puts a unique
marker in the outside file and checks it reaches no output, hash, log or listing."""

import hashlib
import os
import shutil
import uuid
from pathlib import Path

import pytest
from django.conf import settings

from models_registry.inspection import inspect_path
from models_registry.models import Artifact
from models_registry.paths import PathRefused, open_confined, tree_files
from models_registry.quantize import compressed, modelslim
from tests.support.jobs import run_queued_jobs
from tests.support.quantize import _quantize
from tests.support.tiny_models import build_tiny_llama_gguf, build_tiny_llama_hf
from workers.models import Job


@pytest.fixture
def outside(tmp_path):
    """A folder outside the roots holding a secret with a unique marker (valid JSON and Jinja text, so a
    reader that followed a link to it would accept it)."""
    folder = tmp_path / "outside"
    folder.mkdir()
    marker = f"confinement-marker-{uuid.uuid4().hex}"
    (folder / "secret.txt").write_text(f'{{"chat_template": "{marker}", "marker": "{marker}"}}\n')
    return folder, marker


def _register(api, name, path):
    response = api.post("/api/v1/models", {"name": name, "path": str(path)})
    assert response.status_code == 201, response.content
    return response.json()["artifacts"][0]["id"]


def _plant(model_dir: Path, how: str, outside_dir: Path) -> str:
    """Make the registered model lead outside; returns the relative name the refusal must mention."""
    if how == "dir_link":
        (model_dir / "sub").mkdir()
        (model_dir / "sub" / "etc").symlink_to(outside_dir, target_is_directory=True)
        return "sub/etc"
    name = {"file_swap": "chat_template.jinja", "config_swap": "tokenizer_config.json"}[how]
    (model_dir / name).unlink(missing_ok=True)
    (model_dir / name).symlink_to(outside_dir / "secret.txt")
    return name


def _nothing_leaked(marker: str, secret: Path, *texts: str) -> None:
    """The marker is in no file of the artifact store, no artifact row, and none of the given texts."""
    store_files = []
    for folder, _, files in os.walk(settings.ARTIFACT_STORE):  # os.walk does not follow links: what was written here
        store_files += [Path(folder) / f for f in files if not (Path(folder) / f).is_symlink()]
    for path in store_files:
        assert marker.encode() not in path.read_bytes(), f"{path} holds the outside file's content"
    digest = hashlib.sha256(secret.read_bytes()).hexdigest()
    for artifact in Artifact.objects.all():
        assert digest not in artifact.file_hashes.values() and marker not in str(artifact.inspection)
        assert not any("etc/" in name for name in artifact.file_hashes)
        assert not any("etc/" in name for name in (artifact.inspection or {}).get("files") or [])
    for text in texts:
        assert marker not in text and digest not in text


# --- the hash job --------------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("how", ["dir_link", "file_swap"])
def test_hash_job_refuses_a_link_planted_after_registration(how, operator, api_for, model_root, outside, redis_conn):
    outside_dir, marker = outside
    path = build_tiny_llama_hf(model_root / "tiny")
    aid = _register(api_for(operator), "tiny", path)
    named = _plant(path, how, outside_dir)
    run_queued_jobs("default")
    job = Job.objects.get(kind="hash_artifact", target_id=aid)
    assert job.status == "failed", job.result
    assert named in job.error and "outside the allowed model roots" in job.error, job.error
    artifact = Artifact.objects.get(pk=aid)
    assert artifact.sha256 == "" and artifact.file_hashes == {}
    _nothing_leaked(marker, outside_dir / "secret.txt", job.log, job.error, str(job.result))


@pytest.mark.django_db(transaction=True)
def test_hash_job_refuses_a_registered_gguf_swapped_for_a_link(
    operator, api_for, model_root, tmp_path, outside, redis_conn
):
    outside_dir, marker = outside
    gguf = build_tiny_llama_gguf(model_root / "tiny.gguf")
    aid = _register(api_for(operator), "tiny", gguf)
    shutil.move(gguf, outside_dir / "tiny.gguf")
    gguf.symlink_to(outside_dir / "tiny.gguf")
    run_queued_jobs("default")
    job = Job.objects.get(kind="hash_artifact", target_id=aid)
    assert job.status == "failed" and str(gguf) in job.error, job.error
    digest = hashlib.sha256((outside_dir / "tiny.gguf").read_bytes()).hexdigest()
    assert Artifact.objects.get(pk=aid).file_hashes == {} and digest not in job.log


# --- inspection and the listing it stores --------------------------------------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize("how", ["dir_link", "file_swap", "config_swap"])
def test_inspection_refuses_what_leads_outside(how, model_root, outside):
    outside_dir, marker = outside
    path = build_tiny_llama_hf(model_root / "tiny", chat_template=False)
    inspect_path(path)
    named = _plant(path, how, outside_dir)
    with pytest.raises(PathRefused, match=named) as refused:
        inspect_path(path)
    assert marker not in str(refused.value)


@pytest.mark.django_db
def test_inspection_follows_links_that_stay_inside_the_roots(model_root, settings):
    """A Hugging Face cache links snapshot files to blobs elsewhere under the root: still read."""
    path = build_tiny_llama_hf(model_root / "tiny")
    blobs = model_root / "blobs"
    blobs.mkdir()
    shutil.move(path / "model.safetensors", blobs / "abc123")
    (path / "model.safetensors").symlink_to(blobs / "abc123")
    (path / "extra").symlink_to(Path(settings.ARTIFACT_STORE), target_is_directory=True)
    Path(settings.ARTIFACT_STORE).mkdir(parents=True, exist_ok=True)
    (Path(settings.ARTIFACT_STORE) / "notes.txt").write_text("inside the store")
    info = inspect_path(path)
    assert info["param_count"] and "model.safetensors" in info["files"] and "extra/notes.txt" in info["files"]


def test_a_file_swapped_between_the_walk_and_the_open_is_refused(tmp_path, outside, settings):
    settings.MODEL_ROOTS = [tmp_path / "models"]
    outside_dir, marker = outside
    root = build_tiny_llama_hf(tmp_path / "models" / "tiny")
    files = tree_files(root)
    target = root / "tokenizer.json"
    assert target in files
    target.unlink()
    target.symlink_to(outside_dir / "secret.txt")
    with pytest.raises(PathRefused, match="tokenizer.json"):
        open_confined(target, tree=root)


@pytest.mark.django_db
def test_a_registered_folder_swapped_for_a_link_out_is_refused_not_taken_as_its_own_tree(tmp_path, outside, settings):
    """A tree read outside the roots (a CLI check) may link inside itself; a registered one, named inside the
    roots, may not become its own allowance: swapped for a link out after its check, every read through it
    (the conversion's copy of the non-weight files, the hash job's walk) is refused."""
    from models_registry.convert.common import copy_non_weight_files

    settings.MODEL_ROOTS = [tmp_path / "models"]
    outside_dir, marker = outside
    root = build_tiny_llama_hf(tmp_path / "models" / "tiny")
    assert root in [f.parent for f in tree_files(root)]
    shutil.rmtree(root)
    root.symlink_to(outside_dir, target_is_directory=True)  # after the job's check
    with pytest.raises(PathRefused, match="outside the allowed model roots"):
        tree_files(root)
    with pytest.raises(PathRefused):
        copy_non_weight_files(root, tmp_path / "out")
    with pytest.raises(PathRefused):
        open_confined(root / "secret.txt", tree=root)
    assert not (tmp_path / "out" / "secret.txt").exists()


# --- conversions ---------------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("how", ["dir_link", "file_swap"])
def test_conversion_refuses_and_leaves_nothing(
    how, operator, viewer, api_for, model_root, outside, redis_conn, settings
):
    outside_dir, marker = outside
    path = build_tiny_llama_hf(model_root / "tiny")
    api = api_for(operator)
    aid = _register(api, "tiny", path)
    named = _plant(path, how, outside_dir)
    job_id = api.post(f"/api/v1/artifacts/{aid}/convert", {"to": "fp16"}).json()["job"]
    run_queued_jobs("convert", "default")
    job = Job.objects.get(pk=job_id)
    assert job.status == "failed", (job.result, job.error)
    assert named in job.error and "outside the allowed model roots" in job.error, job.error
    assert not Artifact.objects.filter(producing_job=job, status="ready").exists()
    store = Path(settings.ARTIFACT_STORE)
    assert not [p for p in store.rglob("*") if ".staging" in p.name or "job" in p.name]
    # What a Viewer sees of every artifact (the API's listing of its files) names nothing outside.
    for artifact in Artifact.objects.all():
        body = api_for(viewer).get(f"/api/v1/artifacts/{artifact.pk}").content.decode()
        assert marker not in body and "etc/secret" not in body
    _nothing_leaked(marker, outside_dir / "secret.txt", job.log, job.error)


@pytest.mark.django_db(transaction=True)
def test_gguf_conversion_refuses_a_source_swapped_for_a_link(operator, api_for, model_root, outside, redis_conn):
    outside_dir, _ = outside
    gguf = build_tiny_llama_gguf(model_root / "tiny.gguf")
    api = api_for(operator)
    aid = _register(api, "tiny", gguf)
    shutil.move(gguf, outside_dir / "tiny.gguf")
    gguf.symlink_to(outside_dir / "tiny.gguf")
    job_id = api.post(f"/api/v1/artifacts/{aid}/convert", {"to": "hf", "dtype": "bfloat16"}).json()["job"]
    run_queued_jobs("convert")
    job = Job.objects.get(pk=job_id)
    assert job.status == "failed" and str(gguf) in job.error, job.error
    assert not Artifact.objects.filter(producing_job=job, status="ready").exists()


@pytest.mark.django_db(transaction=True)
def test_nothing_is_written_through_a_link_out_of_the_artifact_store(
    operator, api_for, model_root, tmp_path, redis_conn, settings
):
    api = api_for(operator)
    aid = _register(api, "tiny", build_tiny_llama_hf(model_root / "tiny"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    Path(settings.ARTIFACT_STORE).mkdir(parents=True, exist_ok=True)
    (Path(settings.ARTIFACT_STORE) / "tiny").symlink_to(elsewhere, target_is_directory=True)
    job_id = api.post(f"/api/v1/artifacts/{aid}/convert", {"to": "fp16"}).json()["job"]
    run_queued_jobs("convert")
    job = Job.objects.get(pk=job_id)
    assert job.status == "failed" and "outside the artifact store" in job.error, job.error
    assert list(elsewhere.iterdir()) == []


# --- quantization ---------------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_quantize_job_refuses_a_link_planted_after_registration(
    operator, api_for, model_root, outside, redis_conn, settings
):
    settings.QUANTIZE_SERVE_CHECK = False
    settings.ARTIFACT_STORE_MIN_FREE_BYTES = 0
    outside_dir, marker = outside
    path = build_tiny_llama_hf(model_root / "tiny", hidden_size=128, num_heads=4, num_kv_heads=2, dtype="bfloat16")
    api = api_for(operator)
    aid = _register(api, "tiny", path)
    named = _plant(path, "file_swap", outside_dir)
    job = _quantize(api, aid, target="ascend-modelslim", scheme="w8a8_dynamic", gate_pct=100)
    assert job.status == "failed" and named in job.error, (job.status, job.error)
    assert not Artifact.objects.filter(producing_job=job).exclude(status="failed").exists()
    _nothing_leaked(marker, outside_dir / "secret.txt", job.log, job.error)


@pytest.mark.parametrize("how", ["file_swap", "config_swap"])
def test_modelslim_copy_of_the_model_files_never_follows_a_link_out(how, tmp_path, outside, settings):
    settings.MODEL_ROOTS = [tmp_path / "models"]
    outside_dir, marker = outside
    src = build_tiny_llama_hf(tmp_path / "models" / "tiny")
    named = _plant(src, how, outside_dir)
    dst = tmp_path / "staging"
    dst.mkdir()
    with pytest.raises(PathRefused, match=named):
        modelslim.copy_model_files(src, dst)
    assert not any(marker.encode() in p.read_bytes() for p in dst.iterdir())


def test_compressed_tensors_save_never_copies_through_a_link_out(tmp_path, outside, settings):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    settings.MODEL_ROOTS = [tmp_path / "models"]
    outside_dir, marker = outside
    src = build_tiny_llama_hf(tmp_path / "models" / "tiny")
    model = AutoModelForCausalLM.from_pretrained(str(src))
    tokenizer = AutoTokenizer.from_pretrained(str(src))
    tokenizer.chat_template = None  # so save() copies the source's chat_template.jinja itself
    named = _plant(src, "file_swap", outside_dir)
    dst = tmp_path / "staging"
    with pytest.raises(PathRefused, match=named):
        compressed.save(model, tokenizer, src, dst)
    assert not any(marker.encode() in p.read_bytes() for p in dst.iterdir())
