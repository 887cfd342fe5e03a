"""Quantize-job helpers shared by the quantization and ModelSlim-checker tests."""

from pathlib import Path

import torch

from models_registry.quantize import modelslim, msmodelslim_run
from models_registry.quantize.selectors import DATA, read_paragraphs
from tests.support.jobs import run_queued_jobs
from tests.support.tiny_models import build_tiny_llama_hf
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


DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def _add_linear_biases(src: Path) -> None:
    """The same tiny Llama with attention_bias (q/k/v/o biases, random values), as Qwen2 has on q/k/v."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig.from_pretrained(str(src))
    cfg.attention_bias = True
    with torch.random.fork_rng():
        torch.manual_seed(1)
        model = LlamaForCausalLM(cfg)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(".bias"):
                    p.normal_(0, 0.1)
    model.to(cfg.dtype or torch.float32).save_pretrained(str(src))


def make_checkpoint(
    root: Path,
    *,
    scheme="w8a8_static",
    method="minmax",
    anti_outlier=None,
    float_layers=(),
    dtype="bfloat16",
    tied=False,
    bias=False,
    minmax_layers=(),
) -> Path:
    """A ModelSlim checkpoint of a tiny Llama, written by msModelSlim and finished as the quantize job does."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = build_tiny_llama_hf(
        root / "src", hidden_size=128, num_heads=4, num_kv_heads=2, dtype=dtype, tie_word_embeddings=tied
    )
    if bias:
        _add_linear_biases(src)
    tok = AutoTokenizer.from_pretrained(str(src))
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    calib = [tok(t)["input_ids"][:64] for t in read_paragraphs(DATA / "calibration_source.txt")[:6]]
    out = root / "out"
    out.mkdir()
    msmodelslim_run.quantize(
        model,
        calib,
        out,
        scheme=scheme,
        method=method,
        anti_outlier=anti_outlier,
        float_layers=list(float_layers),
        serve_dtype=DTYPES[dtype],
        minmax_layers=list(minmax_layers),
    )
    modelslim.finish(out, src, model_dtype=DTYPES[dtype], tied=tied)
    return out
