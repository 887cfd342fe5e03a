"""models_registry.inspection on tiny HF and GGUF models (no DB, no weights loaded)."""

import json
import math
import shutil

import gguf
import pytest

from models_registry.gguf_reader import read_gguf_header
from models_registry.inspection import (
    FIELDS,
    InspectionError,
    inspect_gguf,
    inspect_hf_dir,
    inspect_path,
    kv_bytes_per_token,
)
from tests.support.tiny_models import (
    build_tiny_llama_gguf,
    build_tiny_llama_hf,
    tiny_gguf_file,  # noqa: F401  (fixture)
    tiny_hf_dir,  # noqa: F401  (fixture)
)

V, H, INTER, L, NH, NKV, HD = 512, 64, 128, 2, 4, 2, 16  # the tiny defaults
PER_LAYER = H * NH * HD + 2 * H * NKV * HD + NH * HD * H + 3 * H * INTER + 2 * H  # q,k,v,o + mlp + 2 norms
UNTIED = 2 * V * H + L * PER_LAYER + H
TIED = V * H + L * PER_LAYER + H


def _numel_sum(directory):
    from safetensors import safe_open

    total = 0
    for f in directory.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():
                total += math.prod(st.get_slice(k).get_shape())
    return total


def _copy(src, tmp_path, name="copy"):
    return shutil.copytree(src, tmp_path / name)


def _common_shape(info):
    assert info["architecture"] == "LlamaForCausalLM"
    assert info["model_type"] == "llama"
    assert (info["num_layers"], info["hidden_size"], info["intermediate_size"]) == (L, H, INTER)
    assert (info["num_attention_heads"], info["num_kv_heads"], info["head_dim"]) == (NH, NKV, HD)
    assert info["vocab_size"] == V
    assert info["max_position_embeddings"] == 2048


# ---------------------------------------------------------------- HF


def test_hf_fp32_untied(tiny_hf_dir):
    info = inspect_path(tiny_hf_dir)
    assert set(info) == set(FIELDS)
    assert info["format"] == "hf"
    _common_shape(info)
    assert info["param_count"] == UNTIED == _numel_sum(tiny_hf_dir) == 139584
    assert info["dtype"] == "float32"
    assert info["weight_bytes"] == 4 * UNTIED
    files = sorted(p.name for p in tiny_hf_dir.iterdir())
    assert info["files"] == files
    assert info["size_bytes"] == sum((tiny_hf_dir / f).stat().st_size for f in files)
    assert info["has_tokenizer"] is True
    assert info["has_chat_template"] is True
    assert info["quantization"] is None
    json.dumps(info)  # storable in a JSONField


def test_hf_bf16_tied(tmp_path):
    d = build_tiny_llama_hf(tmp_path / "m", dtype="bfloat16", tie_word_embeddings=True)
    info = inspect_hf_dir(d)
    _common_shape(info)
    assert info["param_count"] == TIED == _numel_sum(d)
    assert info["dtype"] == "bfloat16"
    assert info["weight_bytes"] == 2 * TIED


def test_hf_other_shape_and_no_tokenizer(tmp_path):
    d = build_tiny_llama_hf(
        tmp_path / "m",
        num_layers=3,
        hidden_size=96,
        intermediate_size=160,
        num_heads=6,
        num_kv_heads=3,
        vocab_size=300,
        with_tokenizer=False,
    )
    info = inspect_path(d)
    assert (
        info["num_layers"],
        info["hidden_size"],
        info["num_attention_heads"],
        info["num_kv_heads"],
        info["head_dim"],
        info["vocab_size"],
    ) == (3, 96, 6, 3, 16, 300)
    assert info["param_count"] == _numel_sum(d)
    assert info["has_tokenizer"] is False
    assert info["has_chat_template"] is False


