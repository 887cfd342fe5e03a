"""models_registry.capacity_moe: MoE / MLA parameter counts, quantized bytes, TP / DP / EP sharding, and the
hardware statements of vllm-ascend v0.23.0's model tutorials (docs/source/tutorials/models/*.md at tag v0.23.0,
commit 5cb98caaadeff42b5b62b996e34bb2aaa29d20fd).  Model configs: tests/fixtures/model_configs (SOURCES.md)."""

import json
import math

import pytest

from models_registry.capacity import GiB, default_overhead_bytes
from models_registry.capacity_moe import (
    LINEAR_BYTES,
    deployment_capacity,
    kv_bytes_per_token_from_config,
    model_shape,
    param_breakdown,
    weight_bytes_for_scheme,
    weights_per_device,
)
from models_registry.inspection import kv_bytes_per_token
from tests.support import FIXTURES


def config(name: str) -> dict:
    return json.loads((FIXTURES / "model_configs" / f"{name}.config.json").read_text(encoding="utf-8"))


DEEPSEEK_R1 = config("DeepSeek-R1")
QWEN3_235B = config("Qwen3-235B-A22B")
QWEN3_30B = config("Qwen3-30B-A3B")
QWEN3_32B = config("Qwen3-32B")

# Atlas 800 A2: 8 x 910B with 64 GB (npu-smi: 65536 MB) each; Atlas 800 A3: 16 dies of 64 GB.
A2_64 = {"device_memory_gib": 64, "devices_per_node": 8}
A2_32 = {"device_memory_gib": 32, "devices_per_node": 8}
A3 = {"device_memory_gib": 64, "devices_per_node": 16}


# --------------------------------------------------------------------------------------------
# parameter counts against the published totals
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cfg,total,active",
    [
        # DeepSeek-R1's README, ### DeepSeek-R1 Models: "| DeepSeek-R1   | 671B | 37B |  128K   |" (#Total Params,
        # #Activated Params); the 671B leave out the MTP module, as param_count does (DeepSeek-V3's README: "The total
        # size of DeepSeek-V3 models on HuggingFace is 685B, which includes 671B of the Main Model weights and 14B of
        # the Multi-Token Prediction (MTP) Module weights.").
        (DEEPSEEK_R1, 671e9, 37e9),
        # Qwen3-235B-A22B.md, ## 1 Introduction: "featuring 235B total parameters with 22B activated per token."
        (QWEN3_235B, 235e9, 22e9),
        # Qwen3-30B-A3B.md, ## 1 Introduction: "featuring 30.5B total parameters with 3.3B activated per token."
        (QWEN3_30B, 30.5e9, 3.3e9),
        # Qwen3-32B model card: "Number of Parameters: 32.8B" (dense: everything is active).
        (QWEN3_32B, 32.8e9, 32.8e9),
    ],
    ids=["DeepSeek-R1", "Qwen3-235B-A22B", "Qwen3-30B-A3B", "Qwen3-32B"],
)
def test_param_counts_match_published(cfg, total, active):
    b = param_breakdown(cfg)
    assert b["param_count"] == pytest.approx(total, rel=0.03)
    assert b["active_param_count"] == pytest.approx(active, rel=0.03)
    assert b["param_count"] == sum(b["by_kind"].values())


