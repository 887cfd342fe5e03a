"""The one reader of Hugging Face model directories (no weights loaded; Django only for the roots).

Lists a directory's files, reads ``config.json``, finds the weight files that make up the
checkpoint, reads safetensors headers and tells whether a tokenizer is there.  Inspection and
conversion both use it; each turns :class:`HfDirError` into its own error type.  Every walk and
read is confined (models_registry.paths): a link leading out of the model roots raises PathRefused.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

from models_registry.paths import open_confined, read_confined, tree_files

__all__ = [
    "TOKENIZER_FILES",
    "WEIGHT_INDEX_NAMES",
    "HfDirError",
    "WeightFiles",
    "has_tokenizer",
    "list_files",
    "names_have_tokenizer",
    "read_config",
    "read_safetensors_header",
    "weight_files",
]

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "spiece.model",
    "vocab.json",
    "vocab.txt",
    "tokenizer.tiktoken",
    "qwen.tiktoken",
    "tiktoken.model",
    "sentencepiece.bpe.model",
)
WEIGHT_INDEX_NAMES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
# A safetensors JSON header larger than this is certainly not one (the format caps it at 100 MB).
_MAX_SAFETENSORS_HEADER = 100 * 1024 * 1024


class HfDirError(ValueError):
    """Not a readable Hugging Face model directory; ``str()`` names the path and what is wrong."""


class WeightFiles(NamedTuple):
    kind: str  # "safetensors" | "bin"
    names: list[str]  # top-level file names, in load order
    index: str | None  # the weight index file, when there is one


def read_config(root) -> dict:
    """``config.json`` of a model directory, as a dict."""
    root = Path(root)
    if not root.is_dir():
        raise HfDirError(f"{root}: not a directory (it does not exist or is a file)")
    path = root / "config.json"
    if not path.is_file():
        raise HfDirError(f"{root}: no config.json, so not a Hugging Face model directory")
    try:
        config = json.loads(read_confined(path, tree=root).decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HfDirError(f"{path}: corrupt config.json: {e}") from e
    except OSError as e:
        raise HfDirError(f"{path}: cannot read config.json: {e}") from e
    if not isinstance(config, dict):
        raise HfDirError(f"{path}: corrupt config.json: expected a JSON object, got {type(config).__name__}")
    return config


def list_files(root) -> list[tuple[str, int]]:
    """(relative posix name, size) of every regular file under root, hidden entries skipped."""
    root = Path(root)
    out = []
    for full in tree_files(root, hidden=False):
        try:
            st = full.stat()  # follows links, checked by tree_files (HF cache snapshots link to blobs)
        except OSError:
            continue
        out.append((full.relative_to(root).as_posix(), st.st_size))
    out.sort()
    return out


def weight_files(root, names: Iterable[str] | None = None) -> WeightFiles | None:
    """The weight files that make up the checkpoint (safetensors preferred over .bin), or None.

    ``names``: the directory's relative file names when the caller has listed them already.
    """
    root = Path(root)
    if names is None:
        names = [rel for rel, _ in list_files(root)]
    top = sorted(n for n in names if "/" not in n)
    for index_name, kind in zip(WEIGHT_INDEX_NAMES, ("safetensors", "bin"), strict=False):
        if index_name not in top:
            continue
        try:
            index = json.loads(read_confined(root / index_name, tree=root).decode("utf-8"))
            listed = sorted(set(index["weight_map"].values()))
        except (json.JSONDecodeError, OSError, AttributeError, KeyError, TypeError, UnicodeDecodeError) as e:
            raise HfDirError(f"{root / index_name}: corrupt weight index: {e}") from e
        missing = [n for n in listed if n not in top]
        if missing:
            raise HfDirError(
                f"{root}: incomplete checkpoint: {index_name} lists {len(listed)} weight files, "
                f"{len(missing)} missing (e.g. {missing[0]})"
            )
        if listed:
            return WeightFiles(kind, listed, index_name)
    safetensors = [n for n in top if n.endswith(".safetensors")]
    if safetensors:
        if "model.safetensors" in safetensors:
            return WeightFiles("safetensors", ["model.safetensors"], None)
        # Mistral-style repos ship both consolidated.safetensors and model-*.safetensors.
        main = [n for n in safetensors if not n.startswith("consolidated")]
        return WeightFiles("safetensors", main or safetensors, None)
    if "pytorch_model.bin" in top:
        return WeightFiles("bin", ["pytorch_model.bin"], None)
    bins = [n for n in top if n.startswith("pytorch_model") and n.endswith(".bin")]
    return WeightFiles("bin", bins, None) if bins else None


def read_safetensors_header(path) -> dict:
    """The JSON header of a .safetensors file (tensor name -> dtype/shape/data_offsets), no tensor data read."""
    path = Path(path)
    try:
        with open_confined(path, tree=path.parent) as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise HfDirError(f"{path}: corrupt safetensors file: shorter than its 8-byte header length")
            (n,) = struct.unpack("<Q", raw)
            if n == 0 or n > _MAX_SAFETENSORS_HEADER:
                raise HfDirError(f"{path}: corrupt safetensors file: header length {n}")
            blob = f.read(n)
    except OSError as e:
        raise HfDirError(f"{path}: cannot read: {e}") from e
    if len(blob) != n:
        raise HfDirError(f"{path}: corrupt safetensors file: truncated header")
    try:
        header = json.loads(blob)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HfDirError(f"{path}: corrupt safetensors header: {e}") from e
    if not isinstance(header, dict):
        raise HfDirError(f"{path}: corrupt safetensors header: not a JSON object")
    return header


def names_have_tokenizer(names: Iterable[str]) -> bool:
    names = set(names)
    return any(n in names for n in TOKENIZER_FILES) or any(n.endswith(".tiktoken") for n in names)


def has_tokenizer(root) -> bool:
    root = Path(root)
    return root.is_dir() and names_have_tokenizer(p.name for p in tree_files(root) if p.parent == root)
