"""The accuracy gate's simulation (modelslim.SimLinear) computes what vllm-ascend v0.23.0 computes, and agrees
with msModelSlim's own fake quantization of a saved checkpoint (upstream's code, the pinned package: last section).

What vllm-ascend computes is vllm-ascend's own code running: its files at tag v0.23.0 (vllm-project/vllm-ascend,
commit 5cb98caa) vendored byte for byte in tests/fixtures/vllm_ascend_quant/ (SOURCES.md there; the first test
checks their git blob ids): the schemes quantization/methods/w8a8_static.py, w8a8_dynamic.py and w8a16.py with
upstream's base.py, registry.py and quant_type.py, and ops/register_custom_ops.py, whose ``_quantize_impl`` is
``torch.ops.vllm.quantize`` (registered for these tests, removed after). ``VllmAscendLinear`` builds a layer as
vLLM does (AscendLinearMethod.create_weights registers the parameters the scheme's ``get_weight`` /
``get_pertensor_param`` / ``get_perchannel_param`` create, with their dtypes; vLLM's Linear adds the float bias in
``params_dtype``; the loader copies the checkpoint's tensors in), then runs the scheme's
``process_weights_after_loading`` and ``apply(layer, x, bias)`` as LinearBase.forward does. Stood in for
(tests/support/vllm_ascend_standins.py) is only what this machine cannot have: torch_npu's kernels, written in
plain torch from CANN's documented formulas (aclnnAscendQuantV3, aclnnQuantMatmulV4, aclnnDynamicQuant,
aclnnWeightQuantBatchMatmulV2; the int8 products accumulated exactly in int64, as the int32 accumulators do for
these sizes), and the names the files import from vLLM and the rest of vllm-ascend (the weight prefetcher, the NZ
cast and DSA-CP switch as they behave for these layers with the default configuration; MoE and communication
names that fail if used).

Tolerance: one unit in the last place of the output dtype (bf16 2⁻⁷, fp16 2⁻¹⁰, relative): both sides
cast the same values to the model's dtype and differ only in the float32 / float64 order of the final
scaling. Rounding: ties to even (the kernel's rint cast); bf16 activations times a bf16 reciprocal land
exactly half-way often, and the offset is added before rounding, so both are part of what is checked.
"""

import json
import re

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from models_registry.quantize import calibrate as cal
from models_registry.quantize import modelslim
from tests.support.quantize import DTYPES, make_checkpoint
from tests.support.vllm_ascend_standins import MODULES, VENDORED, git_blob_id, load_upstream, vllm_custom_ops

ULP = {torch.bfloat16: 2**-7, torch.float16: 2**-10}
UPSTREAM_COMMIT = "5cb98caaadeff42b5b62b996e34bb2aaa29d20fd"


# --- vllm-ascend's own files ---------------------------------------------------------------------


def test_vendored_vllm_ascend_files_are_upstreams_unchanged():
    """Each file in tests/fixtures/vllm_ascend_quant/ has the git blob id SOURCES.md records for its upstream path
    at v0.23.0 (what `git rev-parse v0.23.0:<path>` prints there): an edit, even of whitespace, fails here."""
    rows = re.findall(
        r"^\| `([^`]+)` \| `([^`]+)` \| (\S+) \| `([0-9a-f]{40})` \| `([0-9a-f]{40})` \| Apache-2\.0 \|$",
        (VENDORED / "SOURCES.md").read_text(),
        re.M,
    )
    assert sorted(f for f, *_ in rows) == sorted(p.name for p in VENDORED.glob("*.py")) == sorted(MODULES)
    for filename, upstream_path, tag, commit, blob in rows:
        assert (tag, commit) == ("v0.23.0", UPSTREAM_COMMIT)
        assert upstream_path == MODULES[filename].replace(".", "/") + ".py"
        assert git_blob_id((VENDORED / filename).read_bytes()) == blob, f"{filename} is not upstream's"


@pytest.fixture(scope="module")
def vllm_ascend():
    """vllm-ascend's modules, with torch.ops.vllm.quantize (register_custom_ops.py) registered meanwhile."""
    with vllm_custom_ops("quantize"):
        yield load_upstream()