def test_hf_chat_template_sources(tmp_path, tiny_hf_dir):
    d = build_tiny_llama_hf(tmp_path / "m", chat_template=False)
    info = inspect_path(d)
    assert info["has_tokenizer"] is True and info["has_chat_template"] is False
    # the older layout: the template inside tokenizer_config.json
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = (tiny_hf_dir / "chat_template.jinja").read_text()
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert inspect_path(d)["has_chat_template"] is True


def test_hf_dtype_from_headers_when_config_has_none(tmp_path, tiny_hf_dir):
    d = _copy(tiny_hf_dir, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg.pop("dtype", None)
    cfg.pop("torch_dtype", None)
    (d / "config.json").write_text(json.dumps(cfg))
    assert inspect_path(d)["dtype"] == "float32"


def test_hf_bin_fallback(tmp_path, tiny_hf_dir):
    import torch
    from safetensors.torch import load_file

    d = _copy(tiny_hf_dir, tmp_path)
    state = load_file(str(d / "model.safetensors"))
    (d / "model.safetensors").unlink()
    torch.save(state, d / "pytorch_model.bin")
    info = inspect_path(d)
    assert info["param_count"] == UNTIED
    assert info["weight_bytes"] == (d / "pytorch_model.bin").stat().st_size
    assert "pytorch_model.bin" in info["files"]


def test_hf_sharded_index_and_hidden_files(tmp_path, tiny_hf_dir):
    from safetensors.torch import load_file, save_file

    d = _copy(tiny_hf_dir, tmp_path)
    state = load_file(str(d / "model.safetensors"))
    (d / "model.safetensors").unlink()
    keys = sorted(state)
    half = len(keys) // 2
    shards = {"model-00001-of-00002.safetensors": keys[:half], "model-00002-of-00002.safetensors": keys[half:]}
    weight_map = {}
    for name, ks in shards.items():
        save_file({k: state[k] for k in ks}, str(d / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(ks, name))
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (d / ".cache").mkdir()
    (d / ".cache" / "junk").write_text("x" * 1000)
    info = inspect_path(d)
    assert info["param_count"] == UNTIED
    assert not any(f.startswith(".") for f in info["files"])
    assert "model-00002-of-00002.safetensors" in info["files"]
    (d / "loop").symlink_to(d, target_is_directory=True)  # a symlink loop does not hang the walk
    assert inspect_path(d)["param_count"] == UNTIED
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(InspectionError, match="incomplete checkpoint"):
        inspect_path(d)


def test_hf_multimodal_text_config(tmp_path, tiny_hf_dir):
    d = _copy(tiny_hf_dir, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    text = {
        k: cfg.pop(k)
        for k in (
            "num_hidden_layers",
            "hidden_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "vocab_size",
            "intermediate_size",
        )
    }
    cfg.update({"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava", "text_config": text})
    (d / "config.json").write_text(json.dumps(cfg))
    info = inspect_path(d)
    assert info["architecture"] == "LlavaForConditionalGeneration"
    assert (info["num_layers"], info["hidden_size"], info["num_kv_heads"], info["vocab_size"]) == (L, H, NKV, V)


# ---------------------------------------------------------------- quantization


def test_modelslim_description(tmp_path, tiny_hf_dir):
    d = _copy(tiny_hf_dir, tmp_path)
    desc = {
        "model_quant_type": "W8A8",
        "version": "1.0.0",
        "model.layers.0.self_attn.q_proj.weight": "W8A8",
        "model.norm.weight": "FLOAT",
    }
    (d / "quant_model_description.json").write_text(json.dumps(desc))
    info = inspect_path(d)
    assert info["format"] == "ascend-modelslim"
    assert info["quantization"]["method"] == "ascend-modelslim"
    assert info["quantization"]["scheme"] == "W8A8"
    assert info["dtype"] == "W8A8"
    assert "quant_model_description.json" in info["files"]


def test_modelslim_suffixed_description_without_type(tmp_path, tiny_hf_dir):
    d = _copy(tiny_hf_dir, tmp_path)
    desc = {
        "model.layers.0.mlp.down_proj.weight": "W4A16",
        "model.layers.0.mlp.up_proj.weight": "W4A16",
        "lm_head.weight": "FLOAT",
    }
    (d / "quant_model_description_w4a16.json").write_text(json.dumps(desc))
    info = inspect_path(d)
    assert info["format"] == "ascend-modelslim"
    assert info["quantization"]["scheme"] == "W4A16"


def _with_quant_config(tmp_path, src, qc, key="quantization_config"):
    d = _copy(src, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg[key] = qc
    (d / "config.json").write_text(json.dumps(cfg))
    return inspect_path(d)


@pytest.mark.parametrize(
    "weights,acts,scheme",
    [
        (
            {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True},
            {"num_bits": 8, "type": "int", "dynamic": True},
            "W8A8",
        ),
        ({"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}, None, "W4A16"),
        ({"num_bits": 8, "type": "float", "strategy": "tensor"}, {"num_bits": 8, "type": "float"}, "FP8"),
    ],
)
def test_compressed_tensors(tmp_path, tiny_hf_dir, weights, acts, scheme):
    qc = {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}},
        "ignore": ["lm_head"],
    }
    info = _with_quant_config(tmp_path, tiny_hf_dir, qc)
    assert info["format"] == "compressed-tensors"
    assert info["quantization"]["method"] == "compressed-tensors"
    assert info["quantization"]["scheme"] == scheme
    assert info["dtype"] == "float32"  # the config's dtype stays; the scheme is in quantization


def test_compression_config_key(tmp_path, tiny_hf_dir):
    qc = {
        "quant_method": "compressed-tensors",
        "config_groups": {
            "g": {"weights": {"num_bits": 8, "type": "int"}, "input_activations": {"num_bits": 8, "type": "int"}}
        },
    }
    info = _with_quant_config(tmp_path, tiny_hf_dir, qc, key="compression_config")
    assert info["format"] == "compressed-tensors" and info["quantization"]["scheme"] == "W8A8"


@pytest.mark.parametrize(
    "qc,method,scheme",
    [
        ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False}, "gptq", "W4A16"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm"}, "awq", "W4A16"),
        ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "fp8", "FP8"),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}, "bitsandbytes", "nf4"),
    ],
)
def test_other_quantization_configs(tmp_path, tiny_hf_dir, qc, method, scheme):
    info = _with_quant_config(tmp_path, tiny_hf_dir, qc)
    assert info["format"] == "hf"
    assert info["quantization"]["method"] == method
    assert info["quantization"]["scheme"] == scheme
    if method in ("gptq", "awq"):
        assert info["quantization"]["group_size"] == 128


