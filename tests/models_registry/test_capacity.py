"""models_registry.capacity: device table and the KV-cache budget, on hand-computed cases."""

import pytest

from models_registry.capacity import (
    GiB,
    default_overhead_bytes,
    device_memory_bytes,
    dtype_bytes,
    estimate_capacity,
    recommended_batch_cap,
)
from models_registry.inspection import inspect_path, kv_bytes_per_token

# Llama-2-7B: vocab 32000, hidden 4096, intermediate 11008, 32 layers, 32 heads (MHA), untied.
LLAMA2_7B_PARAMS = 2 * 32000 * 4096 + 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008 + 2 * 4096) + 4096
LLAMA2_7B_KV = 32 * 32 * 128 * 2 * 2  # fp16 cache


def test_llama2_7b_constants():
    assert LLAMA2_7B_PARAMS == 6_738_415_616
    assert 2 * LLAMA2_7B_PARAMS == 13_476_831_232  # "13.5 GB" of fp16 weights
    assert round(2 * LLAMA2_7B_PARAMS / 1e9, 1) == 13.5
    assert LLAMA2_7B_KV == 512 * 1024
    assert kv_bytes_per_token({"num_layers": 32, "num_kv_heads": 32, "head_dim": 128}, 2) == LLAMA2_7B_KV


@pytest.mark.parametrize(
    "name,gib",
    [
        ("910B4", 32),
        ("Ascend910B4", 32),
        ("ascend 910b4", 32),
        ("Ascend 910B4", 32),
        ("910ProB", 32),
        ("910PROB", 32),
        ("910B3", 64),
        ("Ascend910B3", 64),
        ("A3", 64),
        ("Ascend910_9391", 64),
        ("950DT", 96),
        ("310P3", 21),
        ("Ascend310P3", 21),
        ("910B", 32),
    ],
)
def test_device_memory_table(name, gib):
    assert device_memory_bytes(name) == gib * GiB


def test_device_memory_matches_npu_smi_hbm_mb():
    # npu-smi prints HBM in MB: 910B4 shows 32768 MB.
    assert device_memory_bytes("910B4") == 32768 * 1024 * 1024


def test_device_memory_unknown_and_reported():
    assert device_memory_bytes("NVIDIA H100 80GB HBM3") is None
    assert device_memory_bytes("NVIDIA H100 80GB HBM3", reported_bytes=80 * GiB) == 80 * GiB
    assert device_memory_bytes(None, reported_bytes=128 * GiB) == 128 * GiB  # a CPU host
    assert device_memory_bytes("") is None
    assert device_memory_bytes("910B4", reported_bytes=1) == 32 * GiB  # the table wins for known chips


def test_dtype_bytes():
    assert dtype_bytes("bfloat16") == 2 and dtype_bytes("torch.float16") == 2
    assert dtype_bytes("float32") == 4 and dtype_bytes("int8") == 1 and dtype_bytes("fp8") == 1
    assert dtype_bytes("W8A8") is None and dtype_bytes(None) is None


def test_7b_fp16_on_910b4():
    weights = 2 * LLAMA2_7B_PARAMS
    r = estimate_capacity(
        weight_bytes=weights,
        kv_bytes_per_token=LLAMA2_7B_KV,
        device_memory_bytes=device_memory_bytes("910B4"),
        max_position_embeddings=4096,
        param_count=LLAMA2_7B_PARAMS,
    )
    usable = int(32 * GiB * 0.9)
    overhead = int(1 * GiB + 0.05 * weights)
    budget = usable - weights - overhead
    assert r["usable_bytes"] == usable == 30_923_764_531
    assert r["overhead_bytes"] == overhead == 1_747_583_385
    assert r["kv_budget_bytes"] == budget == 15_699_349_914
    assert r["kv_tokens"] == budget // (LLAMA2_7B_KV * 128) * 128 == 233 * 128 == 29_824
    assert r["max_model_len"] == 4096  # capped at max_position_embeddings
    assert r["context_len"] == 4096  # min(8192, 4096)
    assert r["max_num_seqs"] == 29_824 // 4096 == 7
    assert r["batch_cap"] == 16
    assert r["recommended_max_num_seqs"] == 7  # the KV cache, not the cap, limits here
    assert r["fits"] is True
    assert r["weight_bytes"] == weights and r["kv_bytes_per_token"] == LLAMA2_7B_KV
    assert r["summary"].startswith("Fits:") and "max_model_len 4096" in r["summary"]

    # shorter sequences: the guide's cap of 16 per device applies
    r = estimate_capacity(
        weight_bytes=weights,
        kv_bytes_per_token=LLAMA2_7B_KV,
        device_memory_bytes=32 * GiB,
        max_position_embeddings=4096,
        context_len=1024,
        param_count=LLAMA2_7B_PARAMS,
    )
    assert r["max_num_seqs"] == 29 and r["recommended_max_num_seqs"] == 16

    # a longer-context 7B on a 64 GiB 910B3: max_model_len limited by memory, cap 16
    r = estimate_capacity(
        weight_bytes=weights,
        kv_bytes_per_token=LLAMA2_7B_KV,
        device_memory_bytes=device_memory_bytes("910B3"),
        max_position_embeddings=131072,
        param_count=LLAMA2_7B_PARAMS,
    )
    budget = int(64 * GiB * 0.9) - weights - overhead
    assert r["kv_tokens"] == budget // (LLAMA2_7B_KV * 128) * 128
    assert r["max_model_len"] == r["kv_tokens"] < 131072
    assert r["context_len"] == 8192
    assert r["max_num_seqs"] == r["kv_tokens"] // 8192
    assert r["recommended_max_num_seqs"] == min(16, r["max_num_seqs"])


