"""vllm-ascend v0.23.0's own quantization files (vendored in tests/fixtures/vllm_ascend_quant/, SOURCES.md there),
run on this machine's CPU: what they import and this machine cannot have is stood in for here, nothing else.

What cannot be here: torch_npu and the NPU (its kernels), and the serving stack around the scheme files (vLLM and
the rest of vllm-ascend: configs, communication groups, streams, MoE routing), which needs torch_npu to import.

* ``torch_npu``: the kernels the Linear schemes call, written in plain torch from CANN's documented formulas
  (aclnnAscendQuantV3, aclnnDynamicQuant, aclnnQuantMatmulV4, aclnnWeightQuantBatchMatmulV2, below); the int8
  products are accumulated exactly in int64, as the kernels' int32 accumulators do for these sizes.
* ``vllm_ascend.utils``: the names the files import, each with what it does at v0.23.0 for a ModelSlim Linear on
  one card with the default configuration (comments at each).
* ``vllm.utils.torch_utils.direct_register_custom_op``: records upstream's registrations (register_custom_ops.py
  runs unchanged); :func:`vllm_custom_ops` registers the recorded ``quantize`` op with torch.library as vLLM's own
  function does, on the CPU dispatch key instead of PrivateUse1 (the NPU), and removes it afterwards.
* Every other imported name (MoE routing, communication, configs, logger, streams) is a :class:`NotRun`: these
  tests do not reach it, and using one fails the test instead of computing something.

Upstream's Python runs as written: the registry and base classes, the schemes' ``get_weight`` /
``get_pertensor_param`` / ``get_perchannel_param``, ``process_weights_after_loading`` and ``apply``, and
register_custom_ops.py's ``_quantize_impl`` behind ``torch.ops.vllm.quantize``. The modules are loaded with
importlib under their upstream names, with the stand-ins in ``sys.modules`` only while they load (the loaded
modules keep their references); the process's ``sys.modules`` is as it was afterwards.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import sys
import types

import numpy as np
import torch
from torch.library import Library, infer_schema

from tests.support import FIXTURES

VENDORED = FIXTURES / "vllm_ascend_quant"

# Vendored file -> its upstream module (vllm_ascend/<...>.py at v0.23.0), in the order they load (imports first).
MODULES = {
    "quant_type.py": "vllm_ascend.quantization.quant_type",
    "registry.py": "vllm_ascend.quantization.methods.registry",
    "base.py": "vllm_ascend.quantization.methods.base",
    "w8a8_static.py": "vllm_ascend.quantization.methods.w8a8_static",
    "w8a8_dynamic.py": "vllm_ascend.quantization.methods.w8a8_dynamic",
    "w8a16.py": "vllm_ascend.quantization.methods.w8a16",
    "register_custom_ops.py": "vllm_ascend.ops.register_custom_ops",
}


def git_blob_id(data: bytes) -> str:
    """What `git hash-object` prints for a file with these bytes (and `git rev-parse <tag>:<path>` upstream)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


# --- torch_npu kernels, from their documented formulas --------------------------------------------


def npu_quantize(input, scales, zero_points=None, dtype=torch.qint8, axis=1, div_mode=True):
    """torch_npu.npu_quantize (aclnnAscendQuantV3): div_mode=False: y = round(x·scales + zero_points), the
    documented formula; register_custom_ops.py's _quantize_impl passes input_scale's reciprocal as scales,
    axis -1 (scales and zero_points per element of the last axis) and torch.qint8 (an int8 result). Computed in
    float32, rounded half to even (the kernel's rint cast), saturated to int8."""
    assert dtype == torch.qint8 and axis in (-1, input.dim() - 1), "only the per-last-axis int8 case is written"
    y = input.float() / scales.float() if div_mode else input.float() * scales.float()
    if zero_points is not None:
        y = y + zero_points.float()
    return torch.clamp(torch.round(y), -128, 127).to(torch.int8)