# ---------------------------------------------------------------- GGUF


@pytest.mark.parametrize(
    "tensor_type,weight_bytes",
    [
        ("F32", 4 * UNTIED),
        ("F16", 4 * (L * 2 * H + H) + 2 * (UNTIED - (L * 2 * H + H))),
        ("Q8_0", 4 * (L * 2 * H + H) + (UNTIED - (L * 2 * H + H)) // 32 * 34),
    ],
)
def test_gguf(tmp_path, tiny_hf_dir, tensor_type, weight_bytes):
    path = build_tiny_llama_gguf(tmp_path / f"tiny-{tensor_type}.gguf", hf_dir=tiny_hf_dir, tensor_type=tensor_type)
    info = inspect_path(path)
    assert set(info) == set(FIELDS)
    assert info["format"] == "gguf"
    _common_shape(info)
    assert info["param_count"] == UNTIED
    assert info["weight_bytes"] == weight_bytes
    assert info["dtype"] == tensor_type
    assert info["size_bytes"] == path.stat().st_size
    assert info["files"] == [path.name]
    assert info["has_tokenizer"] is True and info["has_chat_template"] is True
    if tensor_type == "Q8_0":
        assert info["quantization"] == {"method": "gguf", "scheme": "Q8_0"}
    else:
        assert info["quantization"] is None
    json.dumps(info)


def test_gguf_tied_bf16_source_no_template(tmp_path):
    path = build_tiny_llama_gguf(tmp_path / "t.gguf", dtype="bfloat16", tie_word_embeddings=True, chat_template=False)
    info = inspect_gguf(path)
    assert info["param_count"] == TIED
    assert info["has_chat_template"] is False
    assert info["dtype"] == "F16"


def test_gguf_header_matches_gguf_reader(tiny_gguf_file):
    header = read_gguf_header(tiny_gguf_file)
    reader = gguf.GGUFReader(str(tiny_gguf_file))
    assert header["data_offset"] == reader.data_offset
    ours = [
        (t["name"], t["type"], t["n_elements"], t["n_bytes"], header["data_offset"] + t["offset"])
        for t in header["tensors"]
    ]
    theirs = [
        (t.name, t.tensor_type.name, int(t.n_elements), int(t.n_bytes), int(t.data_offset)) for t in reader.tensors
    ]
    assert ours == theirs
    assert header["tensors"][0]["shape"] == [V, H]  # torch order
    assert header["metadata"]["tokenizer.ggml.tokens"][:2] == ["<unk>", "<s>"]
    assert header["metadata"]["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-5)


def _write_gguf(path, arch="llama", name="x", n_tokens=None, file_type=None, qtype="F16"):
    import numpy as np

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    if file_type is not None:
        w.add_file_type(file_type)
    w.add_block_count(1)
    w.add_embedding_length(32)
    w.add_head_count(4)
    if n_tokens:
        w.add_token_list([f"t{i}" for i in range(n_tokens)])
        w.add_token_merges([f"a{i} b{i}" for i in range(n_tokens)])
    data = np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32)
    if qtype == "F16":
        w.add_tensor("token_embd.weight", data.astype(np.float16))
    else:
        q = gguf.quants.quantize(data, gguf.GGMLQuantizationType[qtype])
        w.add_tensor("token_embd.weight", q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType[qtype])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_large_vocab_is_skipped_not_decoded(tmp_path):
    # What keeps a 150k-token vocabulary cheap is that the list is stepped over, not decoded into 50k strings:
    # checked on the parsed header (a wall-clock bound would measure the machine's load, not this).
    from models_registry.gguf_reader import GGUFArray

    path = _write_gguf(tmp_path / "big.gguf", n_tokens=50_000)
    tokens = read_gguf_header(path)["metadata"]["tokenizer.ggml.tokens"]
    assert isinstance(tokens, GGUFArray) and len(tokens) == 50_000 and list.__len__(tokens) == 0
    info = inspect_gguf(path)
    assert info["vocab_size"] == 50_000  # from the token list (no <arch>.vocab_size key)
    assert info["has_tokenizer"] is True


def test_gguf_names_and_inferred_dtype(tmp_path):
    info = inspect_gguf(_write_gguf(tmp_path / "m.gguf", name="Mistral-7B-Instruct"))
    assert info["architecture"] == "MistralForCausalLM" and info["model_type"] == "mistral"
    assert info["dtype"] == "F16"  # no general.file_type: from the tensors
    assert info["vocab_size"] == 64  # from token_embd.weight
    assert info["num_kv_heads"] == 4 and info["head_dim"] == 8
    info = inspect_gguf(_write_gguf(tmp_path / "q.gguf", arch="qwen2moe", qtype="Q4_1", file_type=3))
    assert info["architecture"] == "Qwen2MoeForCausalLM" and info["model_type"] == "qwen2_moe"
    assert info["dtype"] == "Q4_1"
    assert info["quantization"] == {"method": "gguf", "scheme": "Q4_1"}
    info = inspect_gguf(_write_gguf(tmp_path / "u.gguf", arch="someday"))
    assert info["architecture"] is None and info["model_type"] == "someday"


def test_dir_with_one_gguf(tmp_path, tiny_gguf_file):
    d = tmp_path / "d"
    d.mkdir()
    shutil.copy(tiny_gguf_file, d / "model.gguf")
    assert inspect_path(d)["format"] == "gguf"
    shutil.copy(tiny_gguf_file, d / "other.gguf")
    with pytest.raises(InspectionError, match="2 .gguf files"):
        inspect_path(d)


# ---------------------------------------------------------------- errors


def test_missing_path(tmp_path):
    with pytest.raises(InspectionError, match="no such file"):
        inspect_path(tmp_path / "nope")


def test_empty_dir(tmp_path):
    with pytest.raises(InspectionError, match="config.json"):
        inspect_path(tmp_path)


def test_corrupt_config(tmp_path, tiny_hf_dir):
    d = _copy(tiny_hf_dir, tmp_path)
    (d / "config.json").write_text('{"model_type": "llama", ')
    with pytest.raises(InspectionError, match="corrupt config.json"):
        inspect_path(d)
    (d / "config.json").write_text("[1, 2]")
    with pytest.raises(InspectionError, match="corrupt config.json"):
        inspect_path(d)


def test_config_without_weights(tmp_path, tiny_hf_dir):
    d = tmp_path / "d"
    d.mkdir()
    shutil.copy(tiny_hf_dir / "config.json", d / "config.json")
    with pytest.raises(InspectionError, match="no weights"):
        inspect_path(d)


def test_corrupt_safetensors_header(tmp_path, tiny_hf_dir):
    d = _copy(tiny_hf_dir, tmp_path)
    (d / "model.safetensors").write_bytes((20).to_bytes(8, "little") + b"{not json at all...}")
    with pytest.raises(InspectionError, match="safetensors"):
        inspect_path(d)
    (d / "model.safetensors").write_bytes(b"abc")
    with pytest.raises(InspectionError, match="safetensors"):
        inspect_path(d)


@pytest.mark.parametrize("keep", [3, 10, 24, 100, 2000, 13000])
def test_truncated_gguf_header(tmp_path, tiny_gguf_file, keep):
    data = tiny_gguf_file.read_bytes()
    assert read_gguf_header(tiny_gguf_file)["data_offset"] > 13000
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:keep])
    with pytest.raises(InspectionError) as e:
        inspect_path(path)
    assert "GGUF" in str(e.value)


