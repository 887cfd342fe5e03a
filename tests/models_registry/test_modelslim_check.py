"""The ModelSlim checker (models_registry/quantize/modelslim_check.py): the pinned vllm-ascend's loader rules.

Checkpoints come from the real msModelSlim path on tiny Llamas (msmodelslim_run.quantize + modelslim.finish,
as the quantize job calls them) and must load as written: any finding fails the test, named."""

import io
import json
import shutil
import tokenize
from pathlib import Path

import pytest
import torch
from django.core.management import CommandError, call_command
from safetensors.torch import load_file, save_file

from models_registry.quantize import modelslim, modelslim_check, msmodelslim_run
from models_registry.quantize.modelslim_check import RULES, check, errors
from models_registry.quantize.selectors import DATA, read_paragraphs
from tests.support import FIXTURES
from tests.support.quantize import make_checkpoint
from tests.support.tiny_models import build_tiny_llama_hf


class UnexplainedFindings(Exception):
    """Findings on a checkpoint the console writes: vllm-ascend would not load it as written."""


def assert_loads(findings):
    if findings:
        raise UnexplainedFindings([str(f) for f in findings])


# --- real msModelSlim output ------------------------------------------------------------------------

GROUP0 = [f"model.layers.0.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")]
CASES = {
    "w8a8_dynamic-bf16": {"scheme": "w8a8_dynamic"},
    "w8a8_dynamic-fp16": {"scheme": "w8a8_dynamic", "dtype": "float16"},
    "w8a8_dynamic-biases": {"scheme": "w8a8_dynamic", "bias": True},
    "w8a16-bf16": {"scheme": "w8a16"},
    "w8a8_dynamic-whole-group-float": {"scheme": "w8a8_dynamic", "float_layers": GROUP0},
    "w8a8_dynamic-tied": {"scheme": "w8a8_dynamic", "tied": True},
    "w8a8_static-minmax-bf16": {},
    "w8a8_static-minmax-fp16": {"dtype": "float16"},
    "w8a8_static-kl-m1": {"method": "kl", "anti_outlier": "m1"},
    "w8a8_static-minmax-m4": {"anti_outlier": "m4"},
    "w8a8_static-biases": {"bias": True},
    "w8a8_static-whole-group-float": {"float_layers": GROUP0},
    "w8a8_static-kl-tied": {"method": "kl", "tied": True},
}


@pytest.mark.parametrize("case", list(CASES))
def test_msmodelslim_output_passes(case, tmp_path):
    assert_loads(check(make_checkpoint(tmp_path, **CASES[case])))


def test_kl_with_a_min_max_choice_for_one_shard_is_named(tmp_path):
    """The quantize job chooses KL or min-max per projection (its minmax_layers); one shard of qkv_proj on
    min-max gives that fused layer two input scales, of which vllm-ascend keeps one."""
    out = make_checkpoint(tmp_path, method="kl", minmax_layers=["model.layers.0.self_attn.q_proj"])
    subjects = {f.subject for f in check(out) if f.rule == "shared-input-scale"}
    assert "model.layers.0.self_attn.qkv_proj.input_scale" in subjects
    assert not any(".layers.1." in s or "gate_up_proj" in s for s in subjects)


@pytest.mark.slow  # a real quantization job (minutes here): its database use is the same on both
@pytest.mark.django_db(transaction=True)
def test_fallback_job_output_passes(model_root, operator, api_for, redis_conn, settings):
    """The real quantize job's fallback (tiny model with outlier channels, a 1 % gate, as test_quantize)."""
    from models_registry.models import Artifact
    from tests.support.quantize import _add_outliers, _quantize

    settings.QUANTIZE_SERVE_CHECK = False
    settings.ARTIFACT_STORE_MIN_FREE_BYTES = 0
    path = build_tiny_llama_hf(model_root / "tiny", hidden_size=128, num_heads=4, num_kv_heads=2, dtype="bfloat16")
    _add_outliers(path)
    api = api_for(operator)
    aid = api.post("/api/v1/models", {"name": "tiny", "path": str(path)}).json()["artifacts"][0]["id"]
    job = _quantize(
        api,
        aid,
        target="ascend-modelslim",
        scheme="w8a8_static",
        method="minmax",
        gate_pct=1,
        fallback=True,
        max_fallback_layers=14,
    )
    art = Artifact.objects.get(producing_job=job)
    if not art.accuracy["float_layers"]:
        raise UnexplainedFindings("the fallback kept nothing in float: this test checks nothing")
    assert_loads(check(Path(art.path)))


