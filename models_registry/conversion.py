"""Pure model-conversion functions (no Django imports): the job wrapper calls these.

Every function takes plain paths and returns a plain ``dict`` describing what it produced.
Expected failures (bad input, unsupported model, corrupt file, missing tool) raise
:class:`ConversionError` with a message an operator can act on; library exceptions are wrapped.

``progress(pct: float, stage: str)`` callbacks are called often (per tensor where the work is
per tensor); a callback may raise to cancel, and that exception propagates unchanged.  Output
directories are staging directories owned by the caller: on failure they may hold partial files
and the caller is expected to remove them.

Functions:

* :func:`gguf_to_hf` -- GGUF -> Hugging Face safetensors (bf16/fp16), tokenizer, chat template,
  generation config.  Dense llama/mistral/qwen2/qwen3 GGUFs are dequantized tensor by tensor
  (large ones in slices) straight into the output files, with transformers' own name mapping and
  tensor processors; other architectures transformers supports are loaded whole with
  ``from_pretrained(gguf_file=..., quantization_config=GgufConfig(dequantize=True))`` and saved
  with ``save_pretrained``.
* :func:`convert_precision` -- fp32/bf16 -> fp16, fp32/fp16 -> bf16, streamed tensor by tensor
  (``safe_open``; ``.bin`` via ``torch.load(mmap=True)``), large tensors in slices.
* :func:`compare_logits` -- logits of two artifacts on :data:`VERIFY_PROMPTS` (float32 compute).
* :func:`export_onnx` -- fixed-shape ONNX export of a causal LM (``logits`` output, no KV cache).
* :func:`find_atc` / :func:`run_atc` -- Ascend ATC (CANN toolkit) ONNX -> OM.
* :func:`estimate_output_bytes` -- disk space to reserve before a conversion.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
import shutil
import signal
import struct
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

ProgressFn = Callable[[float, str], None]

__all__ = [
    "ATC_PRECISION_MODES",
    "ATC_SOC_VERSIONS",
    "AtcNotFound",
    "ConversionError",
    "DEFAULT_MAX_SHARD_BYTES",
    "VERIFY_PROMPTS",
    "compare_logits",
    "convert_precision",
    "estimate_output_bytes",
    "export_onnx",
    "find_atc",
    "gguf_to_hf",
    "run_atc",
]


class ConversionError(ValueError):
    """An expected conversion failure; ``str(exc)`` is meant for the operator."""


class AtcNotFound(ConversionError):
    """The Ascend ATC tool (CANN toolkit) is not installed on this node."""


ATC_NOT_FOUND_MESSAGE = "ATC not found on this node: install the CANN toolkit"

# Fixed prompts for logits verification: short, plain English, stable across tokenizers.
VERIFY_PROMPTS = [
    "The capital of France is",
    "Water boils at one hundred degrees Celsius at sea level.",
    "Once upon a time, a little robot learned to read.",
]

# Output shards: the writer streams tensors into the file, so this does not drive memory use;
# 5 GB is the Hugging Face Hub's usual shard size.
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9

# Dense GGUF architectures whose transformers tensor processor is a pure per-tensor function:
# these are streamed (tensor by tensor) instead of loading the whole model.  Anything else that
# transformers supports goes through from_pretrained + save_pretrained.
STREAMING_GGUF_ARCHS = frozenset({"llama", "qwen2", "qwen3"})

# Margin added to size estimates for tokenizer / config files.
TOKENIZER_MARGIN_BYTES = 64 * 1024**2

# Ascend SoC names accepted by ATC's --soc_version (npu-smi shows the part after "Ascend").
ATC_SOC_VERSIONS = (
    "Ascend310", "Ascend310B1", "Ascend310B2", "Ascend310B3", "Ascend310B4",
    "Ascend310P1", "Ascend310P3", "Ascend310P5", "Ascend310P7",
    "Ascend910", "Ascend910A", "Ascend910B", "Ascend910ProA", "Ascend910ProB", "Ascend910PremiumA",
    "Ascend910B1", "Ascend910B2", "Ascend910B2C", "Ascend910B3", "Ascend910B4", "Ascend910B4-1",
    "Ascend910_9391", "Ascend910_9392", "Ascend910_9381", "Ascend910_9382",
    "Ascend910_9372", "Ascend910_9362",
)
ATC_PRECISION_MODES = ("force_fp16", "allow_mix_precision", "allow_fp32_to_fp16", "must_keep_origin_dtype")
ATC_DEFAULT_PATHS = (
    "/usr/local/Ascend/ascend-toolkit/latest/bin/atc",
    "/usr/local/Ascend/ascend-toolkit/latest/atc/bin/atc",
    "/usr/local/Ascend/latest/bin/atc",
    "/usr/local/Ascend/cann/bin/atc",
    "~/Ascend/ascend-toolkit/latest/bin/atc",
    "~/Ascend/ascend-toolkit/latest/atc/bin/atc",
)

_DTYPE_ALIASES = {
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16",
    "float32": "float32", "fp32": "float32", "float": "float32",
}
# safetensors dtype tags <-> torch dtype names
_ST_TO_TORCH = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
    "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool",
}
_TORCH_TO_ST = {v: k for k, v in _ST_TO_TORCH.items()}
_ST_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4,
                "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1}
_CONVERTIBLE_SOURCES = {"float32", "float16", "bfloat16"}
_CHUNK_BYTES = 16 * 1024**2  # large tensors are converted in slices of about this size

# Files that hold weights (never copied by convert_precision / export_onnx).
_WEIGHT_SUFFIXES = {".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx", ".om",
                    ".data"}
_WEIGHT_INDEX_NAMES = {"model.safetensors.index.json", "pytorch_model.bin.index.json"}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model", "tokenizer.tiktoken",
                    "vocab.txt", "qwen.tiktoken")


# ----------------------------------------------------------------------------------------------
# small helpers
# ----------------------------------------------------------------------------------------------

def _noop_progress(pct: float, stage: str) -> None:
    return None


def _report(progress: ProgressFn | None) -> ProgressFn:
    if progress is None:
        return _noop_progress

    def call(pct: float, stage: str) -> None:
        progress(float(max(0.0, min(100.0, pct))), stage)

    return call


def _normalize_dtype(dtype: str, allowed: Iterable[str], what: str) -> str:
    allowed = tuple(allowed)
    name = _DTYPE_ALIASES.get(str(dtype).strip().lower())
    if name not in allowed:
        raise ConversionError(f"Invalid {what} {dtype!r}: choose one of {', '.join(allowed)}.")
    return name


def _torch_dtype(name: str):
    import torch

    return getattr(torch, name)


def _prepare_out_dir(out_dir: Path) -> Path:
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ConversionError(f"Output path {out_dir} exists and is not a directory.")
    out_dir.mkdir(parents=True, exist_ok=True)
    if any(out_dir.iterdir()):
        raise ConversionError(f"Output directory {out_dir} is not empty.")
    return out_dir


def _dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def _first_line(exc: BaseException, limit: int = 300) -> str:
    text = str(exc).strip().splitlines()
    msg = text[0] if text else type(exc).__name__
    return msg if len(msg) <= limit else msg[: limit - 3] + "..."


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


# ----------------------------------------------------------------------------------------------
# Hugging Face directory inspection
# ----------------------------------------------------------------------------------------------

def _read_hf_config(src_dir: Path) -> dict:
    src_dir = Path(src_dir)
    if not src_dir.is_dir():
        raise ConversionError(f"Model directory {src_dir} does not exist.")
    cfg_path = src_dir / "config.json"
    if not cfg_path.is_file():
        raise ConversionError(f"{src_dir} has no config.json: not a Hugging Face model directory.")
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConversionError(f"{cfg_path} is not valid JSON: {_first_line(exc)}") from exc
    if not isinstance(cfg, dict):
        raise ConversionError(f"{cfg_path} does not hold a JSON object.")
    return cfg


def _check_architecture(cfg: dict, where: Path, *, causal_lm: bool = False) -> None:
    """Raise ConversionError unless transformers knows this model_type (and architecture)."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = cfg.get("model_type")
    archs = cfg.get("architectures") or []
    arch_text = ", ".join(map(str, archs)) or "none listed"
    if not model_type:
        raise ConversionError(f"Unsupported architecture: {where}/config.json has no model_type "
                              f"(architectures: {arch_text}).")
    if model_type not in CONFIG_MAPPING:
        raise ConversionError(
            f"Unsupported architecture: model_type '{model_type}' (architectures: {arch_text}) is not "
            f"supported by transformers {transformers.__version__}."
        )
    unknown = [a for a in archs if str(a) not in _transformers_class_names()]
    if archs and len(unknown) == len(archs):
        raise ConversionError(
            f"Unsupported architecture: {arch_text} (model_type '{model_type}') is not a class in "
            f"transformers {transformers.__version__}."
        )
    if causal_lm:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            raise ConversionError(
                f"Unsupported architecture: model_type '{model_type}' ({arch_text}) is not a causal "
                f"language model in transformers {transformers.__version__}."
            )


