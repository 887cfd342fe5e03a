"""Will a deployment fit: Mixture-of-Experts, MLA and quantized weights across TP / DP / EP (pure functions).

:mod:`models_registry.capacity` sizes one model on ``num_devices`` as a sum of weights; this module sizes a
``vllm serve`` deployment *per device*, from the model's Hugging Face ``config.json`` (a dict; a multimodal
config's ``text_config`` is merged over it, as :mod:`models_registry.inspection` does).

Parameters (:func:`param_breakdown`), by kind, SwiGLU MLPs (gate, up, down = 3 x hidden x width):

    embedding       vocab x hidden                     lm_head   vocab x hidden, 0 when tie_word_embeddings
    attention       GQA: q_proj + o_proj = 2 x hidden x heads x head_dim; attention_kv: k_proj + v_proj =
                    2 x hidden x kv_heads x head_dim.  MLA (kv_lora_rank in the config, DeepSeek-V2/V3/R1):
                    q_b_proj q_lora_rank x heads x (qk_nope + qk_rope) (or q_proj from hidden without
                    q_lora_rank), kv_b_proj kv_lora_rank x heads x (qk_nope + v_head_dim), o_proj
                    heads x v_head_dim x hidden; replicated_linear: q_a_proj hidden x q_lora_rank and
                    kv_a_proj_with_mqa hidden x (kv_lora_rank + qk_rope)
    dense_mlp       3 x hidden x intermediate_size, on each layer that is not MoE
    routed_experts  experts x 3 x hidden x moe_intermediate_size on each MoE layer (n_routed_experts /
                    num_experts / num_local_experts; moe_intermediate_size defaults to intermediate_size)
    shared_experts  n_shared_experts x 3 x hidden x moe_intermediate_size (or shared_expert_intermediate_size)
    router          hidden x experts per MoE layer;  norms: 2 x hidden per layer (+ the MLA q_a / kv_a
                    norms) + the final norm.  Biases and per-head q/k norms are left out (< 0.01 %).

A layer is MoE when the model has experts and, DeepSeek-style (first_k_dense_replace / moe_layer_freq in
the config), ``layer >= first_k_dense_replace and layer % moe_layer_freq == 0``; Qwen-style, ``layer`` is not
in mlp_only_layers and ``(layer + 1) % decoder_sparse_step == 0``.  ``param_count`` is the main model;
``active_param_count`` counts num_experts_per_tok of the routed experts (everything else is active,
embeddings included).  MTP: each of num_nextn_predict_layers is one more decoder layer (index
num_hidden_layers + i) + eh_proj 2 x hidden x hidden (replicated) + 3 norms; it shares the embedding and
lm_head with the main model (vLLM does), and is counted only when loaded (``speculative_tokens`` > 0 on a
config with MTP layers, vllm-ascend's ``--speculative-config '{"method": "mtp"}'``).

Bytes per parameter (:data:`LINEAR_BYTES`): linear weights (attention, MLPs, experts) take 2 in bf16/fp16,
1 in W8A8 / W8A8_DYNAMIC, 0.5 in W4A8 and W4A4; embedding, lm_head, norms and the router stay 2 bytes
(msModelSlim leaves them float).  Quantization scales and offsets (per output channel) are left out
(< 0.3 %).

Per device, with TP = tensor_parallel_size, DP = data_parallel_size (every DP rank holds a full copy of
the non-expert weights):

    embedding, lm_head, attention, dense_mlp, shared_experts   / TP
    attention_kv     x max(1, kv_heads // TP) / kv_heads   (KV heads are replicated when TP > kv_heads)
    norms, router, replicated_linear                          whole on every device
    routed_experts   with --enable-expert-parallel: EP = TP x DP ranks, ceil(experts / EP) whole experts
                     each; without it vLLM shards them over the same flattened TP x DP group: / (TP x DP)

KV cache per token per device (:func:`kv_bytes_per_token_from_config`), x kv_cache_dtype_bytes:
GQA layers x max(1, kv_heads // TP) x head_dim x 2 (K and V); MLA layers x (kv_lora_rank +
qk_rope_head_dim) -- one compressed latent per token per layer, not per head, and vLLM keeps it whole on
every TP rank (DeepSeek-V3: 61 x 576 x 2 = 70,272 bytes in bf16).  Loaded MTP layers add their own.
Sliding-window layers are sized as full attention.

:func:`deployment_capacity`, per device (the device with the most experts when they do not divide):

    usable       = device_memory_gib x GiB x gpu_memory_utilization
    overhead     = 1 GiB + 5 % of the device's weight bytes   (capacity.default_overhead_bytes)
    kv_room      = usable - weights - overhead
    kv_tokens    = floor(kv_room / (kv_bytes_per_token x 128)) x 128   -- per DP rank: each of its TP
                   devices holds its share of every token of that rank's sequences
    fits         = TP x DP <= devices_per_node x nodes  and  kv_tokens >= max_model_len

(vLLM refuses to start when one sequence of max_model_len does not fit; max_num_seqs, per DP rank, only
caps how many run at once: ``concurrent_full_length_seqs`` says how many full-length ones fit.)  A draft
model other than MTP (eagle3...) is not sized.
"""

