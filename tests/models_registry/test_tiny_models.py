"""The tiny model builders produce models transformers loads, and the GGUF holds the HF weights."""

import json

import gguf
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.support.tiny_models import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    build_tiny_llama_gguf,
    build_tiny_llama_hf,
    build_tiny_tokenizer,
    tiny_gguf_file,  # noqa: F401  (fixture)
    tiny_hf_dir,  # noqa: F401  (fixture)
)

TEXT = "Hello world, the quick brown fox! ünïcødé 日本 123"


def _logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits.float()


def test_hf_dir_files_and_config(tiny_hf_dir):
    names = {p.name for p in tiny_hf_dir.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    } <= names
    config = json.loads((tiny_hf_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"]) == (2, 64, 128)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (4, 2, 16)
    assert config["vocab_size"] == 512
    assert config["tie_word_embeddings"] is False
    assert config["dtype"] == "float32"


def test_hf_tokenizer_works_offline(tiny_hf_dir):
    tok = AutoTokenizer.from_pretrained(tiny_hf_dir)
    assert len(tok) == 512
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id) == (BOS_ID, EOS_ID, PAD_ID, 0)
    ids = tok(TEXT).input_ids
    assert ids[0] == BOS_ID
    assert max(ids) < 512
    assert tok.decode(ids, skip_special_tokens=True) == TEXT  # byte-level: lossless
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt == "<s><|user|>\nhi</s>\n<|assistant|>\n"


def test_hf_model_loads_and_generates(tiny_hf_dir):
    tok = AutoTokenizer.from_pretrained(tiny_hf_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_hf_dir)
    assert model.dtype == torch.float32
    assert (
        sum(p.numel() for p in model.parameters())
        == 2 * 512 * 64 + 2 * (64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128 + 2 * 64) + 64
    )
    enc = tok("Hello", return_tensors="pt")
    out = model.generate(**enc, max_new_tokens=5, do_sample=False)
    assert out.shape == (1, enc.input_ids.shape[1] + 5)


def test_hf_builder_is_deterministic(tmp_path, tiny_hf_dir):
    again = build_tiny_llama_hf(tmp_path / "again")
    for name in ("model.safetensors", "tokenizer.json"):
        assert (again / name).read_bytes() == (tiny_hf_dir / name).read_bytes()
    other = build_tiny_llama_hf(tmp_path / "other", seed=1, with_tokenizer=False)
    assert (other / "model.safetensors").read_bytes() != (tiny_hf_dir / "model.safetensors").read_bytes()
    assert not (other / "tokenizer.json").exists()


@pytest.mark.parametrize("dtype,tie", [("bfloat16", False), ("float16", True)])
def test_hf_dtype_and_tied(tmp_path, dtype, tie):
    d = build_tiny_llama_hf(tmp_path / "m", dtype=dtype, tie_word_embeddings=tie, chat_template=False)
    model = AutoModelForCausalLM.from_pretrained(d, dtype="auto")
    assert model.dtype == getattr(torch, dtype)
    assert (model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()) is tie
    tok = AutoTokenizer.from_pretrained(d)
    assert not tok.chat_template
    assert not (d / "chat_template.jinja").exists()


def test_tokenizer_vocab_size_is_exact():
    assert len(build_tiny_tokenizer(300)) == 300
    assert len(build_tiny_tokenizer(1000)) == 1000  # padded with reserved special tokens
    with pytest.raises(ValueError):
        build_tiny_tokenizer(100)


def test_gguf_names_and_metadata(tiny_gguf_file):
    reader = gguf.GGUFReader(str(tiny_gguf_file))
    names = [t.name for t in reader.tensors]
    assert names[0] == "token_embd.weight"
    assert names[-2:] == ["output.weight", "output_norm.weight"]
    assert "blk.1.attn_q.weight" in names and "blk.1.ffn_down.weight" in names
    assert len(names) == 1 + 2 * 9 + 2
    field = reader.fields["general.architecture"]
    assert field.contents() == "llama"
    assert reader.fields["llama.block_count"].contents() == 2
    assert reader.fields["tokenizer.ggml.model"].contents() == "gpt2"
    assert len(reader.fields["tokenizer.ggml.tokens"].contents()) == 512
    assert "tokenizer.chat_template" in reader.fields
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.attn_norm.weight"] == "F32"
    assert types["blk.0.attn_q.weight"] == "F16"


@pytest.mark.parametrize("tensor_type,tolerance", [("F32", 1e-5), ("F16", 0.02), ("Q8_0", 0.05)])
def test_gguf_logits_match_hf(tmp_path, tiny_hf_dir, tensor_type, tolerance):
    path = build_tiny_llama_gguf(tmp_path / f"tiny-{tensor_type}.gguf", hf_dir=tiny_hf_dir, tensor_type=tensor_type)
    hf_tok = AutoTokenizer.from_pretrained(tiny_hf_dir)
    hf_model = AutoModelForCausalLM.from_pretrained(tiny_hf_dir)
    g_tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    g_model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name)

    ids = hf_tok(TEXT).input_ids
    # The GGUF tokenizer tokenizes identically but does not prepend <s> (see tiny_models docstring).
    assert g_tok(TEXT).input_ids == ids[1:]
    assert g_tok.decode(ids[1:]) == TEXT
    assert len(g_tok) == 512
    assert g_model.config.eos_token_id == EOS_ID and g_model.config.bos_token_id == BOS_ID
    assert g_model.config.tie_word_embeddings is False

    a, b = _logits(hf_model, ids), _logits(g_model, ids)
    scale = a.abs().max().item()
    assert scale > 1.0  # logits are not trivially flat
    assert (a - b).abs().max().item() <= tolerance * scale
    if tensor_type != "Q8_0":
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_gguf_from_scratch_with_tied_embeddings_and_bf16_source(tmp_path):
    hf = build_tiny_llama_hf(tmp_path / "hf", dtype="bfloat16", tie_word_embeddings=True, num_layers=1, seed=3)
    path = build_tiny_llama_gguf(tmp_path / "g" / "tied.gguf", hf_dir=hf, tensor_type="F32")
    names = [t.name for t in gguf.GGUFReader(str(path)).tensors]
    assert "output.weight" not in names
    g_model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name)
    assert g_model.config.tie_word_embeddings is True
    hf_model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    ids = [1, 5, 300, 42, 7]
    assert (_logits(hf_model, ids) - _logits(g_model, ids)).abs().max().item() < 1e-4

    # hf_dir=None builds the HF model itself with the same seed -> same file
    again = build_tiny_llama_gguf(
        tmp_path / "g" / "again.gguf",
        tensor_type="F32",
        dtype="bfloat16",
        tie_word_embeddings=True,
        num_layers=1,
        seed=3,
    )
    assert again.read_bytes() == path.read_bytes()


def test_gguf_builder_rejects_bad_arguments(tmp_path, tiny_hf_dir):
    with pytest.raises(ValueError):
        build_tiny_llama_gguf(tmp_path / "x.gguf", tensor_type="Q4_K")
    with pytest.raises(TypeError):
        build_tiny_llama_gguf(tmp_path / "x.gguf", hf_dir=tiny_hf_dir, num_layers=3)
