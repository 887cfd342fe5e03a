"""The streaming safetensors writer: shards written tensor by tensor, never held in memory."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from models_registry.convert.common import ST_ITEMSIZE, TORCH_TO_ST, ConversionError

# ----------------------------------------------------------------------------------------------
# streaming safetensors writer
# ----------------------------------------------------------------------------------------------


class ShardWriter:
    """Write safetensors shards tensor by tensor without holding a shard in memory.

    The full list of ``(name, st_dtype, shape)`` is known up front, so each shard's header is
    written first and the tensors' bytes are appended as they come (in the planned order).
    Writes ``model.safetensors`` or ``model-0000i-of-0000N.safetensors`` plus
    ``model.safetensors.index.json``.
    """

    def __init__(
        self,
        out_dir: Path,
        plan: list[tuple[str, str, tuple[int, ...]]],
        *,
        max_shard_bytes: int,
        metadata: dict | None = None,
    ):
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
            nbytes = math.prod(shape) * ST_ITEMSIZE[st_dtype]
            if not shards or (size + nbytes > max_shard_bytes and shards[-1]):
                shards.append([])
                size = 0
            shards[-1].append(i)
            size += nbytes
        if not shards:
            raise ConversionError("No tensors to write.")
        n = len(shards)
        self.shard_names = (
            ["model.safetensors"] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
        )
        self.shard_of = {}
        for k, idxs in enumerate(shards):
            for i in idxs:
                self.shard_of[i] = k
        self.shards = shards
        self.next = 0
        self.fh = None
        self.current = -1
        self.expected_end = 0
        self.total_bytes = sum(math.prod(s) * ST_ITEMSIZE[d] for _, d, s in plan)
        self.total_params = sum(math.prod(s) for _, _, s in plan)

    def _open_shard(self, k: int) -> None:
        self._close_shard()
        header: dict[str, Any] = {"__metadata__": self.metadata}
        offset = 0
        for i in self.shards[k]:
            name, st_dtype, shape = self.plan[i]
            nbytes = math.prod(shape) * ST_ITEMSIZE[st_dtype]
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
                raise ConversionError(
                    f"Internal error: shard {self.shard_names[self.current]} has {pos} bytes, "
                    f"expected {self.expected_end}."
                )

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
        expected = math.prod(shape) * ST_ITEMSIZE[st_dtype]
        k = self.shard_of[self.next]
        if k != self.current:
            self._open_shard(k)
        written = 0
        for chunk in chunks:
            if TORCH_TO_ST.get(str(chunk.dtype).removeprefix("torch.")) != st_dtype:
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
