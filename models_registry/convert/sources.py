"""Weight sources for streaming conversions: safetensors (``safe_open``) and ``.bin``
(``torch.load(mmap=True)``), read tensor by tensor, large tensors in row slices."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator
from pathlib import Path

from models_registry.convert.common import CHUNK_BYTES, TORCH_TO_ST, ConversionError, first_line

# ----------------------------------------------------------------------------------------------
# 2. precision conversion (streaming)
# ----------------------------------------------------------------------------------------------


class SafetensorsSource:
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
                raise ConversionError(
                    f"{file.name} is not a valid safetensors file (corrupt or truncated): {first_line(exc)}"
                ) from exc
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
                raise ConversionError(f"{file.name} is not a valid safetensors file: {first_line(exc)}") from exc
            self._file = file
            self._read_since_open = 0
        return self._handle

    def rows(self, file: Path, name: str, shape: tuple[int, ...], itemsize: int) -> Iterator:
        """The tensor, in slices of at most ~CHUNK_BYTES along its first dimension."""
        nbytes = math.prod(shape) * itemsize
        try:
            if len(shape) == 0 or nbytes <= CHUNK_BYTES or shape[0] <= 1:
                tensor = self._open(file).get_tensor(name)
                self._read_since_open += nbytes
                yield tensor
                return
            step = max(1, CHUNK_BYTES // max(1, nbytes // shape[0]))
            for start in range(0, shape[0], step):
                chunk = self._open(file).get_slice(name)[start : start + step]
                self._read_since_open += chunk.numel() * chunk.element_size()
                yield chunk
        except self.errors as exc:
            raise ConversionError(
                f"{file.name}: tensor {name} cannot be read (corrupt file?): {first_line(exc)}"
            ) from exc

    def close(self) -> None:
        if self._handle is not None:
            with contextlib.suppress(Exception):
                self._handle.__exit__(None, None, None)
            self._handle = None


class BinSource:
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
                st = TORCH_TO_ST.get(str(tensor.dtype).removeprefix("torch."))
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
            raise ConversionError(
                f"{file.name} is not a readable PyTorch weights file (corrupt, truncated, or "
                f"not a zip-format checkpoint): {first_line(exc)}"
            ) from exc
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
        if len(shape) == 0 or nbytes <= CHUNK_BYTES or shape[0] <= 1:
            yield tensor
            return
        step = max(1, CHUNK_BYTES // max(1, nbytes // shape[0]))
        for start in range(0, shape[0], step):
            yield tensor[start : start + step]

    def close(self) -> None:
        self._cache = None
        self._cache_file = None


def cast_chunks(chunks: Iterable, name: str, dtype) -> Iterator:
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
