"""Logits of two artifacts on :data:`VERIFY_PROMPTS` (float32 compute): the check after a
precision conversion."""

from __future__ import annotations

import contextlib
from pathlib import Path

from models_registry.convert.common import (
    ConversionError,
    check_architecture,
    find_weight_files,
    first_line,
    read_hf_config,
    require_tokenizer,
)
from models_registry.convert.from_gguf import load_gguf_tokenizer, open_gguf
from models_registry.convert.progress import silent_progress, transformers_progress
from models_registry.paths import gguf_files_in

# Fixed prompts for logits verification: short, plain English, stable across tokenizers.
VERIFY_PROMPTS = [
    "The capital of France is",
    "Water boils at one hundred degrees Celsius at sea level.",
    "Once upon a time, a little robot learned to read.",
]

# ----------------------------------------------------------------------------------------------
# 3. logits comparison
# ----------------------------------------------------------------------------------------------


def resolve_model_source(path: Path) -> tuple[Path, str | None]:
    """(directory, gguf file name or None) for an HF directory, a .gguf file, or a dir holding one GGUF."""
    path = Path(path)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path.parent, path.name
    if path.is_dir():
        if (path / "config.json").is_file():
            return path, None
        ggufs = gguf_files_in(path)
        if len(ggufs) == 1:
            return path, ggufs[0].name
    if not path.exists():
        raise ConversionError(f"Model path {path} does not exist.")
    raise ConversionError(f"{path} is neither a Hugging Face model directory (config.json) nor a GGUF file.")


def _load_for_compare(path: Path):
    import torch
    from transformers import AutoModelForCausalLM

    directory, gguf_name = resolve_model_source(path)
    if gguf_name:
        open_gguf(directory / gguf_name)  # clear errors for corrupt files
        kwargs = {"gguf_file": gguf_name}
    else:
        cfg = read_hf_config(directory)
        check_architecture(cfg, directory, causal_lm=True)
        find_weight_files(directory)
        kwargs = {}
    try:
        with transformers_progress(silent_progress):
            model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32, **kwargs)
    except ConversionError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise ConversionError(f"transformers cannot load {path}: {first_line(exc)}") from exc
    model.eval()
    return model


def _load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    directory, gguf_name = resolve_model_source(path)
    if gguf_name is None:
        require_tokenizer(directory)
    try:
        if gguf_name:
            return load_gguf_tokenizer(directory / gguf_name)[0]
        return AutoTokenizer.from_pretrained(str(directory))
    except ConversionError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise ConversionError(f"Cannot load the tokenizer of {path}: {first_line(exc)}") from exc


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
            cand_tok(p, return_tensors="pt")["input_ids"].tolist() == b.tolist()
            for p, b in zip(prompts, batches, strict=False)
        )

    ref = _model_logits(reference_dir, batches)
    cand = _model_logits(candidate_dir, batches)
    max_abs, mean_abs, min_cos, agree, tokens = 0.0, 0.0, 1.0, 0, 0
    for r, c in zip(ref, cand, strict=False):
        if r.shape != c.shape:
            raise ConversionError(
                f"The models' logits differ in shape ({tuple(r.shape)} vs {tuple(c.shape)}): "
                f"they do not share a vocabulary."
            )
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