def test_deepseek_breakdown_by_hand():
    b = param_breakdown(DEEPSEEK_R1)
    assert (b["num_moe_layers"], b["num_dense_layers"], b["num_mtp_layers"]) == (58, 3, 1)  # first_k_dense_replace 3
    assert b["is_moe"] and b["is_mla"] and b["num_experts"] == 256 and b["experts_per_token"] == 8
    expert = 3 * 7168 * 2048
    assert b["by_kind"]["routed_experts"] == 58 * 256 * expert
    assert b["by_kind"]["shared_experts"] == 58 * 1 * expert
    assert b["by_kind"]["dense_mlp"] == 3 * 3 * 7168 * 18432
    assert b["by_kind"]["embedding"] == b["by_kind"]["lm_head"] == 129280 * 7168  # untied
    mla = 1536 * 128 * (128 + 64) + 512 * 128 * (128 + 128) + 128 * 128 * 7168  # q_b, kv_b, o
    assert b["by_kind"]["attention"] == 61 * mla
    assert b["by_kind"]["replicated_linear"] == 61 * (7168 * 1536 + 7168 * (512 + 64))  # q_a, kv_a_with_mqa
    assert b["param_count"] - b["active_param_count"] == 58 * (256 - 8) * expert
    # DeepSeek-V3's README_WEIGHTS.md (vendored in tenstorrent/tt-metal models/demos/deepseek_v3/reference/):
    # main model "Activation parameters: **36.6B** (including 0.9B for the output Head)" -- all but the input
    # embedding, which active_param_count counts too; MTP "Parameters: **11.5B unique parameters** (excluding the
    # shared 0.9B Embedding and 0.9B output Head)".
    assert b["active_param_count"] - b["by_kind"]["embedding"] == pytest.approx(36.6e9, rel=0.01)
    assert b["mtp_param_count"] == pytest.approx(11.5e9, rel=0.02)


def test_qwen_moe_and_dense_shapes():
    b = param_breakdown(QWEN3_235B)
    assert (b["num_moe_layers"], b["num_dense_layers"], b["num_mtp_layers"]) == (94, 0, 0)
    assert b["by_kind"]["shared_experts"] == 0 and b["by_kind"]["dense_mlp"] == 0
    assert b["by_kind"]["router"] == 94 * 4096 * 128
    d = param_breakdown(QWEN3_32B)
    assert not d["is_moe"] and not d["is_mla"] and d["param_count"] == d["active_param_count"]
    assert d["by_kind"]["attention_kv"] == 64 * 2 * 5120 * 8 * 128


def test_mixtral_style_and_sparse_step_and_text_config():
    # Mixtral: num_local_experts, experts as wide as intermediate_size, every layer MoE, GQA.
    mix = {
        "hidden_size": 8,
        "num_hidden_layers": 2,
        "vocab_size": 10,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "intermediate_size": 16,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "tie_word_embeddings": True,
    }
    b = param_breakdown({"model_type": "llava", "text_config": mix})  # the language model's shape
    per_layer = 2 * 8 * 8 + 2 * 8 * 4 + 4 * 3 * 8 * 16 + 8 * 4 + 2 * 8  # q+o, k+v, experts, router, norms
    assert b["param_count"] == 10 * 8 + 2 * per_layer + 8  # tied: no lm_head; + final norm
    assert b["active_param_count"] == b["param_count"] - 2 * 2 * 3 * 8 * 16
    # Qwen2-MoE style: decoder_sparse_step 2 -> layers 1, 3 are MoE; mlp_only_layers forces layer 3 dense.
    sparse = {**mix, "num_hidden_layers": 4, "decoder_sparse_step": 2, "mlp_only_layers": [3], "num_experts": 4}
    assert model_shape(sparse)["moe_layer_flags"] == [False, True, False, False]
    with pytest.raises(ValueError, match="hidden"):
        param_breakdown({"num_hidden_layers": 2, "vocab_size": 10, "num_attention_heads": 2})


# --------------------------------------------------------------------------------------------
# bytes per scheme and per device
# --------------------------------------------------------------------------------------------


