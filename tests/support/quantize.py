"""Quantize-job helpers shared by the quantization and ModelSlim-checker tests."""
import torch

from models_registry.quantize.selectors import DATA, read_paragraphs
from tests.support.jobs import run_queued_jobs
from workers.models import Job


def _add_outliers(path):
    """Make the random model predict English a little (a few training steps on the default text),
    so perplexity reacts to noise, then give it outlier activation channels without changing its
    function (a norm channel ×100, the next projections' input column ÷100), as real LLMs have:
    per-tensor static int8 then hurts exactly those layers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    texts = read_paragraphs(DATA / "calibration_source.txt") + read_paragraphs(DATA / "evaluation_source.txt")
    ids = [torch.tensor([tok(t)["input_ids"][:96]]) for t in texts]
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    torch.manual_seed(0)
    model.train()
    for step in range(60):
        x = ids[step % len(ids)]
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.input_layernorm.weight[3] *= 100
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.weight[:, 3] /= 100
            layer.post_attention_layernorm.weight[5] *= 100
            for proj in (layer.mlp.gate_proj, layer.mlp.up_proj):
                proj.weight[:, 5] /= 100
    model.to(torch.bfloat16).save_pretrained(str(path))


def _quantize(api, artifact_id, **options):
    r = api.post(f"/api/v1/artifacts/{artifact_id}/quantize", options)
    assert r.status_code == 202, r.content
    run_queued_jobs("quantize")
    job = Job.objects.get(pk=r.json()["job"])
    return job
