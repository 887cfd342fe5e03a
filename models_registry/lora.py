"""LoRA adapters (PEFT directories: ``adapter_config.json`` + ``adapter_model.safetensors``): what one is, read from
its config and its weights' safetensors header only, and whether it fits a base model's artifacts.

``inspect_lora_dir(path)`` returns the dict ``Artifact.inspection`` stores for a ``lora`` artifact:

``format`` "lora"; ``peft_type`` "LORA"; ``r`` and ``lora_alpha`` as the config gives them; ``rank`` the largest
rank the weights hold (``rank_pattern`` may raise some modules' rank above ``r``); ``target_modules`` the module
names the weights adapt (``q_proj``, ``down_proj``...), sorted; ``modules`` {name: {"in", "out", "rank"}}: the
input width of each module's A matrix and the output width of its B matrix, the same in every layer (an adapter
whose layers disagree is refused); ``layers`` the highest layer index adapted + 1; ``base_model_name_or_path`` and
``base_architecture`` (PEFT's ``auto_mapping.base_model_class``, when it wrote one); ``use_dora``, ``use_rslora``,
``modules_to_save``; ``dtype``, ``param_count``, ``weight_bytes``, ``size_bytes``, ``files``.

``base_mismatch(adapter, base)`` compares one inspection with a base artifact's (HF config facts: hidden size,
intermediate size, heads, layers, architecture) and says what does not fit, naming both, or "".
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

from models_registry.hf_reader import HfDirError, list_files, read_safetensors_header
from models_registry.paths import read_confined

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "LoraError", "base_mismatch", "expected_dims", "inspect_lora_dir"]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# base_model.model.<module path>.lora_A.weight (PEFT's names; lora_embedding_A for embeddings).
_TENSOR = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<which>A|B)(?:\.[^.]+)?\.weight$")
_LAYER = re.compile(r"\.layers\.(\d+)\.")
_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}
_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}


class LoraError(ValueError):
    """Not a LoRA adapter the console can read; ``str()`` names the path and what is wrong."""


def _config(root: Path) -> dict:
    path = root / ADAPTER_CONFIG
    if not path.is_file():
        raise LoraError(f"{root}: no {ADAPTER_CONFIG}, so not a PEFT adapter directory")
    try:
        config = json.loads(read_confined(path, tree=root).decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise LoraError(f"{path}: corrupt {ADAPTER_CONFIG}: {exc}") from exc
    except OSError as exc:
        raise LoraError(f"{path}: cannot read {ADAPTER_CONFIG}: {exc}") from exc
    if not isinstance(config, dict):
        raise LoraError(f"{path}: corrupt {ADAPTER_CONFIG}: expected a JSON object")
    return config


def _positive_int(config: dict, key: str, root: Path) -> int:
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise LoraError(f"{root / ADAPTER_CONFIG}: {key} must be a positive integer, got {value!r}")
    return value


def inspect_lora_dir(path) -> dict:
    """Inspect a PEFT LoRA directory (see the module docstring); LoraError for anything else."""
    root = Path(path)
    if not root.is_dir():
        raise LoraError(f"{root}: not a directory: a LoRA adapter is a PEFT directory ({ADAPTER_CONFIG} + weights)")
    config = _config(root)
    peft_type = str(config.get("peft_type") or "").upper()
    if peft_type != "LORA":
        raise LoraError(f"{root / ADAPTER_CONFIG}: peft_type is {config.get('peft_type')!r}, not LORA")
    r = _positive_int(config, "r", root)
    alpha = config.get("lora_alpha")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0:
        raise LoraError(f"{root / ADAPTER_CONFIG}: lora_alpha must be a positive number, got {alpha!r}")
    if refused := _unsupported(config):
        raise LoraError(f"{root / ADAPTER_CONFIG}: vLLM cannot serve this adapter: {'; '.join(refused)}.")
    try:
        files = list_files(root)
    except HfDirError as exc:
        raise LoraError(str(exc)) from exc
    names = [rel for rel, _ in files]
    if ADAPTER_WEIGHTS not in names:
        other = [n for n in names if n.startswith("adapter_model")]
        hint = f" ({other[0]} is there: save it with safe_serialization, as safetensors)" if other else ""
        raise LoraError(f"{root}: no {ADAPTER_WEIGHTS}{hint}")
    try:
        header = read_safetensors_header(root / ADAPTER_WEIGHTS)
    except HfDirError as exc:
        raise LoraError(str(exc)) from exc
    modules, layers, dtypes, params, weight_bytes = _read_weights(header, root / ADAPTER_WEIGHTS)
    pattern = config.get("rank_pattern") if isinstance(config.get("rank_pattern"), dict) else {}
    auto = config.get("auto_mapping") if isinstance(config.get("auto_mapping"), dict) else {}
    return {
        "format": "lora",
        "peft_type": "LORA",
        "r": r,
        "lora_alpha": alpha,
        # vLLM's own check (vllm/lora/peft_helper.py validate_legal): max(r, rank_pattern) <= max_lora_rank.
        "rank": max(r, *(v for v in pattern.values() if isinstance(v, int)), *(m["rank"] for m in modules.values())),
        "target_modules": sorted(modules),
        "modules": modules,
        "layers": layers,
        "base_model_name_or_path": str(config.get("base_model_name_or_path") or "") or None,
        "base_architecture": auto.get("base_model_class") if isinstance(auto.get("base_model_class"), str) else None,
        "use_dora": bool(config.get("use_dora")),
        "use_rslora": bool(config.get("use_rslora")),
        "modules_to_save": config.get("modules_to_save") or None,
        "dtype": dtypes.most_common(1)[0][0] if dtypes else None,
        "param_count": params,
        "weight_bytes": weight_bytes,
        "size_bytes": sum(size for _, size in files),
        "files": names,
    }


def _unsupported(config: dict) -> list[str]:
    """What vLLM 0.32 refuses to load (vllm/lora/peft_helper.py _validate_features, validate_legal), said here at
    registration instead of at a replica's start."""
    out = []
    extra = [m for m in config.get("modules_to_save") or [] if m not in ("classifier", "score")]
    if extra:
        out.append(f"modules_to_save {extra} (vLLM takes none, or classifier/score)")
    for key, what in (
        ("use_dora", "DoRA (use_dora)"),
        ("lora_bias", "LoRA bias (lora_bias)"),
        ("alora_invocation_tokens", "Activated LoRA (alora_invocation_tokens)"),
        ("layer_replication", "layer_replication"),
        ("use_bdlora", "block-diagonal LoRA (use_bdlora)"),
        ("use_qalora", "QALoRA (use_qalora)"),
    ):
        if config.get(key):
            out.append(what)
    if config.get("bias", "none") not in (None, "none"):
        out.append(f"bias {config['bias']!r} (adapter biases)")
    return out