# --- deliberately broken directories ----------------------------------------------------------------


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """Real W8A8 static output (bf16, untied): every broken copy differs from it by one thing."""
    out = make_checkpoint(tmp_path_factory.mktemp("good"))
    assert [str(f) for f in check(out)] == []
    return out


def broken(good: Path, tmp_path: Path, edit) -> Path:
    """A copy of ``good`` with edit(description, tensors) applied to its description and tensors."""
    out = tmp_path / "broken"
    shutil.copytree(good, out)
    desc = json.loads((out / modelslim.DESCRIPTION).read_text())
    weights = out / modelslim.WEIGHT_FILE["W8A8"]
    tensors = load_file(str(weights))
    edit(desc, tensors)
    save_file(tensors, str(weights), metadata={"format": "pt"})
    (out / modelslim.DESCRIPTION).write_text(json.dumps(desc, indent=2))
    return out


def _rules(findings):
    return {(f.rule, f.subject, f.severity) for f in findings}


Q, K = "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj"


def _drop_lm_head(desc, tensors):  # from the description only, as modelslim.finish does on tied models
    del desc["lm_head.weight"]


def _split_group(desc, tensors):  # q stays W8A8, k goes back to float (dequantized)
    tensors[f"{K}.weight"] = (tensors[f"{K}.weight"].float() * tensors[f"{K}.weight_scale"].float()).bfloat16()
    for name in ("weight_scale", "weight_offset", "input_scale", "input_offset", "quant_bias", "deq_scale"):
        del tensors[f"{K}.{name}"], desc[f"{K}.{name}"]
    desc[f"{K}.weight"] = "FLOAT"


def _drop_deq_scale(desc, tensors):
    del tensors[f"{Q}.deq_scale"]


def _wrong_dtype(desc, tensors):
    tensors[f"{Q}.weight_scale"] = tensors[f"{Q}.weight_scale"].float()


def _wrong_shape(desc, tensors):
    tensors[f"{Q}.weight_scale"] = tensors[f"{Q}.weight_scale"].flatten().contiguous()


def _undescribed(desc, tensors):
    del desc["model.layers.1.self_attn.o_proj.quant_bias"]


def _unequal_input_scales(desc, tensors):
    tensors[f"{Q}.input_scale"] = tensors[f"{Q}.input_scale"] * 2


def _undeclared_norm_bias(desc, tensors):
    tensors["model.layers.0.input_layernorm.bias"] = torch.ones(128, dtype=torch.bfloat16)


def _unsupported_scheme(desc, tensors):
    for proj in ("q_proj", "k_proj", "v_proj"):
        desc[f"model.layers.0.self_attn.{proj}.weight"] = "W8A4"


def _missing_linear(desc, tensors):
    del desc["model.layers.1.mlp.down_proj.weight"]