def npu_dynamic_quant(x, *, smooth_scales=None, group_index=None, dst_type=None):
    """torch_npu.npu_dynamic_quant (aclnnDynamicQuant), int8 without smoothing: per token (last axis)
    scale = rowMax(|x|) / 127 (float32, x's shape without the last axis), y = round(x / scale) in int8."""
    assert smooth_scales is None and group_index is None and dst_type in (None, torch.int8)
    scale = x.float().abs().amax(dim=-1) / 127.0
    return torch.clamp(torch.round(x.float() / scale[..., None]), -128, 127).to(torch.int8), scale


def _float_scale(scale):
    """A quant matmul's scale as floats: an int64 scale (fp16 models: w8a8_static.py get_perchannel_param creates
    deq_scale int64) holds the float32 bits in its low 32 bits, as npu_trans_quant_param packs them."""
    if scale.dtype == torch.int64:
        return torch.from_numpy(scale.numpy().astype(np.int32).view(np.float32).copy())
    return scale.float()


def npu_quant_matmul(x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None, output_dtype=None):
    """torch_npu.npu_quant_matmul (aclnnQuantMatmulV4): (x1 · x2 [+ int32 bias]) · scale [· pertoken_scale]
    [+ float bias], cast to output_dtype. The int8 products are summed exactly (int64 here, int32 there), the
    scaling in float64 (the kernel scales in float32: the two differ below the output dtype's last place)."""
    assert offset is None and output_dtype in (torch.bfloat16, torch.float16)
    acc = x1.to(torch.int64) @ x2.to(torch.int64)
    if bias is not None and bias.dtype == torch.int32:
        acc = acc + bias.to(torch.int64)
        bias = None
    out = acc.double() * _float_scale(scale).double()
    if pertoken_scale is not None:
        out = out * pertoken_scale.double()[..., None]
    if bias is not None:
        out = out + bias.double()
    return out.to(output_dtype)


def npu_weight_quant_batchmatmul(
    x,
    weight,
    antiquant_scale,
    antiquant_offset=None,
    quant_scale=None,
    quant_offset=None,
    bias=None,
    antiquant_group_size=0,
    inner_precise=0,
):
    """torch_npu.npu_weight_quant_batchmatmul (aclnnWeightQuantBatchMatmulV2), per channel without output
    quantization: x · ((weight + antiquant_offset) · antiquant_scale) + bias, in x's dtype."""
    assert quant_scale is None and quant_offset is None and antiquant_group_size == 0
    w = weight.double()
    if antiquant_offset is not None:
        w = w + antiquant_offset.double()
    out = x.double() @ (w * antiquant_scale.double())
    if bias is not None:
        out = out + bias.double()
    return out.to(x.dtype)


def npu_format_cast(input, acl_format):
    """torch_npu.npu_format_cast(weight, ACL_FORMAT_FRACTAL_NZ): NZ is a storage layout (the weight tiled into
    fractals for the cube unit) that npu_quant_matmul / npu_weight_quant_batchmatmul read as the same logical
    matrix; the values do not change, and a CPU tensor has only the one (ND) layout."""
    return input


# --- names upstream imports that these tests do not run -------------------------------------------------


class NotRun:
    """A name upstream imports for code outside the dense Linear path (MoE routing, communication, configs,
    streams, graph fusion): these tests never reach it, and using it fails instead of computing something."""

    def __init__(self, name: str):
        self.__dict__["_name"] = name

    def __getattr__(self, attr):
        raise RuntimeError(f"{self._name}.{attr}: stood in for, not run by these tests")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name}(): stood in for, not run by these tests")


class NoPrefetch:
    """vllm_ascend.ops.weight_prefetch.WeightPrefetchMethod with the default configuration
    (weight_prefetch_config "enabled" False, ascend_config.py WeightPrefetchConfig): its attention methods return
    at once (`if not self.attn.enable ...: return`). Enabled, they only start copying the weight into the cache
    (npu_prefetch) on another stream: no value changes either way."""

    def maybe_prefetch_attn_weight_preprocess(self, layer_cls_name, weight, start_flag):
        return None

    def maybe_prefetch_attn_weight_postprocess(self, layer_cls_name, stop_flag):
        return None


_PREFETCH = NoPrefetch()