class VllmAscendLinear(torch.nn.Module):
    """One Linear as vLLM with vllm-ascend v0.23.0 loads and runs it from a ModelSlim checkpoint, on one card."""

    def __init__(self, vllm_ascend, tensors: dict, prefix: str, qtype: str, params_dtype: torch.dtype):
        super().__init__()
        t = {k[len(prefix) + 1 :]: v for k, v in tensors.items() if k.startswith(prefix + ".")}
        output_size, input_size = t["weight"].shape
        # LinearBase.__init__: the layer knows its params_dtype and prefix (upstream's apply() reads both).
        self.params_dtype, self.prefix = params_dtype, prefix
        # ModelSlimConfig.get_quant_method: the scheme registered for the layer's quant type, in
        # AscendLinearMethod (method_adapters.py), whose create_weights registers what the scheme's get_* return
        # as Parameters (requires_grad=False), in this order.
        self.scheme = vllm_ascend.registry.get_scheme_class(qtype, "linear")()
        for created in (
            self.scheme.get_weight(input_size, output_size, params_dtype),
            self.scheme.get_pertensor_param(params_dtype, layer_type="others"),
            self.scheme.get_perchannel_param(output_size, params_dtype),
            self.scheme.get_pergroup_param(input_size, output_size, params_dtype, layer_type="others"),
        ):
            for name, value in created.items():
                self.register_parameter(name, torch.nn.Parameter(value, requires_grad=False))
        # vLLM's Linear: the float bias, in params_dtype, when the layer has one.
        bias = torch.nn.Parameter(torch.empty(output_size, dtype=params_dtype), requires_grad=False)
        self.register_parameter("bias", bias if "bias" in t else None)
        # The loader (default_weight_loader): each parameter from the checkpoint tensor of its name, same shape,
        # copied in (copy_ casts to the parameter's dtype); every tensor of the layer has its parameter.
        assert sorted(t) == sorted(n for n, _ in self.named_parameters()), (sorted(t), list(self.named_parameters()))
        for name, param in self.named_parameters():
            assert param.shape == t[name].shape, name
            param.data.copy_(t[name])
        self.scheme.process_weights_after_loading(self)

    def forward(self, x):
        # LinearBase.forward: quant_method.apply(self, x, bias); AscendLinearMethod.apply passes tp_rank 0 for a
        # column-parallel layer and the tensor-parallel rank, 0 on one card, for a row-parallel one.
        return self.scheme.apply(self, x, self.bias, 0)


def assert_same(sim, ref, dtype):
    assert sim.dtype == ref.dtype == dtype
    torch.testing.assert_close(
        sim.float(), ref.float(), rtol=ULP[dtype], atol=ULP[dtype] * ref.float().abs().mean().item()
    )


# --- random layers ---------------------------------------------------------------------------------


def random_layer(qtype, dtype, *, n=48, k=64, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = {
        "l.weight": torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8),
        "l.weight_scale": (torch.rand(n, 1, generator=g) * 0.01 + 1e-3).to(dtype),
        "l.weight_offset": torch.zeros(n, 1, dtype=dtype),
    }
    if bias:
        t["l.bias"] = (torch.randn(n, generator=g) * 0.5).to(dtype)
    if qtype == "W8A8":
        in_scale = torch.tensor([0.037]).to(dtype)
        t["l.input_scale"] = in_scale
        t["l.input_offset"] = torch.tensor([-3], dtype=torch.int8)
        t["l.quant_bias"] = torch.randint(-5000, 5000, (n,), generator=g, dtype=torch.int32)
        deq = (in_scale.float() * t["l.weight_scale"].float().flatten()).float()
        t["l.deq_scale"] = (
            deq if dtype == torch.bfloat16 else torch.from_numpy(deq.numpy().view(np.int32).astype(np.int64))
        )
    if qtype == "W8A16":
        t["l.weight_offset"] = torch.randint(-3, 4, (n, 1), generator=g).to(dtype)
    return t


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("qtype", ["W8A8", "W8A8_DYNAMIC", "W8A16"])
def test_simulation_matches_vllm_ascend_apply_on_random_inputs(qtype, dtype, vllm_ascend):
    tensors = random_layer(qtype, dtype)
    x = (torch.randn(37, 64, generator=torch.Generator().manual_seed(1)) * 2).to(dtype)
    ref = VllmAscendLinear(vllm_ascend, tensors, "l", qtype, dtype)(x)
    assert_same(modelslim.SimLinear(tensors, "l", qtype)(x), ref, dtype)


def test_w8a8_static_uses_quant_bias_in_place_of_the_float_bias(vllm_ascend):
    """vllm-ascend passes quant_bias to npu_quant_matmul and drops the layer's float bias: a simulation that
    adds it again measures another model."""
    tensors = random_layer("W8A8", torch.bfloat16)
    x = torch.randn(5, 64).to(torch.bfloat16)
    ref = VllmAscendLinear(vllm_ascend, tensors, "l", "W8A8", torch.bfloat16)(x)
    without_bias = {k: v for k, v in tensors.items() if k != "l.bias"}
    assert torch.equal(ref, VllmAscendLinear(vllm_ascend, without_bias, "l", "W8A8", torch.bfloat16)(x))
    assert_same(modelslim.SimLinear(tensors, "l", "W8A8")(x), ref, torch.bfloat16)