def test_weight_bytes_per_scheme():
    b = param_breakdown(QWEN3_32B)["by_kind"]
    floats = b["embedding"] + b["lm_head"] + b["norms"] + b["router"]
    linear = sum(b.values()) - floats
    assert (
        weight_bytes_for_scheme(QWEN3_32B, "bf16")
        == weight_bytes_for_scheme(QWEN3_32B, "fp16")
        == 2 * (floats + linear)
    )
    # msModelSlim W8A8: linear weights int8, embedding / norms / lm_head stay bf16
    assert weight_bytes_for_scheme(QWEN3_32B, "w8a8") == 2 * floats + linear
    assert weight_bytes_for_scheme(QWEN3_32B, "W8A8_DYNAMIC") == weight_bytes_for_scheme(QWEN3_32B, "w8a8")
    assert (
        weight_bytes_for_scheme(QWEN3_32B, "w4a8")
        == weight_bytes_for_scheme(QWEN3_32B, "w4a4")
        == int(2 * floats + 0.5 * linear)
    )
    assert set(LINEAR_BYTES) == {"bf16", "fp16", "w8a8", "w8a8_dynamic", "w4a8", "w4a4"}
    with pytest.raises(ValueError, match="unknown quantization 'int3'"):
        weight_bytes_for_scheme(QWEN3_32B, "int3")
    mtp = param_breakdown(DEEPSEEK_R1)["mtp_param_count"]
    assert weight_bytes_for_scheme(DEEPSEEK_R1, "bf16", include_mtp=True) - weight_bytes_for_scheme(
        DEEPSEEK_R1, "bf16"
    ) == pytest.approx(2 * mtp, abs=2)


def test_expert_parallel_sharding():
    b = param_breakdown(DEEPSEEK_R1)["by_kind"]
    ep = weights_per_device(
        DEEPSEEK_R1, "w8a8", tensor_parallel_size=4, data_parallel_size=4, enable_expert_parallel=True
    )
    assert ep["expert_parallel_size"] == 16 and ep["experts_per_device"] == 16
    assert ep["by_kind"]["routed_experts"] == b["routed_experts"] // 16  # 16 whole experts, 1 byte each
    assert ep["by_kind"]["attention"] == b["attention"] // 4  # split by TP, replicated per DP rank
    assert ep["by_kind"]["replicated_linear"] == b["replicated_linear"]  # MLA down-projections: whole
    assert ep["by_kind"]["embedding"] == 2 * b["embedding"] // 4  # bf16, vocab-parallel
    assert ep["by_kind"]["router"] == 2 * b["router"]
    # without --enable-expert-parallel vLLM shards the experts over the flattened TP x DP group: same bytes
    flat = weights_per_device(DEEPSEEK_R1, "w8a8", tensor_parallel_size=4, data_parallel_size=4)
    assert flat["expert_parallel_size"] == 1 and flat["experts_per_device"] is None
    assert flat["by_kind"]["routed_experts"] == ep["by_kind"]["routed_experts"]
    # experts that do not divide: the fullest device holds ceil(128 / 48) = 3
    odd = weights_per_device(
        QWEN3_235B, "bf16", tensor_parallel_size=8, data_parallel_size=6, enable_expert_parallel=True
    )
    assert odd["experts_per_device"] == 3
    assert odd["by_kind"]["routed_experts"] == 2 * 94 * 3 * 3 * 4096 * 1536
    # KV heads are replicated once TP exceeds them: 4 KV heads at TP8 -> one head per device
    assert odd["by_kind"]["attention_kv"] == 2 * 94 * 2 * 4096 * 1 * 128
    # a dense model ignores --enable-expert-parallel
    dense = weights_per_device(QWEN3_32B, "bf16", tensor_parallel_size=4, enable_expert_parallel=True)
    assert dense["expert_parallel_size"] == 1 and dense["bytes"] == pytest.approx(
        weight_bytes_for_scheme(QWEN3_32B, "bf16") / 4, rel=0.001
    )


# --------------------------------------------------------------------------------------------
# KV cache per token
# --------------------------------------------------------------------------------------------


