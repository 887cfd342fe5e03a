"""GGUF -> Hugging Face safetensors (bf16/fp16), tokenizer, chat template, generation config.

Dense llama/mistral/qwen2/qwen3 GGUFs are dequantized tensor by tensor (large ones in slices)
straight into the output files, with transformers' own name mapping and tensor processors; other
architectures transformers supports are loaded whole with ``from_pretrained(gguf_file=...,
quantization_config=GgufConfig(dequantize=True))`` and saved with ``save_pretrained``.  The header
is read by :mod:`models_registry.gguf_reader`."""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path
from typing import Any, NamedTuple

from models_registry.convert.common import (
    CHUNK_BYTES,
    DEFAULT_MAX_SHARD_BYTES,
    TORCH_TO_ST,
    ConversionError,
    first_line,
    normalize_dtype,
    prepare_out_dir,
    read_hf_config,
    set_config_dtype,
    torch_dtype_of,
    transformers_version,
)
from models_registry.convert.progress import ProgressFn, clamped_progress, transformers_progress
from models_registry.convert.shards import ShardWriter
from models_registry.convert.sources import SafetensorsSource
from models_registry.gguf_reader import GgufHeaderError, NotGgufError, read_gguf_header
from models_registry.paths import open_confined, tree_size

# Dense GGUF architectures whose transformers tensor processor is a pure per-tensor function:
# these are streamed (tensor by tensor) instead of loading the whole model.  Anything else that
# transformers supports goes through from_pretrained + save_pretrained.
STREAMING_GGUF_ARCHS = frozenset({"llama", "qwen2", "qwen3"})

# ----------------------------------------------------------------------------------------------
# 1. GGUF -> Hugging Face
# ----------------------------------------------------------------------------------------------


class GgufTensor(NamedTuple):
    name: str
    dims: tuple[int, ...]  # ggml order (fastest-moving first)
    qtype: int
    offset: int  # absolute, in the file
    nbytes: int

    @property
    def n_elements(self) -> int:
        return math.prod(self.dims)


class GgufHeader(NamedTuple):
    metadata: dict
    tensors: list[GgufTensor]
    file_size: int


def open_gguf(src: Path) -> GgufHeader:
    """A GGUF file's metadata and tensor table (no tensor data), checked complete and convertible."""
    import gguf

    src = Path(src)
    if not src.is_file():
        raise ConversionError(f"GGUF file {src} does not exist.")
    try:
        header = read_gguf_header(src)
    except NotGgufError:
        raise ConversionError(f"{src.name} is not a GGUF file (it does not start with the GGUF magic bytes).") from None
    except GgufHeaderError as exc:
        reason = str(exc).removeprefix(f"{src}: ")
        raise ConversionError(f"{src.name} is a truncated or corrupt GGUF file: {reason}.") from exc
    if header["version"] not in (2, 3):
        raise ConversionError(f"{src.name} is GGUF version {header['version']}; only versions 2 and 3 are supported.")
    size = header["file_size"]
    tensors = []
    for entry in header["tensors"]:
        start = header["data_offset"] + entry["offset"]
        end = start + entry["n_bytes"]
        if end > size:
            raise ConversionError(
                f"{src.name} is a truncated GGUF file: tensor {entry['name']} ends at byte {end} "
                f"but the file has {size} bytes."
            )
        qtype = gguf.GGMLQuantizationType[entry["type"]].value
        tensors.append(GgufTensor(entry["name"], tuple(reversed(entry["shape"])), qtype, start, entry["n_bytes"]))
    metadata = header["metadata"]
    if not metadata.get("general.architecture"):
        raise ConversionError(f"{src.name} has no general.architecture metadata: it is not a model file.")
    parts = metadata.get("split.count")
    if isinstance(parts, int) and parts > 1:
        raise ConversionError(
            f"{src.name} is part of a split GGUF ({parts} files); merge the parts first "
            f"(llama-gguf-split --merge) and convert the merged file."
        )
    return GgufHeader(metadata, tensors, size)