# --- real msModelSlim checkpoints, real activations ---------------------------------------------------


@pytest.mark.parametrize(
    "scheme,dtype",
    [("w8a8_static", "bfloat16"), ("w8a8_static", "float16"), ("w8a8_dynamic", "bfloat16"), ("w8a16", "bfloat16")],
)
def test_simulation_matches_vllm_ascend_on_a_checkpoint_with_biases(scheme, dtype, tmp_path, vllm_ascend):
    """A tiny Llama with q/k/v/o biases (as Qwen2 has), quantized by msModelSlim: every quantized layer's
    simulated output equals vllm-ascend's on that layer's real inputs, and what vllm-ascend computes is close
    to the float layer (msModelSlim folded the float bias into quant_bias: nothing is lost or added twice)."""
    out = make_checkpoint(tmp_path, scheme=scheme, dtype=dtype, bias=True)
    torch_dtype = DTYPES[dtype]
    tensors = load_file(str(out / modelslim.WEIGHT_FILE[modelslim.SCHEME_TYPE[scheme]]))
    qtype = modelslim.SCHEME_TYPE[scheme]
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "src"), dtype=torch_dtype)
    inputs = {}

    def keep(name):
        def hook(module, args, output):
            inputs[name] = (args[0].detach(), output.detach())

        return hook

    hooks = [m.register_forward_hook(keep(name)) for name, m in cal.quant_linears(model).items()]
    ids = torch.randint(0, model.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        model(input_ids=ids)
    for h in hooks:
        h.remove()
    description = json.loads((out / modelslim.DESCRIPTION).read_text())
    checked = 0
    for name, (x, y_float) in inputs.items():
        if description.get(f"{name}.weight") != qtype:
            continue
        x = x.reshape(-1, x.shape[-1])
        ref = VllmAscendLinear(vllm_ascend, tensors, name, qtype, torch_dtype)(x)
        assert_same(modelslim.SimLinear(tensors, name, qtype)(x), ref, torch_dtype)
        y_float = y_float.reshape(ref.shape).float()
        rel = ((ref.float() - y_float).norm() / y_float.norm()).item()
        assert rel < 0.1, f"{name}: vllm-ascend's output is {rel:.3f} away from the float layer"
        checked += 1
    assert checked >= 7 * 2  # both layers' seven projections


# --- msModelSlim's own code: its fake quantization of a saved checkpoint ---------------------------------------
#
# Upstream, at the pinned version (requirements.txt `msmodelslim==26.1.0`), imported from the installed package
# rather than copied: its quantization helpers (`llm_ptq_tools/quant_funcs`) ship compiled only, so a vendored
# transcription would be a third hand copy, not upstream's code. What is run, in msmodelslim 26.1.0:
# * pytorch/llm_ptq/llm_ptq_tools/calibrator/calibrator_classes/fake_quantize/w8a8_fakequantizer.py,
#   FakeLinearQuantizerOfW8A8 (lines 31-99): set_param unpacks deq_scale (int64tofp32), derives the weight scale
#   (deqscale_process) and dequantizes the weight; forward quantizes x per tensor with input_scale/offset, or
#   per token when is_dynamic (its own min-max, asymmetric), and runs F.linear with the layer's float bias;
# * .../fake_quantize/w8a16_w4a16_fakequantizer.py, FakeLinearQuantizerOfW8A16OrW4A16 (lines 27-73):
#   (quant_weight - weight_offset) · weight_scale in the model's dtype, F.linear with the float bias;
# * format/common/deqscale.py, deqscale2int64_by_dtype (lines 36-42): how save() packs deq_scale;
# * calibrator_classes/fakequantize_calibrator.py (lines 106-136) feeds them the saved tensors, as below.
# quant_bias is what save() writes (pytorch/llm_ptq/llm_ptq_tools/save/complex_quantifier.py lines 396-401:
# round(float bias / deq_scale - Σ weight · input_offset)): computed here from those lines, since they sit in a
# generator over calibrated modules.
#
# msModelSlim's fake quantization is not vllm-ascend's arithmetic (it divides by input_scale where vllm-ascend
# multiplies by its reciprocal, keeps the float bias where vllm-ascend adds quant_bias, and quantizes a dynamic
# layer's tokens asymmetrically where npu_dynamic_quant is symmetric), so the two agree to a tolerance measured on
# these layers (relative error of the output, worst of three seeds: W8A8 0.3 %, W8A16 bf16 0.3 % and fp16 0.04 %,
# W8A8 dynamic 1 %), not to the last place. Errors the simulation could make (a bias added twice or dropped, an
# offset's sign, deq_scale unpacked the other way, a scale per row instead of per column) are 5 % and more.
# Only symmetric weights (weight_offset 0), as this console asks msModelSlim for (w_sym=True,
# msmodelslim_run.py): for an asymmetric W8A16 weight msModelSlim's fake quantizer subtracts weight_offset where
# torch_npu's npu_weight_quant_batchmatmul (vllm-ascend w8a16.py) adds it.

UPSTREAM_TOLERANCE = {
    ("W8A8", torch.float16): 0.01,
    ("W8A16", torch.bfloat16): 0.01,
    ("W8A16", torch.float16): 0.002,
    ("W8A8_DYNAMIC", torch.bfloat16): 0.03,
    ("W8A8_DYNAMIC", torch.float16): 0.03,
}


def test_the_installed_msmodelslim_is_the_pinned_one():
    """The provenance above is of this version: a bump of the pin is a reason to read those files again."""
    from importlib.metadata import version

    from tests.support import ROOT

    pinned = [
        line.split("==")[1].strip()
        for line in (ROOT / "requirements.txt").read_text().splitlines()
        if line.startswith("msmodelslim==")
    ]
    assert pinned == [version("msmodelslim")] == ["26.1.0"]


def msmodelslim_layer(tensors: dict, prefix: str, qtype: str, dtype: torch.dtype):
    """The layer as msModelSlim's FakeQuantizeCalibrator builds it from a saved checkpoint's tensors."""
    from msmodelslim.pytorch.llm_ptq.llm_ptq_tools.calibrator.calibrator_classes.fake_quantize import (
        FakeLinearQuantizerOfW8A8,
        FakeLinearQuantizerOfW8A16OrW4A16,
    )

    n, k = tensors[f"{prefix}.weight"].shape
    linear = torch.nn.Linear(k, n, bias=f"{prefix}.bias" in tensors).to(dtype)
    if linear.bias is not None:
        linear.bias.data = tensors[f"{prefix}.bias"].to(dtype)
    params = {"quant_weight": tensors[f"{prefix}.weight"]}
    if qtype == "W8A16":
        layer = FakeLinearQuantizerOfW8A16OrW4A16()
        params.update(weight_offset=tensors[f"{prefix}.weight_offset"], weight_scale=tensors[f"{prefix}.weight_scale"])
    elif qtype == "W8A8":
        layer = FakeLinearQuantizerOfW8A8()
        params.update(
            deq_scale=tensors[f"{prefix}.deq_scale"],
            input_offset=tensors[f"{prefix}.input_offset"],
            input_scale=tensors[f"{prefix}.input_scale"],
        )
    else:
        layer = FakeLinearQuantizerOfW8A8()
        params.update(weight_scale=tensors[f"{prefix}.weight_scale"], is_dynamic=True)
    layer.set_param(linear, **params)
    return layer


def saved_layer(qtype, dtype, *, seed):
    """A random layer's tensors as msModelSlim's save() writes them: symmetric weights; for W8A8 the deq_scale
    packed by upstream's deqscale2int64_by_dtype and quant_bias from the float bias (complex_quantifier.py)."""
    from msmodelslim.format.common.deqscale import deqscale2int64_by_dtype

    t = random_layer(qtype, dtype, seed=seed)
    t["l.weight_offset"] = torch.zeros_like(t["l.weight_offset"])
    if qtype == "W8A8":
        deq = (t["l.input_scale"].float() * t["l.weight_scale"].float().flatten()).to(torch.float32)
        correction = t["l.weight"].float().sum(dim=1) * t["l.input_offset"].float()
        t["l.quant_bias"] = torch.round(t["l.bias"].float() / deq - correction).to(torch.int32)
        t["l.deq_scale"] = deqscale2int64_by_dtype(deq, dtype == torch.bfloat16)
    return t


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("qtype,dtype", list(UPSTREAM_TOLERANCE), ids=lambda v: str(v).replace("torch.", ""))
def test_simulation_matches_msmodelslims_own_fake_quantization_on_random_layers(qtype, dtype, seed):
    """On W8A8 fp16 only: msModelSlim's FakeLinearQuantizerOfW8A8 always reads deq_scale as packed int64
    (int64tofp32), which save() writes for fp16 models only (a bf16 checkpoint keeps it float32)."""
    tensors = saved_layer(qtype, dtype, seed=seed)
    x = (torch.randn(37, 64, generator=torch.Generator().manual_seed(seed + 1)) * 2).to(dtype)
    upstream = msmodelslim_layer(tensors, "l", qtype, dtype)(x[None])[0]  # it reads (batch, tokens, features)
    simulated = modelslim.SimLinear(tensors, "l", qtype)(x)
    assert simulated.dtype == upstream.dtype == dtype
    error = ((simulated.float() - upstream.float()).norm() / upstream.float().norm()).item()
    assert error < UPSTREAM_TOLERANCE[qtype, dtype], f"{error:.4f} relative to msModelSlim's own output"
