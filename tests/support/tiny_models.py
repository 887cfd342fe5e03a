"""Builders of tiny random Llama models for fast tests (no network, no hub).

Two plain functions:

* :func:`build_tiny_llama_hf` writes a Hugging Face-format directory (``config.json``,
  ``model.safetensors``, ``generation_config.json``, ``tokenizer.json``, ``tokenizer_config.json``
  and ``chat_template.jinja`` -- transformers 5 writes the template there, not into
  ``tokenizer_config.json``).  The tokenizer
  is a real byte-level BPE (the Llama-3 / GPT-2 kind) trained offline with the ``tokenizers``
  library on a few sentences, wrapped in ``PreTrainedTokenizerFast``; its size is exactly the
  config's ``vocab_size`` (padded with ``<|reserved_N|>`` special tokens when training yields fewer
  merges than asked).

* :func:`build_tiny_llama_gguf` writes a single ``.gguf`` file (``general.architecture = "llama"``)
  with :class:`gguf.GGUFWriter`.  It first builds (or reads) the HF model and converts its weights the
  way llama.cpp's ``convert_hf_to_gguf.py`` does: llama.cpp tensor names (``token_embd.weight``,
  ``blk.N.attn_q.weight``, ..., ``output_norm.weight``, ``output.weight``), the q/k rows permuted
  (``LlamaModel.permute``: ``w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2)``,
  with ``n_head = num_kv_heads`` for k), 1-D norms always F32, the rest F32, F16 or Q8_0
  (``gguf.quants.quantize``), and the tokenizer as ``tokenizer.ggml.model = "gpt2"`` metadata
  (tokens, token types, merges, bos/eos/unk/pad ids, chat template).

How transformers (5.17 here) loads such a GGUF::

    AutoTokenizer.from_pretrained(directory, gguf_file="tiny.gguf")
    AutoModelForCausalLM.from_pretrained(directory, gguf_file="tiny.gguf")

Nothing else is needed: ``gguf_file=`` alone makes ``from_pretrained`` create a
``GgufConfig(gguf_file=...)`` quantizer.  "llama" is not in the new packed-GGUF path (in 5.17 that
path only covers ``qwen35``), so the legacy loader is used: every tensor is dequantized with
``gguf.dequantize`` and the q/k permutation is reversed by ``LlamaTensorProcessor``; the model
comes out dense in ``torch.get_default_dtype()`` (float32) unless ``dtype=`` is passed.  Passing
``quantization_config=GgufConfig(dequantize=True)`` is accepted too and changes nothing for llama.
``gguf_file`` may also be an absolute path (then the first argument is only used as a name).

Quirks of the GGUF round trip in transformers 5.17 (checked by tests/test_tiny_models.py):

* the loaded config has ``model_type = "llama"`` but no ``architectures``; ``tie_word_embeddings``
  is inferred from whether ``output.weight`` is present; ``rms_norm_eps`` comes back as float32
  (1e-5 -> 9.9999997e-06).
* the GGUF tokenizer yields the same ids as the HF one except that it does not prepend ``<s>``
  (the GGUF converter installs no post-processor), has no pad token, and -- a transformers bug in
  ``GGUFLlamaConverter`` -- reports ``eos_token`` as the *bos* token ``<s>`` (so its chat
  template renders ``<s>`` where the HF one renders ``</s>``).  The model's config/generation
  config do carry the right ``eos_token_id`` (2).
* F32 logits match the HF model exactly; F16 to ~1e-3 of the logit scale; Q8_0 to a few percent.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
UNK_TOKEN = "<unk>"
PAD_TOKEN = "<pad>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (UNK_TOKEN, BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, *ROLE_TOKENS)  # ids 0..6, in this order
UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3

DEFAULT_VOCAB_SIZE = 512
DEFAULT_MAX_POSITION_EMBEDDINGS = 2048

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + '\n' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

TRAINING_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "Ascend NPUs run large language models with vLLM and MindIE.",
    "Hello, world! How are you today? I am fine, thank you.",
    "A tiny model is enough to test loading, tokenizing and generating text.",
    "Numbers like 0 1 2 3 4 5 6 7 8 9 10 100 1000 appear in logs and configs.",
    "The operator checks memory, throughput, latency and the key-value cache.",
    "Quantization to W8A8 or Q4_K_M trades a little accuracy for speed and memory.",
    "def main():\n    print('hello world')\n    return 0\n",
    "Weights are stored in safetensors files; GGUF files bundle weights and tokenizer.",
    "She sells sea shells by the sea shore, and the shells she sells are surely sea shells.",
] * 4

DTYPES = {
    "float32": "float32",
    "fp32": "float32",
    "float16": "float16",
    "fp16": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
}


# --------------------------------------------------------------------------------------------
# tokenizer
# --------------------------------------------------------------------------------------------


def build_tiny_tokenizer(vocab_size: int = DEFAULT_VOCAB_SIZE, *, chat_template: bool = True):
    """A byte-level BPE ``PreTrainedTokenizerFast`` of exactly ``vocab_size`` tokens, built offline.

    Ids 0..6 are ``<unk> <s> </s> <pad> <|system|> <|user|> <|assistant|>``, then the 256 byte
    symbols and the learnt merges, then ``<|reserved_N|>`` special tokens if training came short.
    Encoding prepends ``<s>`` (like Llama).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    minimum = len(SPECIAL_TOKENS) + 256
    if vocab_size < minimum:
        raise ValueError(f"vocab_size must be at least {minimum} for a byte-level BPE tokenizer, got {vocab_size}")

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=True)
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=True)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TRAINING_TEXT, trainer=trainer)

    # Rebuild the model from vocab + merges so that the size can be padded exactly.
    state = json.loads(tok.to_str())
    vocab = dict(state["model"]["vocab"])
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in state["model"]["merges"]]
    reserved = []
    while len(vocab) < vocab_size:
        token = f"<|reserved_{len(reserved)}|>"
        vocab[token] = len(vocab)
        reserved.append(token)
    assert sorted(vocab.values()) == list(range(vocab_size)), "vocab ids must be dense"

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=True)
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=True)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (*SPECIAL_TOKENS, *reserved)])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN}:0 $A:0",
        pair=f"{BOS_TOKEN}:0 $A:0 {BOS_TOKEN}:1 $B:1",
        special_tokens=[(BOS_TOKEN, BOS_ID)],
    )
    assert tok.get_vocab_size(with_added_tokens=True) == vocab_size

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        pad_token=PAD_TOKEN,
        chat_template=CHAT_TEMPLATE if chat_template else None,
        model_max_length=DEFAULT_MAX_POSITION_EMBEDDINGS,
        clean_up_tokenization_spaces=False,
    )