_CLASS_NAMES: set[str] = set()


def _transformers_class_names() -> set[str]:
    """Every class name transformers exports, without importing the modeling code."""
    if not _CLASS_NAMES:
        import transformers

        _CLASS_NAMES.update(dir(transformers))
    return _CLASS_NAMES


def _has_tokenizer(src_dir: Path) -> bool:
    return any((Path(src_dir) / name).is_file() for name in _TOKENIZER_FILES)


def _require_tokenizer(src_dir: Path) -> None:
    if not _has_tokenizer(src_dir):
        raise ConversionError(
            f"Missing tokenizer: {src_dir} has none of {', '.join(_TOKENIZER_FILES)}; "
            f"copy the tokenizer files of the original model into it."
        )


def _find_weight_files(src_dir: Path) -> tuple[str, list[Path], set[Path]]:
    """(kind 'safetensors'|'bin', weight files in order, files that are part of the weights)."""
    src_dir = Path(src_dir)
    for index_name, kind in (("model.safetensors.index.json", "safetensors"),
                             ("pytorch_model.bin.index.json", "bin")):
        index_path = src_dir / index_name
        if index_path.is_file():
            try:
                weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
                names = sorted(set(weight_map.values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
                raise ConversionError(f"{index_path} is not a valid weight index: {_first_line(exc)}") from exc
            files = [src_dir / n for n in names]
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise ConversionError(f"{src_dir} is incomplete: shard(s) {', '.join(missing)} listed in "
                                      f"{index_name} are missing.")
            return kind, files, {*files, index_path}
    single = src_dir / "model.safetensors"
    if single.is_file():
        return "safetensors", [single], {single}
    shards = sorted(src_dir.glob("model-*-of-*.safetensors"))
    if shards:
        return "safetensors", shards, set(shards)
    single = src_dir / "pytorch_model.bin"
    if single.is_file():
        return "bin", [single], {single}
    shards = sorted(src_dir.glob("pytorch_model-*-of-*.bin"))
    if shards:
        return "bin", shards, set(shards)
    others = sorted(src_dir.glob("*.safetensors"))
    if others:
        return "safetensors", others, set(others)
    raise ConversionError(f"No weights found in {src_dir} (expected model.safetensors, sharded safetensors "
                          f"with model.safetensors.index.json, or pytorch_model.bin).")


def _copy_non_weight_files(src_dir: Path, out_dir: Path, *, exclude: Iterable[str] = ()) -> tuple[list[str], list[str]]:
    """Copy every non-weight file (recursively); return (copied, skipped) relative names."""
    exclude = set(exclude)
    copied, skipped = [], []
    for path in sorted(Path(src_dir).rglob("*")):
        if not path.is_file():
            continue
        rel = path.relative_to(src_dir)
        rel_s = rel.as_posix()
        if rel_s in exclude or any(part.startswith(".") for part in rel.parts):
            continue
        if path.suffix.lower() in _WEIGHT_SUFFIXES or rel.name in _WEIGHT_INDEX_NAMES:
            skipped.append(rel_s)
            continue
        target = Path(out_dir) / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
        copied.append(rel_s)
    return copied, skipped


def _set_config_dtype(cfg: dict, dtype: str) -> None:
    """Record ``dtype`` in a config dict: ``dtype`` always, ``torch_dtype`` where present, sub-configs too."""
    def visit(node: dict, top: bool) -> None:
        if top or "dtype" in node:
            node["dtype"] = dtype
        if "torch_dtype" in node:
            node["torch_dtype"] = dtype
        for key, value in node.items():
            if isinstance(value, dict) and key.endswith("_config") and key != "quantization_config":
                visit(value, False)

    visit(cfg, True)


# ----------------------------------------------------------------------------------------------
# streaming safetensors writer
# ----------------------------------------------------------------------------------------------

class _ShardWriter:
    """Write safetensors shards tensor by tensor without holding a shard in memory.

    The full list of ``(name, st_dtype, shape)`` is known up front, so each shard's header is
    written first and the tensors' bytes are appended as they come (in the planned order).
    Writes ``model.safetensors`` or ``model-0000i-of-0000N.safetensors`` plus
    ``model.safetensors.index.json``.
    """

    def __init__(self, out_dir: Path, plan: list[tuple[str, str, tuple[int, ...]]], *,
                 max_shard_bytes: int, metadata: dict | None = None):
        if max_shard_bytes <= 0:
            raise ConversionError(f"Invalid max shard size {max_shard_bytes}: must be positive.")
        self.out_dir = Path(out_dir)
        self.metadata = {"format": "pt", **(metadata or {})}
        self.plan = plan
        names = [p[0] for p in plan]
        if len(set(names)) != len(names):
            raise ConversionError("Internal error: duplicate tensor names in the output plan.")
        shards: list[list[int]] = []
        size = 0
        for i, (_, st_dtype, shape) in enumerate(plan):
            nbytes = math.prod(shape) * _ST_ITEMSIZE[st_dtype]
            if not shards or (size + nbytes > max_shard_bytes and shards[-1]):
                shards.append([])
                size = 0
            shards[-1].append(i)
            size += nbytes
        if not shards:
            raise ConversionError("No tensors to write.")
        n = len(shards)
        self.shard_names = (["model.safetensors"] if n == 1
                            else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)])
        self.shard_of = {}
        for k, idxs in enumerate(shards):
            for i in idxs:
                self.shard_of[i] = k
        self.shards = shards
        self.next = 0
        self.fh = None
        self.current = -1
        self.expected_end = 0
        self.total_bytes = sum(math.prod(s) * _ST_ITEMSIZE[d] for _, d, s in plan)
        self.total_params = sum(math.prod(s) for _, _, s in plan)

    def _open_shard(self, k: int) -> None:
        self._close_shard()
        header: dict[str, Any] = {"__metadata__": self.metadata}
        offset = 0
        for i in self.shards[k]:
            name, st_dtype, shape = self.plan[i]
            nbytes = math.prod(shape) * _ST_ITEMSIZE[st_dtype]
            header[name] = {"dtype": st_dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * ((8 - (len(raw) % 8)) % 8)  # align the data section like safetensors does
        self.fh = open(self.out_dir / self.shard_names[k], "wb")
        self.fh.write(len(raw).to_bytes(8, "little"))
        self.fh.write(raw)
        self.expected_end = 8 + len(raw) + offset
        self.current = k

    def _close_shard(self) -> None:
        if self.fh is not None:
            pos = self.fh.tell()
            self.fh.close()
            self.fh = None
            if pos != self.expected_end:
                raise ConversionError(f"Internal error: shard {self.shard_names[self.current]} has {pos} bytes, "
                                      f"expected {self.expected_end}.")

    def write(self, name: str, tensor) -> int:
        """Write one whole tensor (the next one in the plan); return its byte count."""
        return self.write_rows(name, [tensor])

    def write_rows(self, name: str, chunks: Iterable) -> int:
        """Write the next tensor in the plan from consecutive slices along its first dimension."""
        import torch

        if self.next >= len(self.plan):
            raise ConversionError(f"Internal error: unexpected extra tensor {name}.")
        exp_name, st_dtype, shape = self.plan[self.next]
        if name != exp_name:
            raise ConversionError(f"Internal error: got tensor {name}, expected {exp_name}.")
        expected = math.prod(shape) * _ST_ITEMSIZE[st_dtype]
        k = self.shard_of[self.next]
        if k != self.current:
            self._open_shard(k)
        written = 0
        for chunk in chunks:
            if _TORCH_TO_ST.get(str(chunk.dtype).removeprefix("torch.")) != st_dtype:
                raise ConversionError(f"Internal error: tensor {name} is {chunk.dtype}, expected {st_dtype}.")
            if len(shape) > 1 and tuple(chunk.shape[1:]) != tuple(shape[1:]) or chunk.dim() != len(shape):
                raise ConversionError(f"Tensor {name} has shape {tuple(chunk.shape)}, expected {tuple(shape)}.")
            flat = chunk.detach().to("cpu").contiguous().reshape(-1)
            if flat.dtype == torch.bool:
                flat = flat.to(torch.uint8)
            if flat.numel():
                self.fh.write(memoryview(flat.view(torch.uint8).numpy()))
            written += flat.numel() * flat.element_size()
            if written > expected:
                break
        if written != expected:
            raise ConversionError(f"Tensor {name} has {written} bytes, expected {expected} for shape {tuple(shape)}.")
        self.next += 1
        return written

    def close(self) -> dict:
        if self.next != len(self.plan):
            raise ConversionError(f"Internal error: wrote {self.next} of {len(self.plan)} tensors.")
        self._close_shard()
        if len(self.shard_names) > 1:
            index = {
                "metadata": {"total_size": self.total_bytes, "total_parameters": self.total_params},
                "weight_map": {name: self.shard_names[self.shard_of[i]] for i, (name, _, _) in enumerate(self.plan)},
            }
            (self.out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        return {"shards": len(self.shard_names), "num_tensors": len(self.plan), "weights_bytes": self.total_bytes}

    def abort(self) -> None:
        if self.fh is not None:
            self.fh.close()
            self.fh = None


# ----------------------------------------------------------------------------------------------
# progress from inside transformers (used only by the from_pretrained fallback of gguf_to_hf)
# ----------------------------------------------------------------------------------------------

_hook_local = threading.local()
_hook_lock = threading.Lock()
_hooks_installed = False


class _ProgressIterable:
    """Stands in for a tqdm bar: iterates and reports each step to the active callback."""

    def __init__(self, iterable, desc: str, total: int | None, callback):
        self.iterable = iterable
        self.desc = desc
        self.total = total if total is not None else (len(iterable) if hasattr(iterable, "__len__") else None)
        self.callback = callback

    def __iter__(self):
        for i, item in enumerate(self.iterable):
            self.callback(self.desc, i, self.total)
            yield item
        self.callback(self.desc, self.total or 0, self.total)

    def __len__(self):
        return self.total or 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def __getattr__(self, name):  # update(), close(), set_postfix() ... are no-ops
        return lambda *a, **k: None


def _install_tqdm_hooks() -> None:
    global _hooks_installed
    with _hook_lock:
        if _hooks_installed:
            return
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
        from transformers.utils import logging as hf_logging

        previous_hook = None

        def hf_hook(factory, args, kwargs):
            callback = getattr(_hook_local, "callback", None)
            if callback is not None:
                iterable = args[0] if args else kwargs.get("iterable")
                return _ProgressIterable(iterable, kwargs.get("desc", ""), kwargs.get("total"), callback)
            if previous_hook is not None:
                return previous_hook(factory, args, kwargs)
            return factory(*args, **kwargs)

        if hasattr(hf_logging, "set_tqdm_hook"):
            previous_hook = hf_logging.set_tqdm_hook(hf_hook)

        original_tqdm = getattr(gguf_utils, "tqdm", None)
        if original_tqdm is not None:
            def gguf_tqdm(*args, **kwargs):
                callback = getattr(_hook_local, "callback", None)
                if callback is not None:
                    iterable = args[0] if args else kwargs.get("iterable")
                    return _ProgressIterable(iterable, kwargs.get("desc", ""), kwargs.get("total"), callback)
                return original_tqdm(*args, **kwargs)

            gguf_utils.tqdm = gguf_tqdm
        _hooks_installed = True


def _silent(desc: str, i: int, total: int | None) -> None:
    return None


@contextlib.contextmanager
def _transformers_progress(callback):
    """Within the block, transformers' progress bars (in this thread) call ``callback(desc, i, total)``."""
    _install_tqdm_hooks()
    previous = getattr(_hook_local, "callback", None)
    _hook_local.callback = callback
    try:
        yield
    finally:
        _hook_local.callback = previous


# ----------------------------------------------------------------------------------------------
# 1. GGUF -> Hugging Face
# ----------------------------------------------------------------------------------------------

class _GgufTensor(NamedTuple):
    name: str
    dims: tuple[int, ...]  # ggml order (fastest-moving first)
    qtype: int
    offset: int  # absolute, in the file
    nbytes: int

    @property
    def n_elements(self) -> int:
        return math.prod(self.dims)


class _GgufHeader(NamedTuple):
    metadata: dict
    tensors: list[_GgufTensor]
    file_size: int


class _Truncated(Exception):
    pass


class _HeaderStream:
    def __init__(self, fh, size: int):
        self.fh = fh
        self.size = size

    def read(self, n: int) -> bytes:
        if n < 0 or self.fh.tell() + n > self.size:
            raise _Truncated()
        data = self.fh.read(n)
        if len(data) != n:
            raise _Truncated()
        return data

    def unpack(self, fmt: str):
        return struct.unpack(fmt, self.read(struct.calcsize(fmt)))

    def string(self) -> str:
        (length,) = self.unpack("<Q")
        return self.read(length).decode("utf-8", errors="replace")


_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def _gguf_value(stream: _HeaderStream, vtype: int):
    if vtype in _GGUF_SCALARS:
        return stream.unpack(_GGUF_SCALARS[vtype])[0]
    if vtype == 8:
        return stream.string()
    if vtype == 9:
        etype, count = stream.unpack("<IQ")
        if etype in _GGUF_SCALARS:
            width = struct.calcsize(_GGUF_SCALARS[etype])
            if count <= 4096:
                return list(struct.unpack("<" + _GGUF_SCALARS[etype][1] * count, stream.read(width * count)))
            stream.read(width * count)
            return count  # long arrays (scores, token types) are only counted
        if etype == 8:
            for _ in range(count):
                (length,) = stream.unpack("<Q")
                stream.read(length)
            return count  # the vocabulary and merges: transformers reads them when it builds the tokenizer
        raise ValueError(f"unsupported metadata array type {etype}")
    raise ValueError(f"unsupported metadata value type {vtype}")


def _open_gguf(src: Path) -> _GgufHeader:
    """Parse a GGUF file's metadata and tensor table (no tensor data) and check the file is complete."""
    import gguf

    src = Path(src)
    if not src.is_file():
        raise ConversionError(f"GGUF file {src} does not exist.")
    size = src.stat().st_size
    try:
        with open(src, "rb") as fh:
            stream = _HeaderStream(fh, size)
            if stream.read(4) != b"GGUF":
                raise ConversionError(f"{src.name} is not a GGUF file (it does not start with the GGUF magic bytes).")
            (version,) = stream.unpack("<I")
            if version not in (2, 3):
                raise ConversionError(f"{src.name} is GGUF version {version}; only versions 2 and 3 are supported.")
            tensor_count, kv_count = stream.unpack("<QQ")
            if tensor_count > 1_000_000 or kv_count > 1_000_000:
                raise ValueError(f"implausible counts ({tensor_count} tensors, {kv_count} metadata keys)")
            metadata = {}
            for _ in range(kv_count):
                key = stream.string()
                (vtype,) = stream.unpack("<I")
                metadata[key] = _gguf_value(stream, vtype)
            entries = []
            for _ in range(tensor_count):
                name = stream.string()
                (ndim,) = stream.unpack("<I")
                if ndim > 8:
                    raise ValueError(f"tensor {name} has {ndim} dimensions")
                dims = stream.unpack(f"<{ndim}Q")
                qtype, offset = stream.unpack("<IQ")
                entries.append((name, tuple(int(d) for d in dims), int(qtype), int(offset)))
            alignment = int(metadata.get("general.alignment", 32) or 32)
            data_start = (fh.tell() + alignment - 1) // alignment * alignment
    except _Truncated:
        raise ConversionError(f"{src.name} is a truncated or corrupt GGUF file: its header ends early.") from None
    except (ValueError, UnicodeDecodeError, struct.error) as exc:
        if isinstance(exc, ConversionError):
            raise
        raise ConversionError(f"{src.name} is a corrupt GGUF file: {_first_line(exc)}.") from exc

    tensors = []
    for name, dims, qtype, offset in entries:
        try:
            block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
        except (ValueError, KeyError):
            raise ConversionError(f"{src.name}: tensor {name} uses ggml type {qtype}, which gguf "
                                  f"{getattr(gguf, '__version__', '')} does not know.") from None
        n = math.prod(dims)
        nbytes = n // block * type_size
        start = data_start + offset
        if start + nbytes > size:
            raise ConversionError(
                f"{src.name} is a truncated GGUF file: tensor {name} ends at byte {start + nbytes} "
                f"but the file has {size} bytes."
            )
        tensors.append(_GgufTensor(name, dims, qtype, start, nbytes))
    if not metadata.get("general.architecture"):
        raise ConversionError(f"{src.name} has no general.architecture metadata: it is not a model file.")
    parts = metadata.get("split.count")
    if isinstance(parts, int) and parts > 1:
        raise ConversionError(f"{src.name} is part of a split GGUF ({parts} files); merge the parts first "
                              f"(llama-gguf-split --merge) and convert the merged file.")
    return _GgufHeader(metadata, tensors, size)


def _gguf_meta_summary(header: _GgufHeader) -> dict:
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
            for key, gguf_key in (("bos", "bos_token_id"), ("eos", "eos_token_id"),
                                  ("unk", "unknown_token_id"), ("pad", "padding_token_id"))
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
            f"{_transformers_version()} (supported: {', '.join(sorted(supported))})."
        )


def _load_gguf_config(src: Path):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(src.parent), gguf_file=src.name)
    except Exception as exc:  # noqa: BLE001
        raise ConversionError(f"transformers cannot read the model configuration from {src.name}: "
                              f"{_first_line(exc)}") from exc


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
        result = processor.process(weights=probe, name=name, tensor_key_mapping=key_map,
                                   parsed_parameters={"config": cfg_dict, "tensors": {}})
    except Exception:  # noqa: BLE001 - it wanted to reshape the dummy: it does something to this tensor
        return False
    return result.weights is probe and result.name == name