E, W = "error", "warning"
BROKEN = {
    # v0.23.0rc1 on, an undescribed lm_head loads as float (modelslim_config.py lines 665-671): warnings only
    "dropped lm_head": (
        _drop_lm_head,
        {("linear-described", "lm_head.weight", W), ("tensor-described", "lm_head.weight", W)},
    ),
    "split fused group": (_split_group, {("packed-one-type", "model.layers.0.self_attn.qkv_proj", E)}),
    "missing deq_scale": (_drop_deq_scale, {("tensor-present", f"{Q}.deq_scale", E)}),
    # weight_scale in float32 where a bf16 model's is bfloat16: the loader's copy_ casts it
    "wrong dtype": (_wrong_dtype, {("tensor-dtype", f"{Q}.weight_scale", W)}),
    "wrong shape": (_wrong_shape, {("tensor-shape", f"{Q}.weight_scale", E)}),
    "undescribed tensor": (_undescribed, {("tensor-described", "model.layers.1.self_attn.o_proj.quant_bias", W)}),
    "unequal input scales": (
        _unequal_input_scales,
        {("shared-input-scale", "model.layers.0.self_attn.qkv_proj.input_scale", E)},
    ),
    "undeclared norm bias": (
        _undeclared_norm_bias,
        {
            ("norm-bias-declared", "model.layers.0.input_layernorm.bias", E),
            ("tensor-described", "model.layers.0.input_layernorm.bias", W),
        },
    ),
    "unsupported scheme": (_unsupported_scheme, {("scheme-supported", "W8A4", E)}),
    "undescribed linear": (
        _missing_linear,
        {
            ("linear-described", "model.layers.1.mlp.down_proj.weight", E),
            ("tensor-described", "model.layers.1.mlp.down_proj.weight", W),
        },
    ),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_broken_directory_is_named_by_its_rule(case, good, tmp_path):
    edit, expected = BROKEN[case]
    findings = check(broken(good, tmp_path, edit))
    assert _rules(findings) == expected, [str(f) for f in findings]
    assert all(f.rule in RULES for f in findings)


def test_fp32_model_cannot_serve_w8a8_static(good, tmp_path):
    out = broken(good, tmp_path, lambda desc, tensors: None)
    cfg = json.loads((out / "config.json").read_text())
    cfg.pop("torch_dtype", None)
    cfg["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(cfg))
    rules = {f.rule for f in check(out)}
    assert {"scheme-supported", "tensor-unexpected", "tensor-dtype"} <= rules


def test_vendored_upstream_sample_is_read_as_an_unknown_architecture(tmp_path):
    """msModelSlim's documented description sample (DeepSeek layout): valid JSON, but not an architecture
    whose Linear layers this checker knows, and no weights beside it."""
    sample = FIXTURES / "modelslim" / "quant_model_description_w8a8_dynamic_example.json"
    shutil.copy(sample, tmp_path / modelslim.DESCRIPTION)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v3"}))
    assert {f.rule for f in check(tmp_path)} == {"weight-files", "architecture"}


def test_command_prints_findings_and_fails(good, tmp_path, capsys):
    call_command("check_modelslim", str(good))
    assert "no errors, vllm-ascend v0.23.0's loader rules hold" in capsys.readouterr().out
    with pytest.raises(CommandError, match="1 error"):
        call_command("check_modelslim", str(broken(good, tmp_path, _drop_deq_scale)))
    assert f"[tensor-present] {Q}.deq_scale" in capsys.readouterr().out


# --- what binds, what warns, and for which release ---------------------------------------------------


def raw_checkpoint(root: Path) -> Path:
    """msModelSlim's own output, not finished by modelslim.finish: its float32 scales and offsets (an integral
    float input_offset, a float32 lm_head), with the source's config.json copied beside it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = build_tiny_llama_hf(root / "src", hidden_size=128, num_heads=4, num_kv_heads=2, dtype="bfloat16")
    tok = AutoTokenizer.from_pretrained(str(src))
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    calib = [tok(t)["input_ids"][:64] for t in read_paragraphs(DATA / "calibration_source.txt")[:6]]
    out = root / "out"
    out.mkdir()
    msmodelslim_run.quantize(
        model,
        calib,
        out,
        scheme="w8a8_static",
        method="minmax",
        anti_outlier=None,
        float_layers=[],
        serve_dtype=torch.bfloat16,
    )
    modelslim.copy_model_files(src, out)
    return out


def test_raw_msmodelslim_output_is_not_failed_for_scales_the_loader_casts(tmp_path):
    """The loaders fill each parameter with copy_ (vLLM's linear weight_loader, reached through vllm-ascend's
    ops/linear.py), which casts: float32 scales load as bfloat16 values. Only deq_scale's dtype binds."""
    out = raw_checkpoint(tmp_path)
    findings = check(out)
    assert errors(findings) == [], [str(f) for f in errors(findings)]
    cast = {f.subject for f in findings if f.rule == "tensor-dtype"}
    assert f"{Q}.weight_scale" in cast and f"{Q}.input_offset" in cast  # named, as warnings
    assert not any(name.endswith("deq_scale") for name in cast)
    warning = next(f for f in findings if f.subject == f"{Q}.weight_scale")
    assert warning.severity == "warning" and "copy_ casts it to bfloat16" in warning.message
    assert str(warning).startswith("[tensor-dtype] warning: ")


def test_deq_scale_in_the_other_packing_is_an_error_naming_both_dtypes(good, tmp_path):
    def packed_as_fp16(desc, tensors):
        tensors[f"{Q}.deq_scale"] = tensors[f"{Q}.deq_scale"].view(torch.int32).to(torch.int64)

    (finding,) = check(broken(good, tmp_path, packed_as_fp16))
    assert (finding.rule, finding.severity) == ("tensor-dtype", "error")
    assert "int64 (written for a float16 model)" in finding.message and "float32 for this bfloat16" in finding.message


def test_undescribed_lm_head_warns_at_the_pinned_release_and_fails_before_its_float_fallback(good, tmp_path, settings):
    out = broken(good, tmp_path, _drop_lm_head)
    lm = next(f for f in check(out) if f.rule == "linear-described")
    assert lm.severity == "warning" and "vllm-ascend v0.23.0 loads lm_head as float" in lm.message
    assert errors(check(out)) == []
    # the release before the fallback (v0.22.1rc1 raised KeyError 'lm_head.weight'), given as the pin
    settings.VLLM_ASCEND_VERSION = "0.22.1rc1"
    lm = next(f for f in check(out) if f.rule == "linear-described")
    assert lm.severity == "error" and "vllm-ascend v0.22.1rc1 raises KeyError 'lm_head.weight'" in lm.message
    # or named for one run
    assert errors(check(out, version="0.23.0rc1")) == []


def test_tensor_described_is_a_warning_that_says_it_is_no_loader_rule(good, tmp_path):
    (finding,) = check(broken(good, tmp_path, _undescribed))
    assert finding.rule == "tensor-described" and finding.severity == "warning"
    assert "not a loader rule" in finding.message and "so it loads" in finding.message


def test_the_pinned_release_names_itself_in_the_texts(good, tmp_path, settings, capsys):
    settings.VLLM_ASCEND_VERSION = "0.23.1"
    (scheme,) = check(broken(good, tmp_path, _unsupported_scheme))
    assert "vllm-ascend v0.23.1 has no linear scheme" in scheme.message
    call_command("check_modelslim", str(good))
    assert "vllm-ascend v0.23.1's loader rules hold" in capsys.readouterr().out
    # one constant: no release string in the checker's code (its comments cite where upstream was read)
    source = Path(modelslim_check.__file__).read_text()
    strings = [
        t.string
        for t in tokenize.generate_tokens(io.StringIO(source).readline)
        if t.type == tokenize.STRING and "0.23.0" in t.string and not t.string.startswith('"""')
    ]
    assert strings == ['"0.23.0rc1"'], strings  # LM_HEAD_FLOAT_SINCE: a fact about upstream, not the pin


def test_command_passes_a_checkpoint_with_warnings_only(good, tmp_path, capsys):
    call_command("check_modelslim", str(broken(good, tmp_path, _drop_lm_head)))
    out = capsys.readouterr().out
    assert "[linear-described] warning: lm_head.weight" in out and "(2 warning(s))" in out
    with pytest.raises(CommandError, match="1 error"):
        call_command("check_modelslim", str(broken(good, tmp_path / "b", _drop_lm_head)), "--vllm-ascend", "v0.22.1rc1")