def test_mla_kv_per_token():
    # vLLM's MLA cache: (kv_lora_rank + qk_rope_head_dim) = 576 values per token per layer, not per head
    assert kv_bytes_per_token_from_config(DEEPSEEK_R1, 2) == 576 * 61 * 2 == 70_272
    assert kv_bytes_per_token_from_config(DEEPSEEK_R1, 2, tensor_parallel_size=4) == 70_272  # whole on each device
    assert kv_bytes_per_token_from_config(DEEPSEEK_R1, 1) == 35_136  # int8 cache
    assert kv_bytes_per_token_from_config(DEEPSEEK_R1, 2, include_mtp=True) == 576 * 62 * 2  # + the MTP layer
    # inspection's GQA formula would say 61 layers x 128 heads x 128 x 2 (K, V) x 2 bytes: about 57 times more
    gqa = kv_bytes_per_token({"num_layers": 61, "num_kv_heads": 128, "head_dim": 128}, 2)
    assert gqa == 3_997_696 and 56 < gqa / 70_272 < 57


def test_gqa_kv_per_token_matches_inspection_and_splits_by_tp():
    whole = kv_bytes_per_token({"num_layers": 64, "num_kv_heads": 8, "head_dim": 128}, 2)
    assert kv_bytes_per_token_from_config(QWEN3_32B, 2) == whole == 262_144
    assert kv_bytes_per_token_from_config(QWEN3_32B, 2, tensor_parallel_size=4) == whole // 4
    assert kv_bytes_per_token_from_config(QWEN3_32B, 2, tensor_parallel_size=16) == whole // 8  # 1 head, replicated
    assert kv_bytes_per_token_from_config(QWEN3_235B, 2, tensor_parallel_size=8) == 94 * 1 * 128 * 2 * 2
    with pytest.raises(ValueError, match="kv_cache_dtype_bytes must be positive"):
        kv_bytes_per_token_from_config(QWEN3_32B, 0)


# --------------------------------------------------------------------------------------------
# the tutorials' deployments (vllm-ascend v0.23.0, docs/source/tutorials/models/)
# --------------------------------------------------------------------------------------------


def deploy(cfg, quantization, hardware, *, nodes=1, **kwargs):
    return deployment_capacity(hf_config=cfg, quantization=quantization, nodes=nodes, **hardware, **kwargs)


# DeepSeek-R1.md ## 5.1 Single-Node Online Deployment / ## 5.2 Multi-Node Data Parallel Deployment:
# --data-parallel-size 4 --tensor-parallel-size 4 --enable-expert-parallel --max-num-seqs 16 --max-model-len 16384
# --gpu-memory-utilization 0.92 --speculative-config '{"num_speculative_tokens":3,"method":"mtp"}'
DEEPSEEK_R1_COMMAND = {
    "data_parallel_size": 4,
    "tensor_parallel_size": 4,
    "enable_expert_parallel": True,
    "max_num_seqs": 16,
    "max_model_len": 16384,
    "gpu_memory_utilization": 0.92,
    "speculative_tokens": 3,
}


def test_deepseek_r1_w8a8_fits_one_a3_node():
    # DeepSeek-R1.md, ### 3.1 Model Weight: "`DeepSeek-R1-W8A8`(Quantized version): require 1 Atlas 800 A3
    # (64G × 16) nodes or 2 Atlas 800 A2 (64G × 8) nodes."  ### 5.1: "The quantized model `DeepSeek-R1-W8A8`
    # can be deployed on 1 Atlas 800 A3 (64G × 16) or 2 Atlas 800 A2 (64G × 8)."
    r = deploy(DEEPSEEK_R1, "w8a8", A3, **DEEPSEEK_R1_COMMAND)
    assert r["fits"] is True, r["summary"]
    assert r["needed_devices"] == r["available_devices"] == 16
    assert r["is_moe"] and r["is_mla"] and r["includes_mtp"]  # method mtp loads the MTP layer
    assert r["expert_parallel_size"] == 16 and r["experts_per_device"] == 16
    assert r["kv_bytes_per_token_per_device"] == 576 * 62 * 2  # 61 layers + the MTP layer, MLA latent
    assert 40 < r["weights_per_device_gib"] < 48
    assert r["kv_tokens_per_dp_rank"] >= 16384 and r["kv_tokens_per_dp_rank"] % 128 == 0
    assert r["concurrent_full_length_seqs"] >= 1 and not r["exceeds_max_position_embeddings"]
    # the arithmetic of the module docstring
    usable = int(64 * GiB * 0.92)
    overhead = default_overhead_bytes(r["weight_bytes_per_device"], 1)
    assert r["usable_bytes_per_device"] == usable and r["overhead_bytes_per_device"] == overhead
    assert r["kv_room_bytes_per_device"] == usable - r["weight_bytes_per_device"] - overhead
    assert r["kv_tokens_per_dp_rank"] == r["kv_room_bytes_per_device"] // (576 * 62 * 2 * 128) * 128
    assert r["summary"].startswith("Fits:") and r["summary"].count(". ") == 0 and r["summary"].endswith(".")