def test_truncated_gguf_data(tmp_path, tiny_gguf_file):
    path = tmp_path / "cut.gguf"
    path.write_bytes(tiny_gguf_file.read_bytes()[:-1000])
    with pytest.raises(InspectionError, match="truncated"):
        inspect_path(path)


def test_random_files(tmp_path):
    import os

    junk = os.urandom(4096)
    (tmp_path / "weights.bin").write_bytes(junk)
    with pytest.raises(InspectionError, match="not a model"):
        inspect_path(tmp_path / "weights.bin")
    (tmp_path / "fake.gguf").write_bytes(b"NOPE" + junk)
    with pytest.raises(InspectionError, match="not a GGUF file"):
        inspect_path(tmp_path / "fake.gguf")
    (tmp_path / "garbage.gguf").write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + junk)
    with pytest.raises(InspectionError, match="corrupt GGUF"):
        inspect_path(tmp_path / "garbage.gguf")
    assert issubclass(InspectionError, ValueError)


# ---------------------------------------------------------------- KV cache


def test_kv_bytes_per_token(tiny_hf_dir, tiny_gguf_file):
    assert kv_bytes_per_token(inspect_path(tiny_hf_dir), 2) == L * NKV * HD * 2 * 2 == 256
    assert kv_bytes_per_token(inspect_path(tiny_gguf_file), 1) == 128
    llama2_7b = {"num_layers": 32, "num_kv_heads": 32, "head_dim": 128}
    assert kv_bytes_per_token(llama2_7b, 2) == 524288  # 0.5 MiB per token
    llama3_8b = {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128}
    assert kv_bytes_per_token(llama3_8b, 2) == 131072
    assert kv_bytes_per_token({"num_layers": 2, "num_attention_heads": 4, "hidden_size": 64}, 2) == 512
    with pytest.raises(ValueError, match="num_layers"):
        kv_bytes_per_token({"num_kv_heads": 8, "head_dim": 128}, 2)
