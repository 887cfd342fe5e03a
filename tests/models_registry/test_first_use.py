"""What a new user meets on the registry's pages: an artifact page offers only the conversions and the
launch that would be accepted (and says why not, in one line), and uploaded calibration datasets can be
deleted (not the built-in defaults, not while a quantization reads them)."""

import re

import pytest

from console.models import AuditEvent
from models_registry import services as registry
from models_registry.models import Artifact
from models_registry.options import QuantizeOptions
from models_registry.quantize import selectors as quantize_selectors
from models_registry.quantize import services as quantize_services
from models_registry.quantize.models import CalibrationDataset
from tests.support.tiny_models import build_tiny_llama_gguf
from workers.models import Node

LAUNCH_BUTTON = 'id="launch-artifact"'


@pytest.fixture
def modelslim_artifact(tiny_artifact, model_root):
    """A ModelSlim checkpoint quantized from the tiny float model (its files are not read by these pages)."""
    path = model_root / "tiny-w8a8"
    path.mkdir()
    return Artifact.objects.create(
        model=tiny_artifact.model, parent=tiny_artifact, format="ascend-modelslim", dtype="W8A8", path=str(path)
    )


@pytest.mark.django_db
def test_modelslim_artifact_on_a_cpu_only_site_offers_no_convert_and_no_launch(
    modelslim_artifact, cpu_node, as_operator
):
    page = as_operator.get(f"/artifacts/{modelslim_artifact.pk}/").content.decode()
    assert 'id="convert-form"' not in page and '<select name="to"' not in page
    refusal = re.search(r'id="convert-refusal">([^<]*)<', page).group(1)
    assert "already quantized" in refusal
    assert LAUNCH_BUTTON not in page
    launch = re.search(r'id="launch-refusal">([^<]*)<', page).group(1)
    assert "Ascend NPU nodes only" in launch and "CPU nodes only" in launch, launch


@pytest.mark.django_db
def test_modelslim_artifact_can_be_launched_once_an_ascend_node_is_registered(
    modelslim_artifact, cpu_node, ascend_node, as_operator
):
    page = as_operator.get(f"/artifacts/{modelslim_artifact.pk}/").content.decode()
    assert LAUNCH_BUTTON in page and 'id="launch-refusal"' not in page


@pytest.mark.django_db
def test_float_artifact_lists_the_conversions_the_service_accepts(tiny_artifact, cpu_node, as_operator, as_viewer):
    page = as_operator.get(f"/artifacts/{tiny_artifact.pk}/").content.decode()
    select = page.index('<select name="to" id="id_to"')
    targets = page[select : page.index("</select>", select)]
    assert re.findall(r'<option value="(\w+)"', targets) == ["fp16", "bf16", "om"]
    assert LAUNCH_BUTTON in page and 'id="convert-refusal"' not in page
    viewer_page = as_viewer.get(f"/artifacts/{tiny_artifact.pk}/").content.decode()
    assert LAUNCH_BUTTON not in viewer_page and 'id="launch-refusal"' not in viewer_page


@pytest.mark.django_db
def test_gguf_artifact_says_why_it_is_not_launched(model_root, cpu_node, as_operator):
    gguf = build_tiny_llama_gguf(model_root / "tiny.gguf", tensor_type="Q8_0")
    model = registry.model_register(name="smol", path=str(gguf), user=None)
    page = as_operator.get(f"/artifacts/{model.artifacts.get().pk}/").content.decode()
    assert LAUNCH_BUTTON not in page
    assert "Convert it to Hugging Face format first" in re.search(r'id="launch-refusal">([^<]*)<', page).group(1)
    assert '<option value="hf"' in page


# --- calibration datasets ------------------------------------------------------------------------


def _upload(client, name="ops-logs", count=12):
    text = "\n\n".join(f"Paragraph {i} about serving models on Ascend." for i in range(count))
    response = client.post("/calibration/upload", {"name": name, "content": text})
    assert response.status_code == 302, response.content
    return CalibrationDataset.objects.get(name=name)


@pytest.mark.django_db
def test_operator_deletes_an_uploaded_dataset_audited(as_operator, operator, as_viewer):
    ds = _upload(as_operator)
    detail = as_operator.get(f"/calibration/{ds.pk}").content.decode()
    assert f'action="/calibration/{ds.pk}/delete"' in detail
    assert f'action="/calibration/{ds.pk}/delete"' not in as_viewer.get(f"/calibration/{ds.pk}").content.decode()
    assert as_viewer.post(f"/calibration/{ds.pk}/delete").status_code == 403
    assert CalibrationDataset.objects.filter(pk=ds.pk).exists()

    response = as_operator.post(f"/calibration/{ds.pk}/delete")
    assert response.status_code == 302 and response.url == "/calibration/"
    assert not CalibrationDataset.objects.filter(pk=ds.pk).exists()
    event = AuditEvent.objects.get(action="calibration.delete")
    assert event.actor == operator and event.object_id == str(ds.pk) and event.changes["name"] == "ops-logs"


@pytest.mark.django_db
def test_builtin_defaults_cannot_be_deleted(as_admin):
    default = quantize_selectors.default_dataset("calibration")
    detail = as_admin.get(f"/calibration/{default.pk}").content.decode()
    assert "/delete" not in detail and 'id="dataset-builtin"' in detail
    response = as_admin.post(f"/calibration/{default.pk}/delete", follow=True)
    assert "built-in default" in response.content.decode()
    assert CalibrationDataset.objects.filter(pk=default.pk).exists()
    assert not AuditEvent.objects.filter(action="calibration.delete").exists()


@pytest.mark.django_db
def test_a_dataset_is_kept_while_a_queued_quantization_reads_it(
    tiny_artifact, operator, as_operator, redis_conn, settings
):
    settings.ARTIFACT_STORE_MIN_FREE_BYTES = 0
    ds = _upload(as_operator)
    job = quantize_services.artifact_quantize(
        artifact=tiny_artifact,
        user=operator,
        options=QuantizeOptions(target="compressed-tensors", scheme="w8a8_dynamic", calibration=ds.pk),
    )
    assert job.status == "queued" and job.params["calibration"] == ds.pk

    response = as_operator.post(f"/calibration/{ds.pk}/delete", follow=True)
    assert f"Quantize job #{job.pk} (queued)" in response.content.decode()
    assert CalibrationDataset.objects.filter(pk=ds.pk).exists()
    assert not AuditEvent.objects.filter(action="calibration.delete").exists()

    job.status = "succeeded"
    job.save(update_fields=["status"])
    assert as_operator.post(f"/calibration/{ds.pk}/delete").status_code == 302
    assert not CalibrationDataset.objects.filter(pk=ds.pk).exists()


@pytest.mark.django_db
def test_no_node_means_no_launch(tiny_artifact, as_operator):
    assert not Node.objects.exists()
    page = as_operator.get(f"/artifacts/{tiny_artifact.pk}/").content.decode()
    assert LAUNCH_BUTTON not in page and "No node is registered" in page
