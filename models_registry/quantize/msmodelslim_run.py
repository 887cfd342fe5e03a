"""Ascend ModelSlim checkpoints with Huawei's own msModelSlim (PyPI ``msmodelslim``), on the CPU.

The legacy post-training API (verified with msmodelslim 26.1.0, torch CPU, transformers 5, no torch_npu):
``AntiOutlier(...).process()`` (optional), ``Calibrator(model, QuantConfig(..., dev_type="cpu"))``,
``run()``, ``save()``. What it needs around it here:
* tied embeddings: save() refuses tensors sharing memory, so lm_head gets its own copy first;
* Calibrator() writes ``features.npy`` into the working directory: it runs in a scratch directory
  (a process-wide chdir; quantize jobs run one per work horse);
* transformers 5 leaves ``config.torch_dtype`` unset, which makes save() pack deq_scale the fp16 way
  for every model; the serving dtype is set on the calibrator before save();
* msModelSlim has no KL-divergence calibration in this API (act_method 1 min-max, 2 histogram,
  3 automatic), so for method "kl" our observer (kl.py) is plugged into its quantizers and
  msModelSlim derives quant_bias and deq_scale from the scales it gives;
* input and weight scales are rounded to the serving dtype before save(): vllm-ascend loads them in
  the model's dtype, and the int8 weights, deq_scale and quant_bias must be computed from the values
  it will use (the simulation that measures perplexity then runs exactly what vllm-ascend will).
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile

from models_registry.quantize.kl import KLObserver
from models_registry.quantize.modelslim import DESCRIPTION, SCHEME_TYPE, WEIGHT_FILE

ACT_METHOD = {"minmax": 1, "histogram": 2, "auto": 3, "kl": 1}
ANTI_OUTLIER = {
    "m1": "SmoothQuant",
    "m2": "outlier suppression",
    "m3": "AWQ-like (weight-aware)",
    "m4": "iterative smoothing",
    "m5": "SmoothQuant (fast)",
    "m6": "flex smoothing",
}


@contextlib.contextmanager
def _chdir(path):
    old = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


def _untie_lm_head(model) -> None:
    import torch

    lm, emb = getattr(model, "lm_head", None), model.get_input_embeddings()
    if lm is not None and emb is not None and lm.weight.data_ptr() == emb.weight.data_ptr():
        lm.weight = torch.nn.Parameter(lm.weight.detach().clone(), requires_grad=False)


class KLAdapter:
    """Our KL observer in the place of msModelSlim's activation observer (the legacy quantizer calls
    update(x) per calibration batch and get_min_max() for its fake quantisation while calibrating)."""

    def __init__(self):
        self.kl = KLObserver()
        self.lo = self.hi = None

    def update(self, x):
        import torch

        x = x.detach().float()
        self.kl.observe(x.reshape(-1).numpy())
        lo, hi = x.min(), x.max()
        self.lo = lo if self.lo is None else torch.minimum(self.lo, lo)
        self.hi = hi if self.hi is None else torch.maximum(self.hi, hi)

    def get_min_max(self, device):
        return self.lo.to(device), self.hi.to(device)

    def reset_observer(self):
        pass

    def set_ratio(self, ratio=0.9):
        pass


def quantize(
    model,
    calib_ids: list[list[int]],
    out_dir,
    *,
    scheme: str,
    method: str,
    anti_outlier: str | None,
    float_layers: list[str],
    serve_dtype,
    minmax_layers: list[str] = (),
) -> dict:
    """Quantize ``model`` (float32, modified in place) with msModelSlim and save its checkpoint
    (quant_model_description.json + quant_model_weight_<type>.safetensors) into out_dir."""
    import torch
    from msmodelslim import logger as ms_logger
    from msmodelslim.pytorch.llm_ptq.anti_outlier import AntiOutlier, AntiOutlierConfig
    from msmodelslim.pytorch.llm_ptq.llm_ptq_tools import Calibrator, QuantConfig
    from msmodelslim.pytorch.llm_ptq.llm_ptq_tools.quant_funcs import linear_quantization_params
    from msmodelslim.pytorch.llm_ptq.llm_ptq_tools.quant_modules import LinearQuantizer

    ms_logger.setLevel(logging.WARNING)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    _untie_lm_head(model)
    if not getattr(model.config, "architectures", None):
        model.config.architectures = [type(model).__name__]
    calib = [[torch.tensor([ids], dtype=torch.long)] for ids in calib_ids]
    static = scheme == "w8a8_static"
    if anti_outlier:
        AntiOutlier(
            model,
            calib_data=calib,
            cfg=AntiOutlierConfig(
                w_bit=8, a_bit=16 if scheme == "w8a16" else 8, anti_method=anti_outlier, dev_type="cpu", w_sym=True
            ),
        ).process()
    common = {"disable_names": list(float_layers), "dev_type": "cpu", "pr": 1.0, "mm_tensor": False, "w_sym": True}
    if scheme == "w8a16":
        cfg = QuantConfig(w_bit=8, a_bit=16, **common)
    else:
        cfg = QuantConfig(w_bit=8, a_bit=8, act_method=ACT_METHOD[method], is_dynamic=not static, **common)
    # Its working directory (msModelSlim writes there) inside the output's folder, the job's staging: on the
    # artifact store's disk, not /tmp, and removed with the staging by a failed or killed job's cleanup.
    with tempfile.TemporaryDirectory(prefix=".msmodelslim-", dir=out_dir) as scratch, _chdir(scratch):
        calibrator = Calibrator(model, cfg, calib_data=calib, disable_level="L0")
    quantizers = {n: m for n, m in calibrator.model.named_modules() if isinstance(m, LinearQuantizer)}
    if static and method == "kl":
        for mod in quantizers.values():
            mod.quant_input.observer = KLAdapter()
    calibrator.run()
    for mod in quantizers.values():
        # vllm-ascend loads weight_scale in the model's dtype: quantize the weights against that value
        # (save() divides by it), not against a float32 scale it never sees.
        qw = mod.quant_weight
        if qw.weight_scale is not None and qw.weight_scale.is_floating_point():
            qw.weight_scale = qw.weight_scale.to(serve_dtype).float()
    if static:
        for name, mod in quantizers.items():
            qi = mod.quant_input
            if method == "kl" and isinstance(qi.observer, KLAdapter) and qi.observer.lo is not None:
                if name in minmax_layers:  # KL clipping would cost this layer more (see quantize/jobs.py)
                    lo, hi = qi.observer.lo.reshape(()), qi.observer.hi.reshape(())
                else:
                    t = qi.observer.kl.threshold()  # symmetric clipping range [-t, t]
                    lo, hi = torch.tensor(-t), torch.tensor(t)
                scale, offset = linear_quantization_params(8, lo, hi, q_signed=True, sym=False)
                qi.input_scale, qi.input_offset = scale.reshape(1).float(), offset.reshape(1).float()
            if qi.input_scale is not None:
                qi.input_scale = qi.input_scale.reshape(1).to(serve_dtype).float()
    qtype = SCHEME_TYPE[scheme]
    calibrator.model_torch_dtype = serve_dtype
    calibrator.save(str(out_dir), safetensors_name=WEIGHT_FILE[qtype], json_name=DESCRIPTION, save_type=["ascendV1"])
    for name in os.listdir(out_dir):  # msModelSlim leaves its files 0400 / 0600
        if not os.path.islink(os.path.join(out_dir, name)):  # chmod would change a link's target
            os.chmod(os.path.join(out_dir, name), 0o644)
    return {"quantized": sorted(quantizers), "float_layers": sorted(float_layers)}