# --------------------------------------------------------------------------------------------
# Hugging Face directory
# --------------------------------------------------------------------------------------------


def build_tiny_llama_hf(
    directory,
    *,
    dtype: str = "float32",
    num_layers: int = 2,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    max_position_embeddings: int = DEFAULT_MAX_POSITION_EMBEDDINGS,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    with_tokenizer: bool = True,
    chat_template: bool = True,
) -> Path:
    """Write a tiny random ``LlamaForCausalLM`` in Hugging Face format to ``directory``; return it.

    ``dtype`` is "float32", "float16" or "bfloat16" (also "fp32", "fp16", "bf16"); the weights are
    saved in that dtype and ``config.json`` records it.  Weights are initialised from ``seed``
    (the global torch RNG state is saved and restored).  With ``with_tokenizer`` the tokenizer
    files are written too (see :func:`build_tiny_tokenizer`); ``chat_template`` controls whether
    it carries a chat template.  ``head_dim`` is ``hidden_size // num_heads``.
    """
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    torch_dtype = getattr(torch, DTYPES[dtype])
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError("hidden_size must be divisible by num_heads, and num_heads by num_kv_heads")

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )
    config.architectures = ["LlamaForCausalLM"]

    rng_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
        # The default init (std 0.02) makes near-uniform logits; widen it a little (logits std ~1)
        # so that a logits comparison means something.
        with torch.no_grad():
            for _name, param in model.named_parameters():
                if param.dim() >= 2:
                    param.normal_(0.0, 0.1)
                else:
                    param.uniform_(0.5, 1.5)
    finally:
        torch.random.set_rng_state(rng_state)
    model = model.to(torch_dtype)
    model.config.dtype = torch_dtype
    model.eval()
    model.save_pretrained(directory)
    GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, do_sample=False, max_new_tokens=16
    ).save_pretrained(directory)

    if with_tokenizer:
        tokenizer = build_tiny_tokenizer(vocab_size, chat_template=chat_template)
        tokenizer.save_pretrained(directory)
    return directory


