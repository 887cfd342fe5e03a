"""The one GGUF header reader: metadata and tensor table, never tensor data (Django only for the roots).

Inspection (what a GGUF holds) and conversion (GGUF -> HF) both read headers through
:func:`read_gguf_header`; each turns :class:`GgufHeaderError` into its own error type.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

from models_registry.paths import open_confined

__all__ = ["GGUF_MAGIC", "GGUFArray", "GgufHeaderError", "NotGgufError", "read_gguf_header"]

GGUF_MAGIC = b"GGUF"


class GgufHeaderError(ValueError):
    """The file is not a readable GGUF (bad magic, truncated or corrupt header); ``str()`` names the path."""


class NotGgufError(GgufHeaderError):
    """The file does not start with the GGUF magic bytes."""


class GGUFArray(list):
    """A long GGUF metadata array that was skipped, not read: ``len()`` is its length, items are absent."""

    def __init__(self, length: int, item_type: int):
        super().__init__()
        self.length = length
        self.item_type = item_type

    def __len__(self):
        return self.length

    def __repr__(self):
        return f"GGUFArray(length={self.length}, item_type={self.item_type})"


# value type id -> struct format of a scalar (8 = string and 9 = array are handled apart)
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_MAX_COUNT = 1 << 24  # sanity bound on tensor/kv counts and dimensions
_GGUF_READ_ARRAY_MAX = 4096  # numeric arrays longer than this, and string arrays longer than this, are skipped


def read_gguf_header(path) -> dict:
    """Parse a GGUF file's header (metadata and tensor table) without reading tensor data.

    Returns ``{"version", "metadata": {key: value}, "tensors": [{"name", "shape" (torch order),
    "type" (e.g. "Q8_0"), "offset" (from data_offset), "n_elements", "n_bytes"}], "data_offset",
    "alignment", "file_size"}``.  Arrays longer than 4096 items (the vocabulary, the merges) come back
    as :class:`GGUFArray` holding only their length.

    This is a lean parser over the ``gguf`` package's constants rather than ``gguf.GGUFReader``:
    the reader turns every vocabulary entry into numpy views, which takes seconds for a 150k-token
    vocabulary; this takes milliseconds.  Raises :class:`GgufHeaderError` on a bad or truncated header.
    """
    import mmap

    try:
        import gguf
    except ImportError as e:  # pragma: no cover
        raise GgufHeaderError("the 'gguf' package is needed to inspect GGUF files") from e

    path = Path(path)
    try:
        f = open_confined(path, tree=path.parent)
        size = os.fstat(f.fileno()).st_size
    except OSError as e:
        raise GgufHeaderError(f"{path}: cannot read: {e}") from e
    with f:
        if size < 24:
            raise GgufHeaderError(f"{path}: corrupt GGUF header: file is only {size} bytes")
        if f.read(4) != GGUF_MAGIC:
            raise NotGgufError(f"{path}: not a GGUF file (bad magic, expected {GGUF_MAGIC!r})")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            try:
                return _parse_gguf(mm, size, gguf)
            except GgufHeaderError as e:
                raise GgufHeaderError(f"{path}: {e}") from None
            except (struct.error, UnicodeDecodeError, ValueError, OverflowError, MemoryError) as e:
                raise GgufHeaderError(f"{path}: corrupt GGUF header: {type(e).__name__}: {e}") from e


def _parse_gguf(buf, size: int, gguf) -> dict:
    pos = 4
    (version,) = struct.unpack_from("<I", buf, pos)
    endian = "<"
    if version & 0xFFFF == 0 and version != 0:  # a big-endian file
        endian = ">"
        (version,) = struct.unpack_from(">I", buf, pos)
    if version not in (1, 2, 3):
        raise GgufHeaderError(f"corrupt GGUF header: unsupported version {version}")
    pos += 4
    count_fmt = endian + ("I" if version == 1 else "Q")
    count_size = struct.calcsize(count_fmt)

    def need(n):
        if pos + n > size:
            raise GgufHeaderError(f"corrupt GGUF header: truncated at byte {pos} (needs {n} more, file is {size})")

    def read(fmt):
        nonlocal pos
        fmt = endian + fmt
        n = struct.calcsize(fmt)
        need(n)
        out = struct.unpack_from(fmt, buf, pos)
        pos += n
        return out[0] if len(out) == 1 else out

    def read_count():
        nonlocal pos
        need(count_size)
        (n,) = struct.unpack_from(count_fmt, buf, pos)
        pos += count_size
        return n

    def read_str():
        nonlocal pos
        n = read_count()
        need(n)
        out = bytes(buf[pos : pos + n]).decode("utf-8")
        pos += n
        return out

    def skip_strs(count):
        nonlocal pos
        for _ in range(count):
            n = read_count()
            need(n)
            pos += n

    def read_value(vtype):
        nonlocal pos
        if vtype in _GGUF_SCALARS:
            return read(_GGUF_SCALARS[vtype])
        if vtype == 8:
            return read_str()
        if vtype == 9:
            item_type = read("I")
            count = read_count()
            if item_type in _GGUF_SCALARS:
                width = struct.calcsize(_GGUF_SCALARS[item_type])
                need(count * width)
                if count > _GGUF_READ_ARRAY_MAX:
                    pos += count * width
                    return GGUFArray(count, item_type)
                out = list(struct.unpack_from(f"{endian}{count}{_GGUF_SCALARS[item_type]}", buf, pos))
                pos += count * width
                return out
            if item_type == 8:
                if count > _GGUF_READ_ARRAY_MAX:
                    skip_strs(count)
                    return GGUFArray(count, item_type)
                return [read_str() for _ in range(count)]
            if item_type == 9:
                return [read_value(9) for _ in range(count)]
            raise GgufHeaderError(f"corrupt GGUF header: unknown array item type {item_type}")
        raise GgufHeaderError(f"corrupt GGUF header: unknown value type {vtype}")

    n_tensors = read_count()
    n_kv = read_count()
    if n_tensors > _GGUF_MAX_COUNT or n_kv > _GGUF_MAX_COUNT:
        raise GgufHeaderError(f"corrupt GGUF header: {n_tensors} tensors, {n_kv} metadata keys")

    metadata = {}
    for _ in range(n_kv):
        key = read_str()
        vtype = read("I")
        metadata[key] = read_value(vtype)

    tensors = []
    for _ in range(n_tensors):
        name = read_str()
        n_dims = read("I")
        if n_dims > 8:
            raise GgufHeaderError(f"corrupt GGUF header: tensor {name!r} has {n_dims} dimensions")
        dims = [read_count() for _ in range(n_dims)]
        type_id = read("I")
        offset = read("Q")
        try:
            qtype = gguf.GGMLQuantizationType(type_id)
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise GgufHeaderError(f"corrupt GGUF header: tensor {name!r} has unknown type {type_id}") from None
        n_elements = 1
        for d in dims:
            n_elements *= d
        tensors.append(
            {
                "name": name,
                "shape": list(reversed(dims)),  # GGUF lists the fastest-varying dimension first
                "type": qtype.name,
                "offset": offset,
                "n_elements": n_elements,
                "n_bytes": n_elements // block * type_size,
            }
        )

    alignment = metadata.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise GgufHeaderError(f"corrupt GGUF header: bad general.alignment {alignment!r}")
    data_offset = pos + (-pos % alignment)
    return {
        "version": version,
        "metadata": metadata,
        "tensors": tensors,
        "data_offset": data_offset,
        "alignment": alignment,
        "file_size": size,
    }