def gguf_meta_summary(header: GgufHeader) -> dict:
    import gguf

    md = header.metadata
    types: dict[str, int] = {}
    for t in header.tensors:
        tname = gguf.GGMLQuantizationType(t.qtype).name
        types[tname] = types.get(tname, 0) + 1
    quantized = {k: v for k, v in types.items() if k not in ("F32",)} or types
    main_type = max(quantized, key=quantized.get) if quantized else None
    template = md.get("tokenizer.chat_template")
    return {
        "architecture": str(md["general.architecture"]),
        "name": md.get("general.name"),
        "tensor_types": types,
        "quantization": main_type,
        "has_tokenizer": "tokenizer.ggml.model" in md and bool(md.get("tokenizer.ggml.tokens")),
        "chat_template": template if isinstance(template, str) and template.strip() else None,
        "add_bos": md.get("tokenizer.ggml.add_bos_token"),
        "add_eos": md.get("tokenizer.ggml.add_eos_token"),
        "special_ids": {
            key: md.get(f"tokenizer.ggml.{gguf_key}")
            for key, gguf_key in (
                ("bos", "bos_token_id"),
                ("eos", "eos_token_id"),
                ("unk", "unknown_token_id"),
                ("pad", "padding_token_id"),
            )
        },
    }


def _check_gguf_architecture(arch: str) -> None:
    from transformers.integrations.gguf import GGUF_ARCHS
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    supported = set(GGUF_SUPPORTED_ARCHITECTURES) | set(GGUF_ARCHS)
    # transformers renames a few (e.g. qwen2moe -> qwen2_moe) before checking
    aliases = {arch, arch.replace("moe", "_moe"), arch.replace("-", "_")}
    if not aliases & supported:
        raise ConversionError(
            f"Unsupported architecture: GGUF architecture '{arch}' cannot be converted by transformers "
            f"{transformers_version()} (supported: {', '.join(sorted(supported))})."
        )


def _load_gguf_config(src: Path):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(src.parent), gguf_file=src.name)
    except Exception as exc:  # noqa: BLE001
        raise ConversionError(
            f"transformers cannot read the model configuration from {src.name}: {first_line(exc)}"
        ) from exc


def _tied_groups(model, state: dict) -> list[list[str]]:
    """State-dict names grouped by the parameter they alias (tied weights share one group)."""
    groups: dict[int, list[str]] = {}
    for name, tensor in state.items():
        obj = tensor
        with contextlib.suppress(AttributeError):
            obj = model.get_parameter_or_buffer(name)
        groups.setdefault(id(obj), []).append(name)
    return list(groups.values())


def _gguf_array(raw, qtype: int, dims: tuple[int, ...]):
    """The raw bytes of one tensor as the array ``gguf.dequantize`` expects (gguf-py's reader layout)."""
    import gguf
    import numpy as np

    shape = tuple(reversed(dims))
    kind = gguf.GGMLQuantizationType(qtype)
    if kind == gguf.GGMLQuantizationType.F32:
        return raw.view(np.float32).reshape(shape)
    if kind == gguf.GGMLQuantizationType.F16:
        return raw.view(np.float16).reshape(shape)
    if kind.name.startswith("I") or kind == gguf.GGMLQuantizationType.F64:
        raise ValueError(f"{kind.name} tensors are not model weights")
    return raw.reshape(gguf.quants.quant_shape_to_byte_shape(shape, kind))


class _TopLevelOnly:
    """What ``get_gguf_hf_weights_map`` reads of a model, without submodules to recurse into."""

    def __init__(self, model, state):
        self.config = model.config
        self._state = state

    def state_dict(self):
        return self._state

    def named_children(self):
        return []


def _processor_leaves_alone(processor, name: str, key_map: dict, cfg_dict: dict) -> bool:
    """Whether transformers' tensor processor passes this tensor through untouched (probed on a dummy)."""
    import numpy as np

    probe = np.zeros((4, 4), dtype=np.float32)
    try:
        result = processor.process(
            weights=probe, name=name, tensor_key_mapping=key_map, parsed_parameters={"config": cfg_dict, "tensors": {}}
        )
    except Exception:  # noqa: BLE001 - it wanted to reshape the dummy: it does something to this tensor
        return False
    return result.weights is probe and result.name == name