def get_weight_prefetch_method():
    """vllm_ascend.utils.get_weight_prefetch_method: the process's WeightPrefetchMethod, which the model runner
    creates (set_weight_prefetch_method, worker/model_runner_v1.py) before any forward."""
    return _PREFETCH


def maybe_trans_nz(weight):
    """vllm_ascend.utils.maybe_trans_nz: torch_npu.npu_format_cast(weight, ACL_FORMAT_FRACTAL_NZ) unless
    _should_trans_nz says no: float32 and meta tensors never, bf16/fp16 only with weight_nz_mode 2 (default 1,
    VLLM_ASCEND_ENABLE_NZ), other dtypes (the int8 weights here) yes. The cast leaves the values (above)."""
    if weight.dtype == torch.float32 or weight.is_meta or weight.dtype in (torch.bfloat16, torch.float16):
        return weight
    return npu_format_cast(weight, ACL_FORMAT_FRACTAL_NZ)


def enable_dsa_cp():
    """vllm_ascend.utils.enable_dsa_cp: False for a model without an indexer (`index_topk`: DeepSeek V3.2/V4
    only), which every model these tests build is."""
    return False


COMPRESSED_TENSORS_METHOD = "compressed-tensors"  # vllm_ascend/utils.py line 50 at v0.23.0
ACL_FORMAT_FRACTAL_NZ = 29  # vllm_ascend/utils.py line 56 at v0.23.0

_CUSTOM_OPS: dict[str, dict] = {}


def direct_register_custom_op(
    op_name, op_func, mutates_args=None, fake_impl=None, target_lib=None, dispatch_key=None, tags=()
):
    """vllm.utils.torch_utils.direct_register_custom_op, recording: register_custom_ops.py calls it for each of
    its ops at import; :func:`vllm_custom_ops` registers the ones a test needs, for as long as it needs them."""
    _CUSTOM_OPS[op_name] = {
        "op_func": op_func,
        "mutates_args": list(mutates_args or []),
        "fake_impl": fake_impl,
        "dispatch_key": dispatch_key,
        "tags": tags,
    }