def test_deepseek_r1_w8a8_needs_two_a2_nodes():
    # DeepSeek-R1.md, ### 3.1 Model Weight: "require 1 Atlas 800 A3 (64G × 16) nodes or 2 Atlas 800 A2 (64G × 8)
    # nodes."  ### 5.2 Multi-Node Data Parallel Deployment: "Run the following scripts on two nodes respectively."
    # (--data-parallel-size 4 --data-parallel-size-local 2 --tensor-parallel-size 4: 8 NPUs per node)
    two = deploy(DEEPSEEK_R1, "w8a8", A2_64, nodes=2, **DEEPSEEK_R1_COMMAND)
    assert two["fits"] is True, two["summary"]
    assert (
        two["weights_per_device_gib"]
        == deploy(DEEPSEEK_R1, "w8a8", A3, **DEEPSEEK_R1_COMMAND)["weights_per_device_gib"]
    )
    # ... and not one A2 node: the tutorial's DP4 x TP4 needs 16 NPUs ...
    one = deploy(DEEPSEEK_R1, "w8a8", A2_64, **DEEPSEEK_R1_COMMAND)
    assert one["fits"] is False and one["needed_devices"] == 16 and one["available_devices"] == 8
    assert one["summary"].startswith("Does not fit: DP4 x TP4 with EP16 needs 16 devices")
    # ... and no 8-NPU layout fits either: 32 of the 256 experts per NPU are more than 64 GB in W8A8
    for dp, tp in ((1, 8), (2, 4)):
        r = deploy(
            DEEPSEEK_R1, "w8a8", A2_64, **{**DEEPSEEK_R1_COMMAND, "data_parallel_size": dp, "tensor_parallel_size": tp}
        )
        assert r["fits"] is False and r["experts_per_device"] == 32 and r["weights_per_device_gib"] > 64
        assert r["kv_room_gib_per_device"] < 0 and r["kv_tokens_per_dp_rank"] == 0
        assert r["summary"].startswith("Does not fit:") and "usable" in r["summary"]


# Qwen3-235B-A22B.md ### 5.1 Single-Node Online Deployment, "Atlas 800I A2/A3:" ASCEND_RT_VISIBLE_DEVICES=0,...,7
# --tensor-parallel-size 8 --data-parallel-size 1 --quantization ascend --max-num-seqs 32 --max-model-len 131072
# --enable-expert-parallel --gpu-memory-utilization 0.95 --hf-overrides '{"rope_parameters": {"rope_type":"yarn", ...
# "factor":4,"original_max_position_embeddings":32768}}'
QWEN3_235B_COMMAND = {
    "tensor_parallel_size": 8,
    "data_parallel_size": 1,
    "enable_expert_parallel": True,
    "max_num_seqs": 32,
    "max_model_len": 131072,
    "gpu_memory_utilization": 0.95,
}