from __future__ import annotations

import math

from models_registry.capacity import DEFAULT_BLOCK_SIZE, GiB, default_overhead_bytes

__all__ = [
    "FLOAT_KINDS",
    "LINEAR_BYTES",
    "deployment_capacity",
    "kv_bytes_per_token_from_config",
    "model_shape",
    "param_breakdown",
    "weight_bytes_for_scheme",
    "weights_per_device",
]

# Bytes per linear-layer weight, by quantization scheme (embedding, lm_head, norms, router stay 2).
LINEAR_BYTES = {"bf16": 2, "fp16": 2, "w8a8": 1, "w8a8_dynamic": 1, "w4a8": 0.5, "w4a4": 0.5}
FLOAT_BYTES = 2
FLOAT_KINDS = frozenset({"embedding", "lm_head", "norms", "router"})
KINDS = (
    "embedding",
    "lm_head",
    "norms",
    "router",
    "attention",
    "attention_kv",
    "replicated_linear",
    "dense_mlp",
    "shared_experts",
    "routed_experts",
)


def _text(hf_config: dict) -> dict:
    if not isinstance(hf_config, dict):
        raise TypeError("hf_config must be a dict (the model's config.json)")
    text = hf_config.get("text_config")
    if isinstance(text, dict):  # multimodal: the language model's shape
        return {**hf_config, **{k: v for k, v in text.items() if v is not None}}
    return hf_config


def _int(c: dict, *keys: str, default: int | None = None) -> int | None:
    for k in keys:
        v = c.get(k)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return default