def _module(name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__path__ = []  # a package too: its submodules are in sys.modules
    module.__dict__.update(attrs)
    return module


def _not_run(module: str, *names: str) -> dict:
    return {n: NotRun(f"{module}.{n}") for n in names}


def _standins() -> dict[str, types.ModuleType]:
    torch_npu = _module(
        "torch_npu",
        npu_quantize=npu_quantize,
        npu_dynamic_quant=npu_dynamic_quant,
        npu_quant_matmul=npu_quant_matmul,
        npu_weight_quant_batchmatmul=npu_weight_quant_batchmatmul,
        npu_format_cast=npu_format_cast,
        npu=NotRun("torch_npu.npu"),  # streams (prefetch ops, MoE): not on the Linear path
    )
    utils = _module(
        "vllm_ascend.utils",
        COMPRESSED_TENSORS_METHOD=COMPRESSED_TENSORS_METHOD,
        ACL_FORMAT_FRACTAL_NZ=ACL_FORMAT_FRACTAL_NZ,
        get_weight_prefetch_method=get_weight_prefetch_method,
        maybe_trans_nz=maybe_trans_nz,
        enable_dsa_cp=enable_dsa_cp,
        **_not_run("vllm_ascend.utils", "enable_sp_by_pass", "is_vl_model", "npu_stream_switch", "prefetch_stream"),
    )
    specs = {
        "vllm": {},
        "vllm.config": _not_run("vllm.config", "CompilationMode", "get_current_vllm_config"),
        "vllm.logger": _not_run("vllm.logger", "logger"),
        "vllm.distributed": _not_run(
            "vllm.distributed",
            "get_dp_group",
            "get_ep_group",
            "get_tensor_model_parallel_rank",
            "get_tensor_model_parallel_world_size",
            "tensor_model_parallel_all_gather",
            "tensor_model_parallel_all_reduce",
            "tensor_model_parallel_reduce_scatter",
        ),
        "vllm.forward_context": _not_run("vllm.forward_context", "get_forward_context"),
        "vllm.utils": {},
        "vllm.utils.torch_utils": {"direct_register_custom_op": direct_register_custom_op},
        "vllm_ascend": {},
        "vllm_ascend.quantization": {},  # upstream's __init__ imports nothing eagerly either
        "vllm_ascend.quantization.methods": {},  # upstream's __init__ imports every scheme: only three here
        "vllm_ascend.ascend_config": _not_run("vllm_ascend.ascend_config", "get_ascend_config"),
        "vllm_ascend.ascend_forward_context": _not_run(
            "vllm_ascend.ascend_forward_context", "_EXTRA_CTX", "MoECommType"
        ),
        "vllm_ascend.distributed": {},
        "vllm_ascend.distributed.parallel_state": _not_run("vllm_ascend.distributed.parallel_state", "get_mc2_group"),
        "vllm_ascend.flash_common3_context": _not_run("vllm_ascend.flash_common3_context", "get_flash_common3_context"),
        "vllm_ascend.ops": {},
        "vllm_ascend.ops.fused_moe": {},
        "vllm_ascend.ops.fused_moe.experts_selector": _not_run(
            "vllm_ascend.ops.fused_moe.experts_selector", "select_experts", "zero_experts_compute"
        ),
        "vllm_ascend.ops.fused_moe.moe_runtime_args": _not_run(
            "vllm_ascend.ops.fused_moe.moe_runtime_args", "build_fused_experts_input"
        ),
        "vllm_ascend.ops.rotary_embedding": _not_run("vllm_ascend.ops.rotary_embedding", "rope_forward_oot"),
        "vllm_ascend.ops.triton": {},
        "vllm_ascend.ops.triton.muls_add": _not_run("vllm_ascend.ops.triton.muls_add", "muls_add_triton"),
        "vllm_ascend.ops.weight_prefetch": _not_run("vllm_ascend.ops.weight_prefetch", "maybe_npu_prefetch"),
    }
    modules = {name: _module(name, **attrs) for name, attrs in specs.items()}
    modules.update({"torch_npu": torch_npu, "vllm_ascend.utils": utils})
    return modules


@contextlib.contextmanager
def _in_sys_modules(modules: dict):
    """The given modules in sys.modules for the duration; afterwards sys.modules has exactly the names it had
    before, each bound as before (a module upstream's imports bring in for the first time stays: real code)."""
    before = {name: sys.modules[name] for name in modules if name in sys.modules}
    sys.modules.update(modules)
    try:
        yield
    finally:
        for name in modules:
            sys.modules.pop(name, None)
        sys.modules.update(before)


@functools.cache
def load_upstream() -> types.SimpleNamespace:
    """Upstream's modules, loaded once per process from the vendored files under their upstream names."""
    modules = _standins()
    loaded = {}
    with _in_sys_modules(modules):
        for filename, name in MODULES.items():
            spec = importlib.util.spec_from_file_location(name, VENDORED / filename)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = modules[name] = module
            spec.loader.exec_module(module)
            loaded[name.rsplit(".", 1)[1]] = module
    return types.SimpleNamespace(**loaded, custom_ops=dict(_CUSTOM_OPS))


@contextlib.contextmanager
def vllm_custom_ops(*names: str):
    """Upstream's custom ops (register_custom_ops.py), e.g. ``quantize``, in torch.ops.vllm for the duration,
    registered as vLLM's direct_register_custom_op does (schema inferred from the function, impl, fake impl) on
    the CPU dispatch key (upstream: PrivateUse1, the NPU), in a library that is destroyed afterwards. Refuses to
    shadow an op of that name that something else registered."""
    ops = load_upstream().custom_ops
    taken = [n for n in names if hasattr(torch.ops.vllm, n)]
    if taken:
        raise RuntimeError(f"torch.ops.vllm already has {taken}: not registering upstream's over them")
    lib = Library("vllm", "FRAGMENT")
    try:
        for name in names:
            op = ops[name]
            lib.define(name + infer_schema(op["op_func"], mutates_args=op["mutates_args"]), tags=op["tags"])
            lib.impl(name, op["op_func"], dispatch_key="CPU")
            if op["fake_impl"] is not None:
                lib._register_fake(name, op["fake_impl"])
        yield
    finally:
        lib._destroy()