@pytest.mark.parametrize(
    "hardware,nodes,tp",
    [(A2_64, 1, 8), (A3, 1, 8), (A2_32, 2, 16)],
    ids=["1 A2 64GBx8, tp8", "1 A3 64GBx16, tp8", "2 A2 32GBx8, tp16"],
)
def test_qwen3_235b_w8a8_fits_as_the_tutorial_runs_it(hardware, nodes, tp):
    # Qwen3-235B-A22B.md, ### 3.1 Model Weight, quantized table: "| Qwen3-235B-A22B-W8A8 | W8A8 | 1 Atlas 800I A3
    # (64GB × 16), 1 Atlas 800I A2 (64GB × 8), 2 Atlas 800I A2 (32GB × 8)|"; ### 5.1 runs it ("Atlas 800I A2/A3:")
    # with the command above on 8 chips.  Two 32 GB nodes get no command: the same flags at TP16, the TP of
    # ### 9.1's "Low Latency | Single-Node (TP16)".
    r = deploy(QWEN3_235B, "w8a8", hardware, nodes=nodes, **{**QWEN3_235B_COMMAND, "tensor_parallel_size": tp})
    assert r["fits"] is True, r["summary"]
    assert r["experts_per_device"] == 128 // tp
    assert r["kv_bytes_per_token_per_device"] == 94 * 1 * 128 * 2 * 2  # 4 KV heads, one per device at TP >= 4
    assert r["exceeds_max_position_embeddings"] is True  # 131072 > 40960: the tutorial's yarn override lifts it


def test_qwen3_235b_a3_high_throughput_and_bf16():
    # Qwen3-235B-A22B.md, ### 9.1 Recommended Configurations, Table 1: "| High Throughput | Single-Node (TP4, DP4) |
    # 16 (A3) | W8A8 |" (--tensor-parallel-size 4 --data-parallel-size 4 --max-num-seqs 128 --max-model-len 32768
    # --gpu-memory-utilization 0.9)
    r = deploy(
        QWEN3_235B, "w8a8", A3, tensor_parallel_size=4, data_parallel_size=4, enable_expert_parallel=True,
        max_num_seqs=128, max_model_len=32768, gpu_memory_utilization=0.9,
    )  # fmt: skip
    assert r["fits"] is True and r["expert_parallel_size"] == 16, r["summary"]
    # ### 3.1, BF16 table: "| Qwen3-235B-A22B (BF16) | 1 Atlas 800I A3 (64GB × 16), 1 Atlas 800I A2 (64GB × 8), 2
    # Atlas 800I A2 (32GB × 8)|".  On 8 x 64 GB the bf16 weights (55 GiB per NPU) leave room for one sequence of
    # the native 32,768 tokens, not the 131,072 of the W8A8 command.
    a3 = deploy(QWEN3_235B, "bf16", A3, **{**QWEN3_235B_COMMAND, "tensor_parallel_size": 16})
    assert a3["fits"] is True, a3["summary"]
    a2 = deploy(QWEN3_235B, "bf16", A2_64, **{**QWEN3_235B_COMMAND, "max_model_len": 32768})
    assert a2["fits"] is True and 50 < a2["weights_per_device_gib"] < 58, a2["summary"]
    long = deploy(QWEN3_235B, "bf16", A2_64, **QWEN3_235B_COMMAND)
    assert long["fits"] is False and long["summary"].startswith("Does not fit at max_model_len 131072")
    # 2 x (32GB x 8) in bf16: the estimate leaves about 0.4 GiB per NPU, short contexts only
    small = deploy(QWEN3_235B, "bf16", A2_32, nodes=2, **{**QWEN3_235B_COMMAND, "tensor_parallel_size": 16})
    assert 8192 <= small["kv_tokens_per_dp_rank"] < 32768