def model_shape(hf_config: dict) -> dict:
    """The numbers the estimate needs, read from an HF config (aliases resolved, defaults applied).

    Raises ValueError when hidden_size, num_hidden_layers, vocab_size or num_attention_heads is missing.
    """
    c = _text(hf_config)
    s = {
        "hidden": _int(c, "hidden_size", "n_embd", "d_model"),
        "layers": _int(c, "num_hidden_layers", "n_layer", "num_layers"),
        "vocab": _int(c, "vocab_size", "padded_vocab_size"),
        "heads": _int(c, "num_attention_heads", "n_head"),
    }
    missing = [k for k, v in s.items() if not v]
    if missing:
        raise ValueError(f"cannot size the model: {', '.join(missing)} missing from the config")
    s["kv_heads"] = _int(c, "num_key_value_heads", "num_kv_heads", default=s["heads"])
    s["head_dim"] = _int(c, "head_dim", default=s["hidden"] // s["heads"])
    s["intermediate"] = _int(c, "intermediate_size", "ffn_hidden_size", default=4 * s["hidden"])
    s["tied"] = bool(c.get("tie_word_embeddings", False))
    s["experts"] = _int(c, "n_routed_experts", "num_experts", "num_local_experts", default=0)
    s["top_k"] = _int(c, "num_experts_per_tok", "moe_topk", "num_experts_per_token", default=0)
    s["moe_intermediate"] = _int(c, "moe_intermediate_size", default=s["intermediate"])
    shared_width = _int(c, "shared_expert_intermediate_size")
    n_shared = _int(c, "n_shared_experts", default=0)
    s["shared_intermediate"] = shared_width if shared_width else n_shared * s["moe_intermediate"]
    deepseek_style = "first_k_dense_replace" in c or "moe_layer_freq" in c
    first_dense = _int(c, "first_k_dense_replace", default=0)
    freq = _int(c, "moe_layer_freq", default=1) or 1
    step = _int(c, "decoder_sparse_step", default=1) or 1
    mlp_only = set(c.get("mlp_only_layers") or [])

    def is_moe(i: int) -> bool:
        if not s["experts"]:
            return False
        if deepseek_style:
            return i >= first_dense and i % freq == 0
        return i not in mlp_only and (i + 1) % step == 0

    s["mtp_layers"] = _int(c, "num_nextn_predict_layers", default=0)
    s["moe_layer_flags"] = [is_moe(i) for i in range(s["layers"] + s["mtp_layers"])]
    s["mla"] = _int(c, "kv_lora_rank") is not None
    if s["mla"]:
        s["kv_lora_rank"] = _int(c, "kv_lora_rank")
        s["q_lora_rank"] = _int(c, "q_lora_rank")
        s["qk_rope"] = _int(c, "qk_rope_head_dim", default=64)
        s["qk_nope"] = _int(c, "qk_nope_head_dim", default=128)
        s["v_head_dim"] = _int(c, "v_head_dim", default=s["qk_nope"])
    s["max_position_embeddings"] = _int(c, "max_position_embeddings", "max_sequence_length", "seq_length")
    return s


def _layer_params(s: dict, moe: bool) -> dict:
    """Parameters of one decoder layer, by kind."""
    h, heads = s["hidden"], s["heads"]
    p = dict.fromkeys(KINDS, 0)
    p["norms"] = 2 * h
    if s["mla"]:
        qk = s["qk_nope"] + s["qk_rope"]
        if s["q_lora_rank"]:
            p["replicated_linear"] += h * s["q_lora_rank"]
            p["attention"] += s["q_lora_rank"] * heads * qk
            p["norms"] += s["q_lora_rank"]
        else:
            p["attention"] += h * heads * qk
        p["replicated_linear"] += h * (s["kv_lora_rank"] + s["qk_rope"])
        p["norms"] += s["kv_lora_rank"]
        p["attention"] += s["kv_lora_rank"] * heads * (s["qk_nope"] + s["v_head_dim"])
        p["attention"] += heads * s["v_head_dim"] * h
    else:
        p["attention"] = 2 * h * heads * s["head_dim"]
        p["attention_kv"] = 2 * h * s["kv_heads"] * s["head_dim"]
    if moe:
        p["routed_experts"] = s["experts"] * 3 * h * s["moe_intermediate"]
        p["shared_experts"] = 3 * h * s["shared_intermediate"]
        p["router"] = h * s["experts"]
    else:
        p["dense_mlp"] = 3 * h * s["intermediate"]
    return p


def _add(a: dict, b: dict) -> dict:
    return {k: a.get(k, 0) + b.get(k, 0) for k in KINDS}


def param_breakdown(hf_config: dict) -> dict:
    """Parameter counts of the model (formula: module docstring).

    Returns ``param_count`` (main model, MTP layers excluded), ``active_param_count``,
    ``mtp_param_count``, ``by_kind`` and ``mtp_by_kind`` (dicts kind -> count), ``is_moe``, ``is_mla``,
    ``num_experts``, ``experts_per_token``, ``num_moe_layers``, ``num_dense_layers``, ``num_mtp_layers``.
    """
    s = model_shape(hf_config)
    main = dict.fromkeys(KINDS, 0)
    main["embedding"] = s["vocab"] * s["hidden"]
    main["lm_head"] = 0 if s["tied"] else s["vocab"] * s["hidden"]
    main["norms"] = s["hidden"]  # the final norm
    flags = s["moe_layer_flags"]
    for i in range(s["layers"]):
        main = _add(main, _layer_params(s, flags[i]))
    mtp = dict.fromkeys(KINDS, 0)
    for j in range(s["mtp_layers"]):
        mtp = _add(mtp, _layer_params(s, flags[s["layers"] + j]))
        mtp["replicated_linear"] += 2 * s["hidden"] * s["hidden"]  # eh_proj
        mtp["norms"] += 3 * s["hidden"]  # enorm, hnorm, shared_head.norm
    total = sum(main.values())
    active = total
    if s["experts"] and s["top_k"]:
        active -= main["routed_experts"] - main["routed_experts"] * min(s["top_k"], s["experts"]) // s["experts"]
    n_moe = sum(flags[: s["layers"]])
    return {
        "param_count": total,
        "active_param_count": active,
        "mtp_param_count": sum(mtp.values()),
        "by_kind": main,
        "mtp_by_kind": mtp,
        "is_moe": n_moe > 0,
        "is_mla": s["mla"],
        "num_experts": s["experts"],
        "experts_per_token": s["top_k"],
        "num_moe_layers": n_moe,
        "num_dense_layers": s["layers"] - n_moe,
        "num_mtp_layers": s["mtp_layers"],
    }


def _scheme(quantization: str) -> str:
    q = str(quantization).lower().replace("-", "_")
    if q not in LINEAR_BYTES:
        raise ValueError(f"unknown quantization {quantization!r}: expected one of {', '.join(LINEAR_BYTES)}")
    return q


def _bytes_per_param(kind: str, scheme: str) -> float:
    return FLOAT_BYTES if kind in FLOAT_KINDS else LINEAR_BYTES[scheme]


def weight_bytes_for_scheme(hf_config: dict, quantization: str, *, include_mtp: bool = False) -> int:
    """Bytes of the whole model's weights under ``quantization`` ("bf16", "fp16", "w8a8", "w8a8_dynamic",
    "w4a8", "w4a4"); MTP layers only with ``include_mtp``."""
    scheme = _scheme(quantization)
    b = param_breakdown(hf_config)
    kinds = _add(b["by_kind"], b["mtp_by_kind"]) if include_mtp else b["by_kind"]
    return int(sum(n * _bytes_per_param(k, scheme) for k, n in kinds.items()))


def weights_per_device(
    hf_config: dict,
    quantization: str,
    *,
    tensor_parallel_size: int = 1,
    data_parallel_size: int = 1,
    enable_expert_parallel: bool = False,
    include_mtp: bool = False,
) -> dict:
    """Weight bytes on one device of a TP x DP deployment (sharding rules: module docstring).

    Returns ``bytes`` (int), ``by_kind`` (kind -> bytes), ``expert_parallel_size`` (TP x DP with expert
    parallelism on an MoE model, else 1) and ``experts_per_device`` (whole experts per device under EP,
    else None).
    """
    scheme = _scheme(quantization)
    tp, dp = int(tensor_parallel_size), int(data_parallel_size)
    if tp < 1 or dp < 1:
        raise ValueError("tensor_parallel_size and data_parallel_size must be at least 1")
    s = model_shape(hf_config)
    b = param_breakdown(hf_config)
    kinds = _add(b["by_kind"], b["mtp_by_kind"]) if include_mtp else b["by_kind"]
    ep = tp * dp if enable_expert_parallel and b["is_moe"] else 1
    experts_here = math.ceil(s["experts"] / ep) if ep > 1 else None
    share = {
        "embedding": 1 / tp,
        "lm_head": 1 / tp,
        "attention": 1 / tp,
        "dense_mlp": 1 / tp,
        "shared_experts": 1 / tp,
        "attention_kv": max(1, s["kv_heads"] // tp) / s["kv_heads"],
        "norms": 1,
        "router": 1,
        "replicated_linear": 1,
        "routed_experts": experts_here / s["experts"] if experts_here else 1 / (tp * dp),
    }
    by_kind = {k: int(n * share[k] * _bytes_per_param(k, scheme)) for k, n in kinds.items()}
    return {
        "bytes": sum(by_kind.values()),
        "by_kind": by_kind,
        "expert_parallel_size": ep,
        "experts_per_device": experts_here,
    }


def kv_bytes_per_token_from_config(
    hf_config: dict,
    kv_cache_dtype_bytes: float = 2,
    *,
    tensor_parallel_size: int | None = None,
    include_mtp: bool = False,
) -> int:
    """Bytes of KV cache one token takes (formula: module docstring).

    ``tensor_parallel_size`` None: the whole model's cache (for GQA the same number as
    :func:`models_registry.inspection.kv_bytes_per_token`); an int: what one device of a TP group holds
    (KV heads replicated when TP > kv_heads; an MLA latent is whole on every device).
    """
    if kv_cache_dtype_bytes <= 0:
        raise ValueError("kv_cache_dtype_bytes must be positive")
    s = model_shape(hf_config)
    layers = s["layers"] + (s["mtp_layers"] if include_mtp else 0)
    if s["mla"]:
        per_layer = s["kv_lora_rank"] + s["qk_rope"]
    else:
        heads = s["kv_heads"] if tensor_parallel_size is None else max(1, s["kv_heads"] // int(tensor_parallel_size))
        per_layer = heads * s["head_dim"] * 2
    return int(layers * per_layer * kv_cache_dtype_bytes)


def _gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


def deployment_capacity(
    *,
    hf_config: dict,
    quantization: str,
    device_memory_gib: float,
    devices_per_node: int,
    nodes: int,
    tensor_parallel_size: int,
    data_parallel_size: int = 1,
    enable_expert_parallel: bool = False,
    max_model_len: int,
    max_num_seqs: int,
    gpu_memory_utilization: float = 0.9,
    kv_cache_dtype_bytes: int = 2,
    speculative_tokens: int = 0,
) -> dict:
    """Does a ``vllm serve`` deployment fit (pure arithmetic; formula: module docstring).

    ``quantization``: "bf16", "fp16", "w8a8", "w8a8_dynamic", "w4a8" or "w4a4".  ``device_memory_gib``
    per device (an Atlas A2 910B or an A3 die: 64).  ``speculative_tokens`` > 0 on a config with
    num_nextn_predict_layers loads the MTP layers (weights and KV).

    Returns ``fits``; ``weights_per_device_gib``, ``kv_room_gib_per_device`` (negative: the shortfall),
    ``kv_tokens_per_dp_rank``, ``needed_devices`` (TP x DP), ``available_devices``, ``param_count``,
    ``active_param_count``, ``mtp_param_count``, ``includes_mtp``, ``weight_bytes_per_device``,
    ``weights_by_kind`` (bytes per device), ``overhead_bytes_per_device``, ``usable_bytes_per_device``,
    ``kv_room_bytes_per_device``, ``kv_bytes_per_token_per_device``, ``block_size``,
    ``expert_parallel_size``, ``experts_per_device``, ``is_moe``, ``is_mla``, ``max_model_len``,
    ``max_num_seqs``, ``concurrent_full_length_seqs`` (min(max_num_seqs, kv_tokens // max_model_len)),
    ``exceeds_max_position_embeddings`` (the config's limit; a rope override can lift it),
    ``tp_spans_nodes``, ``quantization`` and ``summary``, one sentence.
    """
    scheme = _scheme(quantization)
    tp, dp = int(tensor_parallel_size), int(data_parallel_size)
    checks = (
        (tp >= 1 and dp >= 1, "tensor_parallel_size and data_parallel_size must be at least 1"),
        (devices_per_node >= 1 and nodes >= 1, "devices_per_node and nodes must be at least 1"),
        (device_memory_gib > 0, "device_memory_gib must be positive"),
        (0 < gpu_memory_utilization <= 1, "gpu_memory_utilization must be in (0, 1]"),
        (max_model_len >= 1 and max_num_seqs >= 1, "max_model_len and max_num_seqs must be at least 1"),
        (kv_cache_dtype_bytes > 0, "kv_cache_dtype_bytes must be positive"),
        (speculative_tokens >= 0, "speculative_tokens must not be negative"),
    )
    for ok, message in checks:
        if not ok:
            raise ValueError(message)

    params = param_breakdown(hf_config)
    include_mtp = speculative_tokens > 0 and params["num_mtp_layers"] > 0
    w = weights_per_device(
        hf_config,
        scheme,
        tensor_parallel_size=tp,
        data_parallel_size=dp,
        enable_expert_parallel=enable_expert_parallel,
        include_mtp=include_mtp,
    )
    kv_per_token = kv_bytes_per_token_from_config(
        hf_config, kv_cache_dtype_bytes, tensor_parallel_size=tp, include_mtp=include_mtp
    )
    weights = w["bytes"]
    usable = int(device_memory_gib * GiB * gpu_memory_utilization)
    overhead = default_overhead_bytes(weights, 1)
    room = usable - weights - overhead
    block = DEFAULT_BLOCK_SIZE
    kv_tokens = room // (kv_per_token * block) * block if room > 0 else 0
    needed, available = tp * dp, devices_per_node * nodes
    fits = needed <= available and kv_tokens >= max_model_len
    concurrent = min(max_num_seqs, kv_tokens // max_model_len)
    max_pos = model_shape(hf_config)["max_position_embeddings"]

    layout = f"DP{dp} x TP{tp}" + (f" with EP{w['expert_parallel_size']}" if w["expert_parallel_size"] > 1 else "")
    experts = f" ({w['experts_per_device']} of {params['num_experts']} experts each)" if w["experts_per_device"] else ""
    where = f"{needed} x {device_memory_gib:g} GiB devices at {gpu_memory_utilization:.0%}, {layout}"
    weights_text = f"{_gib(weights)} of {scheme.upper()} weights per device{experts}"
    if needed > available:
        summary = (
            f"Does not fit: {layout} needs {needed} devices and {nodes} node(s) x {devices_per_node} have "
            f"{available} ({weights_text} on {device_memory_gib:g} GiB devices)."
        )
    elif room <= 0:
        summary = (
            f"Does not fit: {weights_text} + {_gib(overhead)} overhead need more than the {_gib(usable)} usable "
            f"on each of {where}."
        )
    elif not fits:
        summary = (
            f"Does not fit at max_model_len {max_model_len}: {weights_text} + {_gib(overhead)} overhead leave "
            f"{_gib(room)} of KV cache per device on {where} = {kv_tokens:,} tokens per DP rank "
            f"({kv_per_token:,} bytes/token/device)."
        )
    else:
        summary = (
            f"Fits: {weights_text} + {_gib(overhead)} overhead leave {_gib(room)} of KV cache per device on "
            f"{where} = {kv_tokens:,} tokens per DP rank ({kv_per_token:,} bytes/token/device), "
            f"{concurrent} of max_num_seqs {max_num_seqs} sequences of {max_model_len} tokens at once."
        )
    return {
        "fits": fits,
        "weights_per_device_gib": weights / GiB,
        "kv_room_gib_per_device": room / GiB,
        "kv_tokens_per_dp_rank": int(kv_tokens),
        "needed_devices": needed,
        "available_devices": available,
        "param_count": params["param_count"],
        "active_param_count": params["active_param_count"],
        "mtp_param_count": params["mtp_param_count"],
        "includes_mtp": include_mtp,
        "weight_bytes_per_device": weights,
        "weights_by_kind": w["by_kind"],
        "overhead_bytes_per_device": overhead,
        "usable_bytes_per_device": usable,
        "kv_room_bytes_per_device": room,
        "kv_bytes_per_token_per_device": kv_per_token,
        "block_size": block,
        "expert_parallel_size": w["expert_parallel_size"],
        "experts_per_device": w["experts_per_device"],
        "is_moe": params["is_moe"],
        "is_mla": params["is_mla"],
        "max_model_len": max_model_len,
        "max_num_seqs": max_num_seqs,
        "concurrent_full_length_seqs": concurrent,
        "exceeds_max_position_embeddings": bool(max_pos and max_model_len > max_pos),
        "tp_spans_nodes": tp > devices_per_node,
        "quantization": scheme,
        "summary": summary,
    }