def _gguf_stream_weights(src: Path, header: _GgufHeader, arch: str, config, torch_dtype, out_dir: Path,
                         report: ProgressFn, lo: float, hi: float, max_shard_bytes: int) -> dict:
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

    st_dtype = _TORCH_TO_ST[str(torch_dtype).removeprefix("torch.")]
    plan, jobs, skipped = [], [], []
    for t in header.tensors:
        hf_name = key_map.get(t.name)
        if hf_name is None or hf_name not in state:
            skipped.append(t.name)
            continue
        shape = tuple(state[hf_name].shape)
        if math.prod(shape) != t.n_elements:
            raise ConversionError(f"GGUF tensor {t.name} has {t.n_elements} values but {hf_name} needs shape "
                                  f"{shape}: the file does not match its own metadata.")
        plan.append((hf_name, st_dtype, shape))
        jobs.append((t, hf_name))
    written = {p[0] for p in plan}
    missing = [g[0] for g in groups if not written.intersection(g)]
    if missing:
        raise ConversionError(f"The GGUF file lacks tensors the {class_name} model needs: "
                              f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}.")

    writer = _ShardWriter(out_dir, plan, max_shard_bytes=max_shard_bytes)
    total = writer.total_bytes or 1
    done = 0
    parsed = {"config": cfg_dict, "tensors": {}}

    def read(fh, offset: int, nbytes: int, what: str):
        fh.seek(offset)
        raw = np.empty(nbytes, dtype=np.uint8)
        if fh.readinto(memoryview(raw)) != nbytes:
            raise ConversionError(f"{src.name} is truncated: tensor {what} is incomplete.")
        return raw

    def dequantize(raw, t: _GgufTensor, dims: tuple[int, ...]):
        kind = gguf.GGMLQuantizationType(t.qtype)
        try:
            return gguf.dequantize(_gguf_array(raw, t.qtype, dims), kind)
        except Exception as exc:  # noqa: BLE001
            raise ConversionError(f"Cannot dequantize tensor {t.name} ({kind.name}): {_first_line(exc)}") from exc

    def row_chunks(fh, t: _GgufTensor, shape: tuple[int, ...]):
        """Large tensors the processor leaves alone: dequantize a slab of rows at a time."""
        rows = shape[0]
        row_bytes, row_elems = t.nbytes // rows, t.n_elements // rows
        step = max(1, _CHUNK_BYTES // (4 * row_elems))
        for start in range(0, rows, step):
            n = min(step, rows - start)
            values = dequantize(read(fh, t.offset + start * row_bytes, n * row_bytes, t.name), t, t.dims[:-1] + (n,))
            yield torch.from_numpy(np.ascontiguousarray(values)).reshape((n, *shape[1:])).to(torch_dtype)

    try:
        with open(src, "rb") as fh:
            for i, (t, hf_name) in enumerate(jobs):
                report(lo + (hi - lo) * done / total, f"dequantizing {t.name} ({i + 1}/{len(jobs)})")
                shape = plan[i][2]
                if (t.n_elements * 4 > _CHUNK_BYTES and len(shape) >= 2 and shape == tuple(reversed(t.dims))
                        and _processor_leaves_alone(processor, t.name, key_map, cfg_dict)):
                    done += writer.write_rows(hf_name, row_chunks(fh, t, shape))
                    continue
                values = dequantize(read(fh, t.offset, t.nbytes, t.name), t, t.dims)
                result = processor.process(weights=values, name=t.name, tensor_key_mapping=key_map,
                                           parsed_parameters=parsed)
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


def _gguf_full_load(src: Path, config, torch_dtype, out_dir: Path, report: ProgressFn,
                    lo: float, hi: float, max_shard_bytes: int) -> dict:
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

    with _transformers_progress(callback):
        try:
            model = AutoModelForCausalLM.from_pretrained(
                str(src.parent), gguf_file=src.name, config=config, dtype=torch_dtype,
                quantization_config=GgufConfig(dequantize=True),
            )
        except ConversionError:
            raise
        except (ValueError, NotImplementedError, RuntimeError, KeyError, OSError) as exc:
            if raised and exc is raised[0]:
                raise
            raise ConversionError(f"transformers could not load {src.name}: {_first_line(exc)}") from exc
        class_name = model.__class__.__name__
        model.save_pretrained(str(out_dir), max_shard_size=max_shard_bytes)
    del model
    shards = sorted(Path(out_dir).glob("*.safetensors"))
    num_tensors = len(_SafetensorsSource(shards).entries)
    return {"architecture": class_name, "num_tensors": num_tensors, "shards": len(shards), "strategy": "transformers"}


def _load_gguf_tokenizer(src: Path, summary: dict | None = None):
    """``AutoTokenizer`` from the GGUF metadata, with its special tokens put right; returns (tok, fixes)."""
    from transformers import AutoTokenizer

    src = Path(src)
    if summary is None:
        summary = _gguf_meta_summary(_open_gguf(src))
    if not summary["has_tokenizer"]:
        raise ConversionError(f"Missing tokenizer: {src.name} has no tokenizer metadata (tokenizer.ggml.*).")
    try:
        tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    except Exception as exc:  # noqa: BLE001
        raise ConversionError(f"transformers cannot build the tokenizer from {src.name}: {_first_line(exc)}") from exc
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
    tok, fixed = _load_gguf_tokenizer(src, summary)
    max_pos = getattr(config, "max_position_embeddings", None)
    if isinstance(max_pos, int) and max_pos > 0:
        tok.model_max_length = max_pos
    tok.save_pretrained(str(out_dir))
    return {"tokenizer_fixed": fixed, "chat_template": bool(getattr(tok, "chat_template", None))}


def gguf_to_hf(src_gguf: Path, out_dir: Path, *, dtype: str = "bfloat16", progress: ProgressFn | None = None,
               max_shard_bytes: int | None = None) -> dict:
    """Convert a GGUF file into a Hugging Face safetensors directory (bf16 or fp16).

    Writes the weights (dequantized), ``config.json`` (with ``dtype``), ``generation_config.json``,
    the tokenizer files and the chat template (``chat_template.jinja``) into ``out_dir`` (an empty
    staging directory).  Returns ``{"dtype", "num_tensors", "size_bytes", "architecture", ...}``.
    """
    import torch

    report = _report(progress)
    dtype = _normalize_dtype(dtype, ("bfloat16", "float16"), "target dtype")
    torch_dtype = _torch_dtype(dtype)
    src = Path(src_gguf)
    out_dir = _prepare_out_dir(out_dir)
    max_shard = int(max_shard_bytes or DEFAULT_MAX_SHARD_BYTES)

    report(0, "reading GGUF header")
    header = _open_gguf(src)
    summary = _gguf_meta_summary(header)
    arch = summary["architecture"]
    _check_gguf_architecture(arch)
    if not summary["has_tokenizer"]:
        raise ConversionError(f"Missing tokenizer: {src.name} has no tokenizer metadata (tokenizer.ggml.*), "
                              f"so the converted model could not be served.")
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
    cfg = _read_hf_config(out_dir)
    if cfg.get("dtype") != dtype and cfg.get("torch_dtype") != dtype:
        _set_config_dtype(cfg, dtype)
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
        "size_bytes": _dir_size(out_dir),
        "architecture": info["architecture"],
        "model_type": cfg.get("model_type"),
        "gguf_architecture": arch,
        "source_quantization": summary["quantization"],
        "shards": info["shards"],
        "strategy": info["strategy"],
        "chat_template": tok_info["chat_template"],
        "tokenizer_fixed": tok_info["tokenizer_fixed"],
    }