def test_batch_cap_generalisation():
    assert recommended_batch_cap(7e9) == 16
    assert recommended_batch_cap(70e9) == 16
    assert recommended_batch_cap(70e9, num_devices=8) == 128
    assert recommended_batch_cap(3.5e9) == 32
    assert recommended_batch_cap(1e9) == 112
    assert recommended_batch_cap(1e6) == 256  # at most vLLM's default
    assert recommended_batch_cap(1e9, num_devices=4) == 256
    assert recommended_batch_cap(None) == 16


def test_param_count_defaults_to_16_bit_guess():
    r = estimate_capacity(
        weight_bytes=2 * 1_000_000_000,
        kv_bytes_per_token=1024,
        device_memory_bytes=32 * GiB,
        max_position_embeddings=2048,
        context_len=64,
    )
    assert r["batch_cap"] == 112  # 1e9 params guessed from 2e9 bytes
    assert r["recommended_max_num_seqs"] == 112


def test_does_not_fit():
    weights = 140 * 10**9  # a 70B in fp16
    r = estimate_capacity(
        weight_bytes=weights,
        kv_bytes_per_token=320 * 1024,
        device_memory_bytes=device_memory_bytes("910B4"),
        max_position_embeddings=8192,
    )
    assert r["fits"] is False
    assert r["kv_budget_bytes"] < 0
    assert r["kv_tokens"] == 0 and r["max_model_len"] == 0 and r["max_num_seqs"] == 0
    assert r["recommended_max_num_seqs"] is None
    assert r["summary"].startswith("Does not fit")

    r = estimate_capacity(
        weight_bytes=weights,
        kv_bytes_per_token=320 * 1024,
        device_memory_bytes=device_memory_bytes("910B3"),
        num_devices=8,
        max_position_embeddings=8192,
        param_count=70 * 10**9,
    )
    assert r["fits"] is True
    assert r["overhead_bytes"] == int(8 * GiB + 0.05 * weights)
    assert r["usable_bytes"] == int(8 * 64 * GiB * 0.9)
    assert r["batch_cap"] == 128
    assert r["recommended_max_num_seqs"] == min(128, r["max_num_seqs"])


def test_weights_fit_but_not_one_context():
    # room for 10 blocks of 128 tokens = 1280 tokens, asked for 2048
    kv = 1000
    weights = 10 * GiB
    overhead = 0
    device = int((weights + 10 * 128 * kv + 500) / 0.5) + 2
    r = estimate_capacity(
        weight_bytes=weights,
        kv_bytes_per_token=kv,
        device_memory_bytes=device,
        memory_utilization=0.5,
        max_position_embeddings=4096,
        context_len=2048,
        activation_overhead_bytes=overhead,
    )
    assert r["kv_tokens"] == 1280
    assert r["max_model_len"] == 1280
    assert r["max_num_seqs"] == 0
    assert r["fits"] is False and r["recommended_max_num_seqs"] is None
    assert "Does not fit at 2048 tokens" in r["summary"]


def test_explicit_overhead_block_size_and_no_max_positions():
    r = estimate_capacity(
        weight_bytes=GiB,
        kv_bytes_per_token=1024,
        device_memory_bytes=4 * GiB,
        memory_utilization=1.0,
        max_position_embeddings=None,
        activation_overhead_bytes=GiB,
        block_size=1,
    )
    assert r["kv_budget_bytes"] == 2 * GiB
    assert r["kv_tokens"] == r["max_model_len"] == 2 * GiB // 1024
    assert r["context_len"] == 8192


def test_default_overhead():
    assert default_overhead_bytes(0) == GiB
    assert default_overhead_bytes(10 * GiB, num_devices=2) == 2 * GiB + GiB // 2


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"kv_bytes_per_token": 0}, "kv_bytes_per_token must be positive"),
        ({"device_memory_bytes": 0}, "device_memory_bytes must be positive"),
        ({"num_devices": 0}, "num_devices must be at least 1"),
        ({"memory_utilization": 0}, r"memory_utilization must be in \(0, 1\]"),
        ({"memory_utilization": 1.5}, r"memory_utilization must be in \(0, 1\]"),
        ({"weight_bytes": -1}, "weight_bytes must be a non-negative number of bytes"),
        ({"context_len": 0}, "context_len must be at least 1"),
    ],
)
def test_validation(kwargs, message):
    base = {
        "weight_bytes": GiB,
        "kv_bytes_per_token": 1024,
        "device_memory_bytes": 32 * GiB,
        "max_position_embeddings": 4096,
    }
    with pytest.raises(ValueError, match=message):
        estimate_capacity(**{**base, **kwargs})


def test_from_tiny_model_inspection(tmp_path):
    from tests.support.tiny_models import build_tiny_llama_hf

    info = inspect_path(build_tiny_llama_hf(tmp_path / "m", with_tokenizer=False))
    r = estimate_capacity(
        weight_bytes=info["weight_bytes"],
        kv_bytes_per_token=kv_bytes_per_token(info, 2),
        device_memory_bytes=device_memory_bytes("310P3"),
        max_position_embeddings=info["max_position_embeddings"],
        param_count=info["param_count"],
    )
    assert r["fits"] is True
    assert r["max_model_len"] == 2048 and r["context_len"] == 2048
    assert r["recommended_max_num_seqs"] == 256