def _read_weights(header: dict, where: Path) -> tuple[dict, int | None, Counter, int, int]:
    """({module name: {"in", "out", "rank"}}, layers, dtype counts, elements, bytes) from the weights' header."""
    seen: dict[str, dict] = {}  # full module path -> {"A": shape, "B": shape}
    dtypes: Counter = Counter()
    params = weight_bytes = 0
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if not isinstance(shape, list) or not all(isinstance(n, int) and n >= 0 for n in shape):
            raise LoraError(f"{where}: corrupt safetensors header: {key} has no shape")
        dtype = entry.get("dtype")
        count = 1
        for n in shape:
            count *= n
        params += count
        weight_bytes += count * _BYTES.get(dtype, 0)
        if dtype in _DTYPES:
            dtypes[_DTYPES[dtype]] += count
        match = _TENSOR.match(key)
        if match is None:
            continue
        if len(shape) != 2:
            raise LoraError(f"{where}: {key} has shape {shape}: a LoRA matrix has two dimensions")
        seen.setdefault(match["module"], {})[match["which"]] = shape
    if not seen:
        raise LoraError(f"{where}: no lora_A/lora_B weights: not a LoRA adapter's weights")
    modules: dict[str, dict] = {}
    layers = None
    for path, pair in sorted(seen.items()):
        if set(pair) != {"A", "B"}:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise LoraError(f"{where}: {path} has no {missing} weight")
        (rank, width_in), (width_out, rank_b) = pair["A"], pair["B"]
        if rank != rank_b:
            raise LoraError(f"{where}: {path}: lora_A has rank {rank} but lora_B {rank_b}")
        name = path.rsplit(".", 1)[-1]
        dims = {"in": width_in, "out": width_out, "rank": rank}
        if name in modules and modules[name] != dims:
            raise LoraError(f"{where}: {name} is {modules[name]} in one layer and {dims} in another ({path})")
        modules[name] = dims
        if layer := _LAYER.search(f".{path}."):
            layers = max(layers or 0, int(layer[1]) + 1)
    return modules, layers, dtypes, params, weight_bytes


def expected_dims(base: dict) -> dict[str, tuple[int, int]]:
    """{module name: (in, out)} of a base model's linear layers, from its inspection (config.json's sizes), for
    the decoder layouts vLLM's LoRA layers take (Llama, Qwen, Mistral and the like)."""
    hidden, inter = base.get("hidden_size"), base.get("intermediate_size")
    heads, kv, head_dim = base.get("num_attention_heads"), base.get("num_kv_heads"), base.get("head_dim")
    dims: dict[str, tuple[int, int]] = {}
    if hidden and heads and head_dim:
        q = heads * head_dim
        kv_width = (kv or heads) * head_dim
        dims |= {"q_proj": (hidden, q), "k_proj": (hidden, kv_width), "v_proj": (hidden, kv_width)}
        dims |= {"o_proj": (q, hidden), "qkv_proj": (hidden, q + 2 * kv_width)}
    if hidden and inter:
        dims |= {"gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    return dims


def base_mismatch(adapter: dict, base: dict, *, adapter_name: str, base_name: str) -> str:
    """Why the adapter (its inspection) does not fit the base (an artifact's inspection), naming both, or ""."""
    want, have = adapter.get("base_architecture"), base.get("architecture")
    if want and have and want != have:
        return f"{adapter_name} was made for a {want} base (adapter_config.json), but {base_name} is a {have}."
    layers, base_layers = adapter.get("layers"), base.get("num_layers")
    if layers and base_layers and layers > base_layers:
        return f"{adapter_name} adapts {layers} layers, but {base_name} has {base_layers}."
    dims = expected_dims(base)
    for name, module in sorted((adapter.get("modules") or {}).items()):
        if name not in dims:
            return (
                f"{adapter_name} adapts {name}, which the console cannot check against {base_name} "
                f"(it checks {', '.join(sorted(dims)) or 'nothing: the base has no sizes in its config'})."
            )
        width_in, width_out = dims[name]
        if (module["in"], module["out"]) != (width_in, width_out):
            return (
                f"{adapter_name}'s {name} maps {module['in']} → {module['out']} "
                f"(lora_A {module['rank']}×{module['in']},"
                f" lora_B {module['out']}×{module['rank']}), but {base_name}'s {name} maps {width_in} → {width_out}"
                f" (hidden_size {base.get('hidden_size')}, intermediate_size {base.get('intermediate_size')})."
            )
    return ""