# ----------------------------------------------------------------------------------------------
# 2. precision conversion (streaming)
# ----------------------------------------------------------------------------------------------

class _SafetensorsSource:
    """Reads tensors one at a time with ``safe_open``, reopening files now and then so the pages of
    the memory map already read do not pile up in the process's resident memory."""

    REOPEN_BYTES = 64 * 1024**2

    def __init__(self, files: list[Path]):
        from safetensors import SafetensorError, safe_open

        self._safe_open = safe_open
        self.errors = (SafetensorError, OSError, ValueError, RuntimeError)
        self.entries: list[tuple[Path, str, str, tuple[int, ...]]] = []
        for file in files:
            try:
                with safe_open(str(file), framework="pt") as fh:
                    for name in fh.keys():
                        sl = fh.get_slice(name)
                        self.entries.append((file, name, sl.get_dtype(), tuple(sl.get_shape())))
            except self.errors as exc:
                raise ConversionError(f"{file.name} is not a valid safetensors file (corrupt or truncated): "
                                      f"{_first_line(exc)}") from exc
        self._file = None
        self._handle = None
        self._read_since_open = 0

    def _open(self, file: Path):
        if self._handle is None or self._file != file or self._read_since_open > self.REOPEN_BYTES:
            self.close()
            try:
                self._handle = self._safe_open(str(file), framework="pt")
                self._handle.__enter__()
            except self.errors as exc:
                raise ConversionError(f"{file.name} is not a valid safetensors file: {_first_line(exc)}") from exc
            self._file = file
            self._read_since_open = 0
        return self._handle

    def rows(self, file: Path, name: str, shape: tuple[int, ...], itemsize: int) -> Iterator:
        """The tensor, in slices of at most ~CHUNK_BYTES along its first dimension."""
        nbytes = math.prod(shape) * itemsize
        try:
            if len(shape) == 0 or nbytes <= _CHUNK_BYTES or shape[0] <= 1:
                tensor = self._open(file).get_tensor(name)
                self._read_since_open += nbytes
                yield tensor
                return
            step = max(1, _CHUNK_BYTES // max(1, nbytes // shape[0]))
            for start in range(0, shape[0], step):
                chunk = self._open(file).get_slice(name)[start:start + step]
                self._read_since_open += chunk.numel() * chunk.element_size()
                yield chunk
        except self.errors as exc:
            raise ConversionError(f"{file.name}: tensor {name} cannot be read (corrupt file?): "
                                  f"{_first_line(exc)}") from exc

    def close(self) -> None:
        if self._handle is not None:
            with contextlib.suppress(Exception):
                self._handle.__exit__(None, None, None)
            self._handle = None


class _BinSource:
    """``pytorch_model*.bin`` read with ``torch.load(mmap=True, weights_only=True)``, one file at a time."""

    def __init__(self, files: list[Path]):
        import torch

        self.entries = []
        self._cache_file = None
        self._cache = None
        for file in files:
            state = self._load(file)
            for name, tensor in state.items():
                if not isinstance(tensor, torch.Tensor):
                    raise ConversionError(f"{file.name}: entry {name} is not a tensor; not a plain state dict.")
                st = _TORCH_TO_ST.get(str(tensor.dtype).removeprefix("torch."))
                if st is None:
                    raise ConversionError(f"{file.name}: tensor {name} has unsupported dtype {tensor.dtype}.")
                self.entries.append((file, name, st, tuple(tensor.shape)))
            del state

    @staticmethod
    def _load(file: Path) -> dict:
        import torch

        try:
            state = torch.load(str(file), map_location="cpu", mmap=True, weights_only=True)
        except Exception as exc:  # noqa: BLE001 - pickle/zip errors of every kind
            raise ConversionError(f"{file.name} is not a readable PyTorch weights file (corrupt, truncated, or "
                                  f"not a zip-format checkpoint): {_first_line(exc)}") from exc
        if not isinstance(state, dict):
            raise ConversionError(f"{file.name} does not hold a state dict.")
        return state

    def rows(self, file: Path, name: str, shape: tuple[int, ...], itemsize: int) -> Iterator:
        if self._cache_file != file:
            self._cache = None
            self._cache = self._load(file)
            self._cache_file = file
        tensor = self._cache.pop(name)  # memory-mapped: slices are read on demand
        nbytes = math.prod(shape) * itemsize
        if len(shape) == 0 or nbytes <= _CHUNK_BYTES or shape[0] <= 1:
            yield tensor
            return
        step = max(1, _CHUNK_BYTES // max(1, nbytes // shape[0]))
        for start in range(0, shape[0], step):
            yield tensor[start:start + step]

    def close(self) -> None:
        self._cache = None
        self._cache_file = None


def _cast_chunks(chunks: Iterable, name: str, dtype) -> Iterator:
    """Cast each chunk; refuse values that overflow float16 (they would become inf)."""
    import torch

    for chunk in chunks:
        out = chunk.to(dtype)
        if dtype == torch.float16 and chunk.dtype != torch.float16 and bool(torch.isinf(out).any()):
            bad = int(torch.isinf(out).sum()) - int(torch.isinf(chunk).sum())
            if bad > 0:
                raise ConversionError(
                    f"Tensor {name} has {bad} value(s) beyond the float16 range (|x| > 65504): converting "
                    f"to float16 would turn them into inf; use bfloat16 instead."
                )
        del chunk
        yield out


def convert_precision(src_dir: Path, out_dir: Path, *, dtype: str, progress: ProgressFn | None = None,
                      max_shard_bytes: int | None = None) -> dict:
    """Convert a Hugging Face checkpoint's floating-point weights to float16 or bfloat16.

    Tensors are streamed one at a time, large ones in ~16 MB slices (so peak memory is a few slices,
    not a shard or the model); non-floating tensors
    are copied unchanged; every non-weight file (tokenizer, generation config, chat template...)
    is copied; ``config.json`` records the new dtype.  Output is always safetensors (``.bin``
    sources are converted too).  Returns ``{"dtype", "source_dtype", "num_tensors", "size_bytes",
    "architecture", "shards", ...}``.
    """
    report = _report(progress)
    target = _normalize_dtype(dtype, ("float16", "bfloat16"), "target dtype")
    src_dir = Path(src_dir)
    cfg = _read_hf_config(src_dir)
    if cfg.get("quantization_config") or (src_dir / "quant_model_description.json").is_file():
        method = (cfg.get("quantization_config") or {}).get("quant_method", "ascend modelslim")
        raise ConversionError(f"{src_dir.name} is a quantized checkpoint ({method}); precision conversion only "
                              f"applies to unquantized float32/float16/bfloat16 checkpoints.")
    if not cfg.get("auto_map"):  # custom-code models cannot be checked against transformers
        _check_architecture(cfg, src_dir)
    _require_tokenizer(src_dir)
    kind, files, weight_files = _find_weight_files(src_dir)
    out_dir = _prepare_out_dir(out_dir)
    max_shard = int(max_shard_bytes or DEFAULT_MAX_SHARD_BYTES)

    report(0, "reading tensor headers")
    source = _SafetensorsSource(files) if kind == "safetensors" else _BinSource(files)
    if not source.entries:
        raise ConversionError(f"{src_dir.name} holds no tensors.")
    float_bytes: dict[str, int] = {}
    for _, name, st, shape in source.entries:
        tname = _ST_TO_TORCH[st]
        if tname.startswith("float8"):
            raise ConversionError(f"{src_dir.name} holds float8 tensors (e.g. {name}): an FP8-quantized "
                                  f"checkpoint cannot be converted to {target}.")
        if tname.startswith(("float", "bfloat")):
            float_bytes[tname] = float_bytes.get(tname, 0) + math.prod(shape) * _ST_ITEMSIZE[st]
    if not float_bytes:
        raise ConversionError(f"{src_dir.name} has no floating-point tensors to convert.")
    source_dtype = max(float_bytes, key=float_bytes.get)
    if source_dtype == target and len(float_bytes) == 1:
        raise ConversionError(f"{src_dir.name} is already {target}: nothing to convert.")
    if source_dtype == target:
        raise ConversionError(f"{src_dir.name} is already mostly {target} (with some "
                              f"{', '.join(sorted(set(float_bytes) - {target}))} tensors): nothing to convert.")
    if source_dtype not in _CONVERTIBLE_SOURCES:
        raise ConversionError(f"Unsupported conversion {source_dtype} -> {target}: only float32/float16/bfloat16 "
                              f"checkpoints can be converted.")

    target_st = _TORCH_TO_ST[target]
    target_torch = _torch_dtype(target)
    plan = []
    for _, name, st, shape in source.entries:
        is_float = _ST_TO_TORCH[st].startswith(("float", "bfloat"))
        plan.append((name, target_st if is_float else st, shape))
    writer = _ShardWriter(out_dir, plan, max_shard_bytes=max_shard)
    total = sum(math.prod(s) * _ST_ITEMSIZE[d] for _, _, d, s in source.entries) or 1
    done = 0
    n = len(source.entries)
    try:
        for i, (file, name, st, shape) in enumerate(source.entries):
            report(95 * done / total, f"converting {name} ({i + 1}/{n})")
            chunks = source.rows(file, name, shape, _ST_ITEMSIZE[st])
            if _ST_TO_TORCH[st].startswith(("float", "bfloat")):
                chunks = _cast_chunks(chunks, name, target_torch)
            writer.write_rows(name, chunks)
            done += math.prod(shape) * _ST_ITEMSIZE[st]
        info = writer.close()
    except BaseException:
        writer.abort()
        raise
    finally:
        source.close()

    report(96, "copying tokenizer and config files")
    copied, skipped = _copy_non_weight_files(
        src_dir, out_dir, exclude={f.relative_to(src_dir).as_posix() for f in weight_files} | {"config.json"})
    _set_config_dtype(cfg, target)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    report(100, "done")
    archs = cfg.get("architectures") or []
    return {
        "dtype": target,
        "source_dtype": source_dtype,
        "source_format": kind,
        "num_tensors": info["num_tensors"],
        "size_bytes": _dir_size(out_dir),
        "architecture": archs[0] if archs else cfg.get("model_type"),
        "shards": info["shards"],
        "copied_files": copied,
        "skipped_files": skipped,
    }


# ----------------------------------------------------------------------------------------------
# 3. logits comparison
# ----------------------------------------------------------------------------------------------

def _resolve_model_source(path: Path) -> tuple[Path, str | None]:
    """(directory, gguf file name or None) for an HF directory, a .gguf file, or a dir holding one GGUF."""
    path = Path(path)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path.parent, path.name
    if path.is_dir():
        if (path / "config.json").is_file():
            return path, None
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return path, ggufs[0].name
    if not path.exists():
        raise ConversionError(f"Model path {path} does not exist.")
    raise ConversionError(f"{path} is neither a Hugging Face model directory (config.json) nor a GGUF file.")


def _load_for_compare(path: Path):
    import torch
    from transformers import AutoModelForCausalLM

    directory, gguf_name = _resolve_model_source(path)
    if gguf_name:
        _open_gguf(directory / gguf_name)  # clear errors for corrupt files
        kwargs = {"gguf_file": gguf_name}
    else:
        cfg = _read_hf_config(directory)
        _check_architecture(cfg, directory, causal_lm=True)
        _find_weight_files(directory)
        kwargs = {}
    try:
        with _transformers_progress(_silent):
            model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32, **kwargs)
    except ConversionError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise ConversionError(f"transformers cannot load {path}: {_first_line(exc)}") from exc
    model.eval()
    return model


def _load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    directory, gguf_name = _resolve_model_source(path)
    if gguf_name is None:
        _require_tokenizer(directory)
    try:
        if gguf_name:
            return _load_gguf_tokenizer(directory / gguf_name)[0]
        return AutoTokenizer.from_pretrained(str(directory))
    except ConversionError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise ConversionError(f"Cannot load the tokenizer of {path}: {_first_line(exc)}") from exc


def _model_logits(path: Path, batches: list) -> list:
    import torch

    model = _load_for_compare(path)
    out = []
    try:
        with torch.inference_mode():
            for ids in batches:
                logits = model(input_ids=ids, use_cache=False).logits[0].float()
                out.append(logits)
    finally:
        del model
    return out


def compare_logits(reference_dir: Path, candidate_dir: Path, *, prompts: list[str] | None = None) -> dict:
    """Compare the logits of two models on fixed prompts (float32 compute, one model in memory at a time).

    Either side may be a Hugging Face directory or a GGUF file.  The reference's tokenizer encodes
    the prompts and both models see the same token ids.  Returns ``{"prompts", "max_abs_diff",
    "cosine_similarity" (the minimum over prompts, of the flattened logits), "tokens", ...}``.
    """
    import torch

    prompts = list(VERIFY_PROMPTS if prompts is None else prompts)
    if not prompts or not all(isinstance(p, str) and p.strip() for p in prompts):
        raise ConversionError("compare_logits needs at least one non-empty prompt.")
    tokenizer = _load_tokenizer(reference_dir)
    batches = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        if ids.numel() == 0:
            raise ConversionError(f"The prompt {prompt!r} encodes to no tokens.")
        batches.append(ids)
    tokenizer_match = None
    with contextlib.suppress(ConversionError):
        cand_tok = _load_tokenizer(candidate_dir)
        tokenizer_match = all(
            cand_tok(p, return_tensors="pt")["input_ids"].tolist() == b.tolist() for p, b in zip(prompts, batches)
        )

    ref = _model_logits(reference_dir, batches)
    cand = _model_logits(candidate_dir, batches)
    max_abs, mean_abs, min_cos, agree, tokens = 0.0, 0.0, 1.0, 0, 0
    for r, c in zip(ref, cand):
        if r.shape != c.shape:
            raise ConversionError(f"The models' logits differ in shape ({tuple(r.shape)} vs {tuple(c.shape)}): "
                                  f"they do not share a vocabulary.")
        diff = (r - c).abs()
        max_abs = max(max_abs, float(diff.max()))
        mean_abs += float(diff.sum())
        cos = torch.nn.functional.cosine_similarity(r.reshape(1, -1).double(), c.reshape(1, -1).double()).item()
        min_cos = min(min_cos, cos)
        agree += int((r.argmax(-1) == c.argmax(-1)).sum())
        tokens += r.shape[0]
    elements = sum(r.numel() for r in ref)
    return {
        "prompts": len(prompts),
        "max_abs_diff": max_abs,
        "cosine_similarity": min_cos,
        "tokens": tokens,
        "mean_abs_diff": mean_abs / max(elements, 1),
        "top1_agreement": agree / max(tokens, 1),
        "tokenizer_match": tokenizer_match,
    }


# ----------------------------------------------------------------------------------------------
# 4. ONNX export
# ----------------------------------------------------------------------------------------------

ONNX_OPSET = 18
ONNX_EXTERNAL_DATA_BYTES = 1536 * 1024**2  # protobuf's 2 GiB limit, with room to spare


def export_onnx(src_dir: Path, out_dir: Path, *, batch_size: int = 1, seq_len: int = 128,
                progress: ProgressFn | None = None) -> dict:
    """Export a causal LM to ONNX for a fixed batch and sequence length (float32, no KV cache).

    Inputs ``input_ids`` and ``attention_mask`` (int64, ``[batch_size, seq_len]``), output ``logits``
    (float32, ``[batch_size, seq_len, vocab]``).  Writes ``out_dir/model.onnx`` (plus
    ``model.onnx.data`` for models over ~1.5 GB) and copies the tokenizer and config files.
    The returned ``input_shape`` is ready for :func:`run_atc`.
    """
    import torch

    report = _report(progress)
    if not isinstance(batch_size, int) or not 1 <= batch_size <= 1024:
        raise ConversionError(f"Invalid batch size {batch_size!r}: must be an integer from 1 to 1024.")
    src_dir = Path(src_dir)
    cfg = _read_hf_config(src_dir)
    _check_architecture(cfg, src_dir, causal_lm=True)
    max_pos = cfg.get("max_position_embeddings") or (cfg.get("text_config") or {}).get("max_position_embeddings")
    limit = int(max_pos) if isinstance(max_pos, int) and max_pos > 0 else 1 << 20
    if not isinstance(seq_len, int) or not 1 <= seq_len <= limit:
        raise ConversionError(f"Invalid sequence length {seq_len!r}: must be an integer from 1 to {limit}.")
    _find_weight_files(src_dir)
    try:
        import onnx  # noqa: F401
        import onnxscript  # noqa: F401
    except ImportError as exc:
        raise ConversionError("ONNX export needs the 'onnx' and 'onnxscript' packages "
                              "(see requirements.txt).") from exc
    out_dir = _prepare_out_dir(out_dir)

    report(0, "loading model (float32)")
    from transformers import AutoModelForCausalLM

    try:
        with _transformers_progress(_silent):
            model = AutoModelForCausalLM.from_pretrained(str(src_dir), dtype=torch.float32,
                                                         attn_implementation="eager")
    except Exception as exc:  # noqa: BLE001
        raise ConversionError(f"transformers cannot load {src_dir}: {_first_line(exc)}") from exc
    model.eval()
    model.config.use_cache = False
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    vocab = model.get_output_embeddings().weight.shape[0] if model.get_output_embeddings() is not None else None

    class LogitsOnly(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask):
            return self.inner(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits

    wrapper = LogitsOnly(model).eval()
    ids = (torch.arange(batch_size * seq_len, dtype=torch.long).reshape(batch_size, seq_len) % max(vocab or 2, 2))
    mask = torch.ones_like(ids)
    onnx_path = out_dir / "model.onnx"
    external = param_bytes > ONNX_EXTERNAL_DATA_BYTES
    report(15, "exporting to ONNX")
    log = io.StringIO()
    try:
        with torch.inference_mode(False), torch.no_grad(), contextlib.redirect_stdout(log):
            torch.onnx.export(
                wrapper, (ids, mask), str(onnx_path),
                input_names=["input_ids", "attention_mask"], output_names=["logits"],
                opset_version=ONNX_OPSET, dynamo=True, external_data=external, verbose=False,
            )
    except Exception as exc:  # noqa: BLE001
        tail = "\n".join(log.getvalue().strip().splitlines()[-5:])
        raise ConversionError(f"ONNX export of {cfg.get('model_type')} failed: {_first_line(exc)}"
                              + (f"\n{tail}" if tail else "")) from exc
    finally:
        del wrapper, model
    report(85, "checking the ONNX model")
    import onnx

    try:
        onnx.checker.check_model(str(onnx_path))
        graph = onnx.load(str(onnx_path), load_external_data=False).graph
    except Exception as exc:  # noqa: BLE001
        raise ConversionError(f"The exported ONNX model is invalid: {_first_line(exc)}") from exc
    inputs = [i.name for i in graph.input]
    outputs = [o.name for o in graph.output]
    report(95, "copying tokenizer and config files")
    _copy_non_weight_files(src_dir, out_dir)
    report(100, "done")
    return {
        "onnx_path": str(onnx_path),
        "external_data": external,
        "batch_size": batch_size,
        "seq_len": seq_len,
        "opset": ONNX_OPSET,
        "inputs": inputs,
        "outputs": outputs,
        "input_shape": ";".join(f"{name}:{batch_size},{seq_len}" for name in inputs),
        "dtype": "float32",
        "architecture": (cfg.get("architectures") or [cfg.get("model_type")])[0],
        "size_bytes": _dir_size(out_dir),
    }


# ----------------------------------------------------------------------------------------------
# 5. ATC (ONNX -> Ascend OM)
# ----------------------------------------------------------------------------------------------

def find_atc() -> str | None:
    """Path of the ATC executable: on PATH, under $ASCEND_TOOLKIT_HOME / $ASCEND_HOME_PATH, or in the
    CANN toolkit's default install locations; None when absent."""
    found = shutil.which("atc")
    if found:
        return found
    candidates = []
    for var in ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH", "ASCEND_HOME"):
        home = os.environ.get(var)
        if home:
            candidates += [Path(home) / "bin" / "atc", Path(home) / "atc" / "bin" / "atc"]
    candidates += [Path(p).expanduser() for p in ATC_DEFAULT_PATHS]
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    return None


def _normalize_soc(soc_version: str) -> str:
    text = re.sub(r"\s+", "", str(soc_version or ""))
    if not text.lower().startswith("ascend"):
        text = "Ascend" + text
    by_lower = {s.lower(): s for s in ATC_SOC_VERSIONS}
    soc = by_lower.get(text.lower())
    if soc is None:
        raise ConversionError(f"Invalid SoC version {soc_version!r}: use the chip name npu-smi shows, e.g. "
                              f"Ascend910B4 or Ascend310P3 (known: {', '.join(ATC_SOC_VERSIONS)}).")
    return soc


_INPUT_SHAPE_RE = re.compile(r"^[A-Za-z0-9_./-]+:-?\d+(,-?\d+)*(;[A-Za-z0-9_./-]+:-?\d+(,-?\d+)*)*$")


def _tail(text: str, lines: int = 20) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def run_atc(onnx_path: Path, out_prefix: Path, *, soc_version: str, precision_mode: str = "force_fp16",
            input_shape: str | None = None, timeout: float = 3600) -> dict:
    """Run ``atc --framework=5 --model=X.onnx --output=PREFIX --soc_version=AscendNNN --precision_mode=...``.

    ATC writes ``PREFIX.om``.  Raises :class:`AtcNotFound` when the CANN toolkit is not installed,
    :class:`ConversionError` on invalid options, a timeout, or ATC failing (with its last lines).
    """
    soc = _normalize_soc(soc_version)
    if precision_mode not in ATC_PRECISION_MODES:
        raise ConversionError(f"Invalid precision mode {precision_mode!r}: choose one of "
                              f"{', '.join(ATC_PRECISION_MODES)}.")
    if input_shape is not None and not _INPUT_SHAPE_RE.match(input_shape):
        raise ConversionError(f"Invalid input shape {input_shape!r}: expected 'name:d1,d2;name2:d1,d2'.")
    try:
        timeout = float(timeout)
    except (TypeError, ValueError):
        timeout = -1.0
    if not timeout > 0:
        raise ConversionError(f"Invalid ATC timeout {timeout!r}: must be a positive number of seconds.")
    onnx_path = Path(onnx_path)
    if not onnx_path.is_file():
        raise ConversionError(f"ONNX model {onnx_path} does not exist.")
    if onnx_path.suffix.lower() != ".onnx":
        raise ConversionError(f"{onnx_path.name} is not an .onnx file.")
    out_prefix = Path(out_prefix)
    if out_prefix.suffix.lower() == ".om":
        out_prefix = out_prefix.with_suffix("")
    atc = find_atc()
    if atc is None:
        raise AtcNotFound(ATC_NOT_FOUND_MESSAGE)
    out_prefix.parent.mkdir(parents=True, exist_ok=True)
    argv = [
        atc,
        "--framework=5",
        f"--model={onnx_path}",
        f"--output={out_prefix}",
        f"--soc_version={soc}",
        f"--precision_mode={precision_mode}",
    ]
    if input_shape:
        argv.append(f"--input_shape={input_shape}")
    started = time.monotonic()
    try:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                text=True, errors="replace", start_new_session=True)
    except OSError as exc:
        raise ConversionError(f"Cannot start ATC ({atc}): {_first_line(exc)}") from exc
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        raise ConversionError(f"ATC timed out after {timeout:.0f} s and was stopped. Last output:\n"
                              f"{_tail(output or '')}") from None
    except BaseException:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    seconds = time.monotonic() - started
    om_path = out_prefix.with_name(out_prefix.name + ".om")
    if proc.returncode != 0:
        hint = ""
        if shutil.which("atc") is None and "ASCEND_HOME_PATH" not in os.environ:
            hint = ("\n(hint: ATC was found outside PATH; source the toolkit's set_env.sh, e.g. "
                    "/usr/local/Ascend/ascend-toolkit/set_env.sh, in the worker's environment)")
        raise ConversionError(f"ATC failed with exit code {proc.returncode}:\n{_tail(output or '')}{hint}")
    if not om_path.is_file():
        raise ConversionError(f"ATC exited successfully but wrote no {om_path.name}:\n{_tail(output or '')}")
    return {
        "om_path": str(om_path),
        "size_bytes": om_path.stat().st_size,
        "argv": argv,
        "soc_version": soc,
        "precision_mode": precision_mode,
        "seconds": round(seconds, 3),
        "log_tail": _tail(output or ""),
    }


# ----------------------------------------------------------------------------------------------
# 6. size estimate
# ----------------------------------------------------------------------------------------------

_BYTES_PER_PARAM = {
    "hf": 2, "fp16": 2, "float16": 2, "bf16": 2, "bfloat16": 2,
    "fp32": 4, "float32": 4,
    "onnx": 4,  # export_onnx writes float32
    "om": 4,    # conservative: must_keep_origin_dtype keeps float32 (force_fp16 needs about half)
}


def estimate_output_bytes(*, param_count: int, to: str) -> int:
    """Bytes to reserve for a conversion's output: ``param_count`` times the target's bytes per
    parameter, plus a margin for tokenizer and config files."""
    if isinstance(param_count, bool) or not isinstance(param_count, int) or param_count < 0:
        raise ConversionError(f"Invalid parameter count {param_count!r}: must be a non-negative integer.")
    key = str(to).strip().lower()
    if key not in _BYTES_PER_PARAM:
        raise ConversionError(f"Unknown conversion target {to!r}: choose one of {', '.join(_BYTES_PER_PARAM)}.")
    return param_count * _BYTES_PER_PARAM[key] + TOKENIZER_MARGIN_BYTES