def build_slow_to_convert_hf(directory) -> Path:
    """A tiny Llama wide enough (about 33M parameters) that converting it takes seconds: long enough to kill
    its worker mid-run."""
    return build_tiny_llama_hf(
        directory, num_layers=6, hidden_size=512, intermediate_size=2048, num_heads=8, num_kv_heads=8, vocab_size=8192
    )


# --------------------------------------------------------------------------------------------
# GGUF
# --------------------------------------------------------------------------------------------


def _permute(weights, n_head: int, n_head_kv: int | None):
    """llama.cpp ``convert_hf_to_gguf.LlamaModel.permute`` (numpy version)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def hf_to_gguf_name(name: str) -> str:
    """HF Llama parameter name -> llama.cpp GGUF tensor name."""
    if name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if name == "model.norm.weight":
        return "output_norm.weight"
    if name == "lm_head.weight":
        return "output.weight"
    parts = name.split(".")
    if parts[:2] == ["model", "layers"]:
        layer, rest = parts[2], ".".join(parts[3:])
        module, suffix = rest.rsplit(".", 1)
        if module in _LAYER_NAMES:
            return f"blk.{layer}.{_LAYER_NAMES[module]}.{suffix}"
    raise KeyError(f"no GGUF name for {name!r}")


_FILE_TYPES = {"F32": 0, "F16": 1, "Q8_0": 7}  # gguf.LlamaFileType ALL_F32, MOSTLY_F16, MOSTLY_Q8_0


def build_tiny_llama_gguf(
    path,
    *,
    tensor_type: str = "F16",
    hf_dir=None,
    name: str = "tiny-llama",
    **hf_kwargs,
) -> Path:
    """Write a tiny llama GGUF file at ``path`` (a file name ending in ``.gguf``); return its path.

    The weights come from the HF model in ``hf_dir`` (which must hold the files
    :func:`build_tiny_llama_hf` writes, tokenizer included), or, when ``hf_dir`` is None, from a
    fresh :func:`build_tiny_llama_hf` built with ``hf_kwargs`` (same defaults, same ``seed``) in a
    temporary directory, so ``build_tiny_llama_gguf(p, seed=0)`` holds the same weights as
    ``build_tiny_llama_hf(d, seed=0)``.

    ``tensor_type`` is "F32", "F16" or "Q8_0" for the 2-D tensors; the 1-D norm weights are always
    F32 (as llama.cpp does).  q/k weights are permuted like llama.cpp's converter, which
    transformers' GGUF loader reverses.  Tokenizer metadata: ``tokenizer.ggml.model = "gpt2"``
    (byte-level BPE; transformers treats it as a Llama-3 style tokenizer), ``tokens``, ``token_type``
    (3 = control for the special tokens, 1 = normal), ``merges``, bos/eos/unk/padding ids and
    ``tokenizer.chat_template`` when the HF tokenizer has one.

    Load it with ``AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)`` and
    ``AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name)`` (see module docstring).
    """
    import gguf
    import numpy as np

    tensor_type = tensor_type.upper()
    if tensor_type not in _FILE_TYPES:
        raise ValueError(f"tensor_type must be one of {sorted(_FILE_TYPES)}, got {tensor_type!r}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)

    tmp = None
    if hf_dir is None:
        tmp = tempfile.mkdtemp(prefix="tiny-llama-hf-")
        hf_kwargs.setdefault("dtype", "float32")
        hf_dir = build_tiny_llama_hf(tmp, **hf_kwargs)
    elif hf_kwargs:
        raise TypeError(f"model arguments {sorted(hf_kwargs)} make no sense together with hf_dir")
    hf_dir = Path(hf_dir)

    try:
        config = json.loads((hf_dir / "config.json").read_text())
        tokenizer_state = json.loads((hf_dir / "tokenizer.json").read_text())
        template = _read_chat_template(hf_dir)
        state = _load_state_dict_as_float32(hf_dir)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)

    n_head = config["num_attention_heads"]
    n_kv = config.get("num_key_value_heads") or n_head
    hidden = config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // n_head
    rope_theta = config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta") or 10000.0

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(name)
    writer.add_file_type(_FILE_TYPES[tensor_type])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(hidden)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(rope_theta))
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-6)))
    writer.add_vocab_size(config["vocab_size"])

    # tokenizer
    vocab = tokenizer_state["model"]["vocab"]
    added = {t["id"]: t for t in tokenizer_state.get("added_tokens", [])}
    size = max([*vocab.values(), *added]) + 1
    tokens = [None] * size
    for token, idx in vocab.items():
        tokens[idx] = token
    for idx, t in added.items():
        tokens[idx] = t["content"]
    if any(t is None for t in tokens):
        raise ValueError("tokenizer ids are not dense")
    token_types = [
        int(gguf.TokenType.CONTROL) if idx in added and added[idx].get("special") else int(gguf.TokenType.NORMAL)
        for idx in range(size)
    ]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer_state["model"].get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(merges)
    token_id = {t: i for i, t in enumerate(tokens)}
    writer.add_bos_token_id(token_id.get(BOS_TOKEN, BOS_ID))
    writer.add_eos_token_id(token_id.get(EOS_TOKEN, EOS_ID))
    writer.add_unk_token_id(token_id.get(UNK_TOKEN, UNK_ID))
    writer.add_pad_token_id(token_id.get(PAD_TOKEN, PAD_ID))
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    if template:
        writer.add_chat_template(template)

    # tensors, in llama.cpp's order
    def order(item):
        gname = item[0]
        if gname == "token_embd.weight":
            return (0, 0, gname)
        if gname.startswith("blk."):
            return (1, int(gname.split(".")[1]), gname)
        return (2, 0, gname)

    converted = []
    for hf_name, weights in state.items():
        if hf_name.endswith("rotary_emb.inv_freq"):
            continue
        if hf_name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue
        gname = hf_to_gguf_name(hf_name)
        if gname.endswith("attn_q.weight"):
            weights = _permute(weights, n_head, n_head)
        elif gname.endswith("attn_k.weight"):
            weights = _permute(weights, n_head, n_kv)
        converted.append((gname, np.ascontiguousarray(weights)))

    for gname, weights in sorted(converted, key=order):
        if weights.ndim <= 1 or tensor_type == "F32":
            writer.add_tensor(gname, weights.astype(np.float32))
        elif tensor_type == "F16":
            writer.add_tensor(gname, weights.astype(np.float16))
        else:
            qtype = gguf.GGMLQuantizationType.Q8_0
            data = gguf.quants.quantize(weights.astype(np.float32), qtype)
            writer.add_tensor(gname, data, raw_shape=data.shape, raw_dtype=qtype)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _read_chat_template(hf_dir: Path) -> str | None:
    jinja = hf_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    cfg = hf_dir / "tokenizer_config.json"
    if cfg.is_file():
        template = json.loads(cfg.read_text()).get("chat_template")
        if isinstance(template, str):
            return template
    return None


def _load_state_dict_as_float32(hf_dir: Path) -> dict:
    """All tensors of the directory's safetensors files, as float32 numpy arrays (bf16 via torch)."""
    from safetensors import safe_open

    state = {}
    for file in sorted(hf_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                state[key] = f.get_tensor(key).float().numpy()
    if not state:
        raise FileNotFoundError(f"no .safetensors weights in {hf_dir}")
    return state


def copy_model_dir(src, dst) -> Path:
    """Copy a model directory (handy to mutate a copy, e.g. add a quantization config)."""
    return Path(shutil.copytree(src, dst))


# --------------------------------------------------------------------------------------------
# pytest fixtures (import them into a test module: ``from tests.support.tiny_models import tiny_hf_dir``)
# --------------------------------------------------------------------------------------------

try:
    import pytest
except ImportError:  # pragma: no cover - builders are usable without pytest
    pytest = None

if pytest is not None:

    @pytest.fixture(scope="session")
    def tiny_hf_dir(tmp_path_factory) -> Path:
        """A session-wide tiny float32 HF Llama directory (default arguments). Do not modify it."""
        return build_tiny_llama_hf(tmp_path_factory.mktemp("tiny-hf") / "tiny-llama")

    @pytest.fixture(scope="session")
    def tiny_gguf_file(tmp_path_factory, tiny_hf_dir) -> Path:
        """A session-wide tiny F16 GGUF holding the weights of ``tiny_hf_dir``. Do not modify it."""
        return build_tiny_llama_gguf(
            tmp_path_factory.mktemp("tiny-gguf") / "tiny-llama-F16.gguf", hf_dir=tiny_hf_dir, tensor_type="F16"
        )
