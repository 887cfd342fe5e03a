"""What a ModelSlim artifact is, for the rules of which node can serve it (endpoints/ascend_rules.py): its quant
description and the model dtype its W8A8 static layers were written for.

The console records neither. Artifact.inspection keeps the scheme only (inspection.py _modelslim_quantization:
method, scheme, description_file, version) and puts the scheme in its ``dtype`` ("W8A8"), as Artifact.dtype does;
the quantize job's params say which scheme was asked for, not the dtype written. So both are read here from the
artifact's directory, metadata only, through the confined readers (models_registry/paths.py): the description
JSON, and the dtype of every ``*.deq_scale`` tensor in the safetensors headers (hf_reader.read_safetensors_header,
no tensor data). vllm-ascend's w8a8_static.py (lines 66-69 at tag v0.23.0) creates deq_scale float32 for a
bfloat16 model and int64 (the float32 bits packed) for a float16 one, and msModelSlim writes it the same way
for the dtype it was saved for (msmodelslim_run.py sets it), so deq_scale's dtype is the checkpoint's dtype.
"""

from __future__ import annotations

import json
from pathlib import Path

from models_registry.hf_reader import HfDirError, read_safetensors_header
from models_registry.paths import PathRefused, read_confined
from models_registry.quantize.modelslim_check import CHECKPOINT_DTYPE, DESCRIPTION, safetensors_dtype

MIXED = "mixed"  # deq_scale in both packings: no one dtype serves every layer


def description_name(directory: Path, inspection: dict | None = None) -> str | None:
    """The description file's name: the one inspection recorded, else quant_model_description.json, else the
    first quant_model_description*.json (as inspection.py picks it)."""
    recorded = ((inspection or {}).get("quantization") or {}).get("description_file")
    if isinstance(recorded, str) and "/" not in recorded and recorded:
        return recorded
    names = sorted(p.name for p in Path(directory).glob("quant_model_description*.json"))
    if DESCRIPTION in names:
        return DESCRIPTION
    return names[0] if names else None


def read_description(directory: Path, inspection: dict | None = None) -> dict | None:
    """The quant description as a dict, or None when there is none or it cannot be read."""
    directory = Path(directory)
    name = description_name(directory, inspection)
    if name is None:
        return None
    try:
        desc = json.loads(read_confined(directory / name, tree=directory))
    except (OSError, ValueError, PathRefused):
        return None
    return desc if isinstance(desc, dict) else None


def checkpoint_dtype(directory: Path) -> str | None:
    """ "bfloat16" or "float16" from the deq_scale dtypes (float32 / int64) in the safetensors headers; None when
    the checkpoint has no deq_scale (no W8A8 static layer) or it cannot be read; MIXED when both packings occur."""
    found = set()
    for path in sorted(Path(directory).glob("*.safetensors")):
        try:
            header = read_safetensors_header(path)
        except (HfDirError, PathRefused):
            return None
        for name, entry in header.items():
            if name.endswith(".deq_scale") and isinstance(entry, dict):
                stored = safetensors_dtype(str(entry.get("dtype")))
                found.add(CHECKPOINT_DTYPE.get(stored, stored))
    if not found:
        return None
    return found.pop() if len(found) == 1 else MIXED


def modelslim_facts(directory: Path, inspection: dict | None = None) -> dict:
    """{"quant_description": ..., "checkpoint_dtype": ...} of a ModelSlim artifact's directory."""
    return {
        "quant_description": read_description(directory, inspection),
        "checkpoint_dtype": checkpoint_dtype(directory),
    }