# Qwen3-30B-A3B.md ### 5.1 Single-Node Online Deployment, tab "Atlas A2 inference products / Atlas A3 inference
# products": ASCEND_RT_VISIBLE_DEVICES=0,1,2,3 --max-num-seqs 100 --max-model-len 40960 --tensor-parallel-size 4
# --enable-expert-parallel --quantization ascend --gpu-memory-utilization 0.95 --speculative-config
# '{"method": "eagle3", ..., "num_speculative_tokens": 3}'
QWEN3_30B_COMMAND = {
    "tensor_parallel_size": 4,
    "enable_expert_parallel": True,
    "max_num_seqs": 100,
    "max_model_len": 40960,
    "gpu_memory_utilization": 0.95,
    "speculative_tokens": 3,
}


def test_qwen3_30b_a3b_fits_one_a2_device_set():
    # Qwen3-30B-A3B.md, ### 3.1 Model Weight: "| Qwen3-30B-A3B-W8A8   | Atlas 800I A3 (64GB, 1\~2 cards)<br>Atlas
    # 800I A2 (64GB, 2\~4 cards)" (and the same for "Qwen3-30B-A3B (BF16)").
    r = deploy(QWEN3_30B, "w8a8", A2_64, **QWEN3_30B_COMMAND)
    assert r["fits"] is True and r["experts_per_device"] == 32, r["summary"]
    assert r["includes_mtp"] is False  # eagle3 is a separate draft model, not sized
    for quantization in ("w8a8", "bf16"):  # the fewest A2 cards the table names: 2
        two = deploy(QWEN3_30B, quantization, A2_64, **{**QWEN3_30B_COMMAND, "tensor_parallel_size": 2})
        assert two["fits"] is True, two["summary"]
    # ... but not bf16 on one 64 GB chip: 57 GiB of weights leave less than one sequence
    one = deploy(QWEN3_30B, "bf16", A2_64, **{**QWEN3_30B_COMMAND, "tensor_parallel_size": 1})
    assert one["fits"] is False and one["weights_per_device_gib"] > 55
    # ### 9.1, Table 2: "| High Throughput | 1 (A3) | 1   | 37364         | 100          |" (W8A8, TP1, one chip)
    tp1 = deploy(QWEN3_30B, "w8a8", A3, **{**QWEN3_30B_COMMAND, "tensor_parallel_size": 1, "max_model_len": 37364})
    assert tp1["fits"] is True and tp1["needed_devices"] == 1, tp1["summary"]