def _gguf_stream_weights(
    src: Path,
    header: GgufHeader,
    arch: str,
    config,
    torch_dtype,
    out_dir: Path,
    report: ProgressFn,
    lo: float,
    hi: float,
    max_shard_bytes: int,
) -> dict:
    """Dequantize GGUF tensors one at a time into safetensors shards, with transformers' own name
    mapping and tensor processor (the same steps as its legacy GGUF loader, without holding the model)."""
    import gguf
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    with torch.device("meta"):
        meta_model = AutoModelForCausalLM.from_config(config)
    cfg_dict = config.to_dict()
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=cfg_dict)
    state = meta_model.state_dict()
    groups = _tied_groups(meta_model, state)
    # transformers' mapper recurses into every submodule (seconds per call); the top level is enough
    # for these architectures, and the full walk remains the fallback.
    key_map = get_gguf_hf_weights_map(_TopLevelOnly(meta_model, state), processor)
    if any(not set(key_map.values()).intersection(g) for g in groups):
        key_map = get_gguf_hf_weights_map(meta_model, processor)
    class_name = meta_model.__class__.__name__
    del meta_model

    st_dtype = TORCH_TO_ST[str(torch_dtype).removeprefix("torch.")]
    plan, jobs, skipped = [], [], []
    for t in header.tensors:
        hf_name = key_map.get(t.name)
        if hf_name is None or hf_name not in state:
            skipped.append(t.name)
            continue
        shape = tuple(state[hf_name].shape)
        if math.prod(shape) != t.n_elements:
            raise ConversionError(
                f"GGUF tensor {t.name} has {t.n_elements} values but {hf_name} needs shape "
                f"{shape}: the file does not match its own metadata."
            )
        plan.append((hf_name, st_dtype, shape))
        jobs.append((t, hf_name))
    written = {p[0] for p in plan}
    missing = [g[0] for g in groups if not written.intersection(g)]
    if missing:
        raise ConversionError(
            f"The GGUF file lacks tensors the {class_name} model needs: "
            f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}."
        )

    writer = ShardWriter(out_dir, plan, max_shard_bytes=max_shard_bytes)
    total = writer.total_bytes or 1
    done = 0
    parsed = {"config": cfg_dict, "tensors": {}}

    def read(fh, offset: int, nbytes: int, what: str):
        fh.seek(offset)
        raw = np.empty(nbytes, dtype=np.uint8)
        if fh.readinto(memoryview(raw)) != nbytes:
            raise ConversionError(f"{src.name} is truncated: tensor {what} is incomplete.")
        return raw

    def dequantize(raw, t: GgufTensor, dims: tuple[int, ...]):
        kind = gguf.GGMLQuantizationType(t.qtype)
        try:
            return gguf.dequantize(_gguf_array(raw, t.qtype, dims), kind)
        except Exception as exc:  # noqa: BLE001
            raise ConversionError(f"Cannot dequantize tensor {t.name} ({kind.name}): {first_line(exc)}") from exc

    def row_chunks(fh, t: GgufTensor, shape: tuple[int, ...]):
        """Large tensors the processor leaves alone: dequantize a slab of rows at a time."""
        rows = shape[0]
        row_bytes, row_elems = t.nbytes // rows, t.n_elements // rows
        step = max(1, CHUNK_BYTES // (4 * row_elems))
        for start in range(0, rows, step):
            n = min(step, rows - start)
            values = dequantize(read(fh, t.offset + start * row_bytes, n * row_bytes, t.name), t, t.dims[:-1] + (n,))
            yield torch.from_numpy(np.ascontiguousarray(values)).reshape((n, *shape[1:])).to(torch_dtype)

    try:
        with open_confined(src, tree=src.parent) as fh:
            for i, (t, hf_name) in enumerate(jobs):
                report(lo + (hi - lo) * done / total, f"dequantizing {t.name} ({i + 1}/{len(jobs)})")
                shape = plan[i][2]
                if (
                    t.n_elements * 4 > CHUNK_BYTES
                    and len(shape) >= 2
                    and shape == tuple(reversed(t.dims))
                    and _processor_leaves_alone(processor, t.name, key_map, cfg_dict)
                ):
                    done += writer.write_rows(hf_name, row_chunks(fh, t, shape))
                    continue
                values = dequantize(read(fh, t.offset, t.nbytes, t.name), t, t.dims)
                result = processor.process(
                    weights=values, name=t.name, tensor_key_mapping=key_map, parsed_parameters=parsed
                )
                if key_map.get(result.name) != hf_name:
                    raise ConversionError(f"Internal error: transformers mapped {t.name} unexpectedly.")
                tensor = torch.from_numpy(np.ascontiguousarray(result.weights))
                del values, result
                tensor = tensor.reshape(shape).to(torch_dtype)
                done += writer.write(hf_name, tensor)
                del tensor
        info = writer.close()
    except BaseException:
        writer.abort()
        raise
    info.update(architecture=class_name, skipped_tensors=skipped, strategy="streaming")
    return info


def _gguf_full_load(
    src: Path, config, torch_dtype, out_dir: Path, report: ProgressFn, lo: float, hi: float, max_shard_bytes: int
) -> dict:
    """from_pretrained(gguf_file=..., GgufConfig(dequantize=True)) then save_pretrained."""
    from transformers import AutoModelForCausalLM, GgufConfig

    mid = lo + (hi - lo) * 0.7
    raised: list[BaseException] = []  # the progress callback's own exception (a cancel) is never wrapped

    def callback(desc: str, i: int, total: int | None) -> None:
        frac = (i / total) if total else 0.0
        try:
            if desc.startswith("Writing"):
                report(mid + (hi - mid) * frac, f"writing shard {min(i + 1, total or 1)}/{total}")
            elif desc.startswith("Loading"):
                report(lo + (mid - lo) * (0.5 + 0.5 * frac), f"loading weights ({i}/{total})")
            else:
                report(lo + (mid - lo) * 0.5 * frac, f"dequantizing tensor {min(i + 1, total or 1)}/{total}")
        except BaseException as exc:
            raised.append(exc)
            raise

    with transformers_progress(callback):
        try:
            model = AutoModelForCausalLM.from_pretrained(
                str(src.parent),
                gguf_file=src.name,
                config=config,
                dtype=torch_dtype,
                quantization_config=GgufConfig(dequantize=True),
            )
        except ConversionError:
            raise
        except (ValueError, NotImplementedError, RuntimeError, KeyError, OSError) as exc:
            if raised and exc is raised[0]:
                raise
            raise ConversionError(f"transformers could not load {src.name}: {first_line(exc)}") from exc
        class_name = model.__class__.__name__
        model.save_pretrained(str(out_dir), max_shard_size=max_shard_bytes)
    del model
    shards = sorted(Path(out_dir).glob("*.safetensors"))
    num_tensors = len(SafetensorsSource(shards).entries)
    return {"architecture": class_name, "num_tensors": num_tensors, "shards": len(shards), "strategy": "transformers"}


def load_gguf_tokenizer(src: Path, summary: dict | None = None):
    """``AutoTokenizer`` from the GGUF metadata, with its special tokens put right; returns (tok, fixes)."""
    from transformers import AutoTokenizer

    src = Path(src)
    if summary is None:
        summary = gguf_meta_summary(open_gguf(src))
    if not summary["has_tokenizer"]:
        raise ConversionError(f"Missing tokenizer: {src.name} has no tokenizer metadata (tokenizer.ggml.*).")
    try:
        tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    except Exception as exc:  # noqa: BLE001
        raise ConversionError(f"transformers cannot build the tokenizer from {src.name}: {first_line(exc)}") from exc
    # transformers' GGUF tokenizer converters get bos/eos wrong for some files (5.17's llama converter
    # sets both to the BOS token); the GGUF metadata is authoritative.
    fixed: dict[str, Any] = {}
    vocab_size = len(tok)
    for key, token_id in summary["special_ids"].items():
        if isinstance(token_id, int) and 0 <= token_id < vocab_size:
            token = tok.convert_ids_to_tokens(token_id)
            if token is not None and getattr(tok, f"{key}_token", None) != token:
                setattr(tok, f"{key}_token", token)
                fixed[key] = token
    # ... and ignore tokenizer.ggml.add_bos_token / add_eos_token: honour them.
    probe = tok("a")["input_ids"]
    for key, position in (("bos", 0), ("eos", -1)):
        wanted = summary.get(f"add_{key}")
        token_id = getattr(tok, f"{key}_token_id", None)
        if isinstance(wanted, bool) and token_id is not None and probe:
            if (probe[position] == token_id) != wanted:
                setattr(tok, f"add_{key}_token", wanted)
                fixed[f"add_{key}_token"] = wanted
    if summary.get("chat_template") and not getattr(tok, "chat_template", None):
        tok.chat_template = summary["chat_template"]
        fixed["chat_template"] = True
    # the converters switch on clean_up_tokenization_spaces, which mangles BPE output (" ." -> ".")
    if getattr(tok, "clean_up_tokenization_spaces", False):
        tok.clean_up_tokenization_spaces = False
    return tok, fixed


def _save_gguf_tokenizer(src: Path, summary: dict, config, out_dir: Path) -> dict:
    tok, fixed = load_gguf_tokenizer(src, summary)
    max_pos = getattr(config, "max_position_embeddings", None)
    if isinstance(max_pos, int) and max_pos > 0:
        tok.model_max_length = max_pos
    tok.save_pretrained(str(out_dir))
    return {"tokenizer_fixed": fixed, "chat_template": bool(getattr(tok, "chat_template", None))}


def gguf_to_hf(
    src_gguf: Path,
    out_dir: Path,
    *,
    dtype: str = "bfloat16",
    progress: ProgressFn | None = None,
    max_shard_bytes: int | None = None,
) -> dict:
    """Convert a GGUF file into a Hugging Face safetensors directory (bf16 or fp16).

    Writes the weights (dequantized), ``config.json`` (with ``dtype``), ``generation_config.json``,
    the tokenizer files and the chat template (``chat_template.jinja``) into ``out_dir`` (an empty
    staging directory).  Returns ``{"dtype", "num_tensors", "size_bytes", "architecture", ...}``.
    """

    report = clamped_progress(progress)
    dtype = normalize_dtype(dtype, ("bfloat16", "float16"), "target dtype")
    torch_dtype = torch_dtype_of(dtype)
    src = Path(src_gguf)
    out_dir = prepare_out_dir(out_dir)
    max_shard = int(max_shard_bytes or DEFAULT_MAX_SHARD_BYTES)

    report(0, "reading GGUF header")
    header = open_gguf(src)
    summary = gguf_meta_summary(header)
    arch = summary["architecture"]
    _check_gguf_architecture(arch)
    if not summary["has_tokenizer"]:
        raise ConversionError(
            f"Missing tokenizer: {src.name} has no tokenizer metadata (tokenizer.ggml.*), "
            f"so the converted model could not be served."
        )
    config = _load_gguf_config(src)
    report(2, "converting weights")

    from transformers.integrations.gguf import GGUF_ARCHS

    if arch in STREAMING_GGUF_ARCHS and arch not in GGUF_ARCHS:
        info = _gguf_stream_weights(src, header, arch, config, torch_dtype, out_dir, report, 2, 92, max_shard)
        config.dtype = torch_dtype
        config.architectures = [info["architecture"]]
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.save_pretrained(str(out_dir))
        from transformers import GenerationConfig

        GenerationConfig.from_model_config(config).save_pretrained(str(out_dir))
    else:
        info = _gguf_full_load(src, config, torch_dtype, out_dir, report, 2, 92, max_shard)
    report(93, "writing tokenizer")
    tok_info = _save_gguf_tokenizer(src, summary, config, out_dir)

    report(97, "checking output")
    cfg = read_hf_config(out_dir)
    if cfg.get("dtype") != dtype and cfg.get("torch_dtype") != dtype:
        set_config_dtype(cfg, dtype)
        (out_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    if not (out_dir / "generation_config.json").is_file():
        raise ConversionError("Internal error: generation_config.json was not written.")
    if summary.get("chat_template") and not (out_dir / "chat_template.jinja").is_file():
        tok_cfg = json.loads((out_dir / "tokenizer_config.json").read_text())
        if not tok_cfg.get("chat_template"):
            raise ConversionError("Internal error: the chat template was not written.")
    report(100, "done")
    return {
        "dtype": dtype,
        "num_tensors": info["num_tensors"],
        "size_bytes": tree_size(out_dir),
        "architecture": info["architecture"],
        "model_type": cfg.get("model_type"),
        "gguf_architecture": arch,
        "source_quantization": summary["quantization"],
        "shards": info["shards"],
        "strategy": info["strategy"],
        "chat_template": tok_info["chat_template"],
        "tokenizer_fixed": tok_info["tokenizer_fixed"],
    }