def test_qwen3_32b_quantized_as_stated():
    # Qwen3-Dense.md, ### 3.1 Model Weight: "| Qwen3-32B-W8A8 | W8A8 | 1 Atlas A3 inference products (64GB × 16) or 1
    # Atlas A2 inference products (64GB × 8) |"; ### 5.1 "Qwen3-32B-W8A8:" ASCEND_RT_VISIBLE_DEVICES=0,1,2,3
    # --tensor-parallel-size 4 --max-model-len 5500 --gpu-memory-utilization 0.9 (max_num_seqs: vLLM's 256)
    for hardware in (A2_64, A3):
        r = deploy(
            QWEN3_32B, "w8a8", hardware, tensor_parallel_size=4, max_model_len=5500, max_num_seqs=256,
            gpu_memory_utilization=0.9,
        )  # fmt: skip
        assert r["fits"] is True and not r["is_moe"] and r["expert_parallel_size"] == 1, r["summary"]
        assert r["kv_bytes_per_token_per_device"] == 64 * 2 * 128 * 2 * 2  # 8 KV heads / TP4
    # "| Qwen3-32B-W4A4 | W4A4 | 1 Atlas A3 inference products (64GB × 16) or 1 Atlas A2 inference products (64GB ×
    # 8) |"; ### 5.1 "Qwen3-32B-W4A4:" ASCEND_RT_VISIBLE_DEVICES=0,1 --data-parallel-size 1 --tensor-parallel-size 2
    # --max-model-len 40960 --max-num-seqs 64 --gpu-memory-utilization 0.9
    w4 = deploy(
        QWEN3_32B, "w4a4", A2_64, tensor_parallel_size=2, data_parallel_size=1, max_model_len=40960, max_num_seqs=64,
        gpu_memory_utilization=0.9,
    )  # fmt: skip
    assert w4["fits"] is True, w4["summary"]
    # bf16 on a single 32 GB 910B4 does not fit at all
    r = deployment_capacity(
        hf_config=QWEN3_32B, quantization="bf16", device_memory_gib=32, devices_per_node=8, nodes=1,
        tensor_parallel_size=1, max_model_len=4096, max_num_seqs=16,
    )  # fmt: skip
    assert r["fits"] is False and r["kv_room_gib_per_device"] < 0


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"quantization": "int3"}, "unknown quantization"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size and data_parallel_size must be at least 1"),
        ({"nodes": 0}, "devices_per_node and nodes must be at least 1"),
        ({"device_memory_gib": 0}, "device_memory_gib must be positive"),
        ({"gpu_memory_utilization": 1.2}, r"gpu_memory_utilization must be in \(0, 1\]"),
        ({"max_model_len": 0}, "max_model_len and max_num_seqs must be at least 1"),
        ({"kv_cache_dtype_bytes": 0}, "kv_cache_dtype_bytes must be positive"),
        ({"speculative_tokens": -1}, "speculative_tokens must not be negative"),
        ({"hf_config": {"hidden_size": 8}}, "cannot size the model"),
    ],
)
def test_deployment_validation(kwargs, message):
    base = {
        "hf_config": QWEN3_32B,
        "quantization": "bf16",
        "device_memory_gib": 64,
        "devices_per_node": 8,
        "nodes": 1,
        "tensor_parallel_size": 1,
        "max_model_len": 4096,
        "max_num_seqs": 16,
    }
    with pytest.raises(ValueError, match=message):
        deployment_capacity(**{**base, **kwargs})


def test_int8_kv_cache_doubles_the_tokens():
    bf16 = deploy(DEEPSEEK_R1, "w8a8", A3, **DEEPSEEK_R1_COMMAND)
    int8 = deploy(DEEPSEEK_R1, "w8a8", A3, **DEEPSEEK_R1_COMMAND, kv_cache_dtype_bytes=1)
    assert int8["kv_bytes_per_token_per_device"] * 2 == bf16["kv_bytes_per_token_per_device"]
    assert math.isclose(int8["kv_tokens_per_dp_rank"], 2 * bf16["kv_tokens_per_dp_rank"], rel_tol=0.01)
    no_mtp = deploy(DEEPSEEK_R1, "w8a8", A3, **{**DEEPSEEK_R1_COMMAND, "speculative_tokens": 0})
    assert no_mtp["includes_mtp"] is False and no_mtp["weight_bytes_per_device"] < bf16["weight_bytes_per_device"]


def test_the_launch_estimate_sizes_mla_models_by_their_latent(tmp_path, settings):
    """The artifact's inspection records MLA's latent (kv_lora_rank, qk_rope_head_dim), so the launch's estimate
    (endpoints.services.capacity_check) sizes DeepSeek's cache as vLLM keeps it, not as 128 full KV heads."""
    import torch
    from safetensors.torch import save_file

    from models_registry.inspection import inspect_hf_dir, kv_bytes_per_token

    settings.MODEL_ROOTS = [tmp_path.resolve()]
    config = json.loads((FIXTURES / "model_configs" / "DeepSeek-R1.config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file({"model.embed_tokens.weight": torch.zeros(4, 4, dtype=torch.bfloat16)}, tmp_path / "model.safetensors")
    info = inspect_hf_dir(tmp_path)
    assert (info["kv_lora_rank"], info["qk_rope_head_dim"]) == (512, 64)
    assert kv_bytes_per_token(info, 2) == 61 * 576 * 2 == 70_272
    assert kv_bytes_per_token({**info, "kv_lora_rank": None}, 2) > 20 * 70_272  # what it was sized as before
