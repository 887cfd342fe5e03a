"""Perplexity on an evaluation set, the same token ids for every model compared.

`encode_eval` tokenises the evaluation texts once (with the source's tokenizer) into windows of at
most `window` tokens; `perplexity_hf` scores a transformers model on them; `perplexity_vllm` scores
a model served by vLLM through prompt_logprobs (the serving kernels are in the measurement)."""

from __future__ import annotations

import json
import math
import urllib.request


def encode_eval(tokenizer, texts: list[str], *, window: int = 512, max_tokens: int = 8192) -> list[list[int]]:
    """Each text is one sequence (BOS added as the tokenizer does); long ones are cut into windows."""
    windows: list[list[int]] = []
    total = 0
    for text in texts:
        ids = tokenizer(text)["input_ids"]
        for start in range(0, len(ids), window):
            chunk = ids[start : start + window]
            if len(chunk) < 2:
                continue
            windows.append(chunk)
            total += len(chunk) - 1
            if total >= max_tokens:
                return windows
    return windows


def scored_tokens(windows: list[list[int]]) -> int:
    return sum(len(w) - 1 for w in windows)


def perplexity_hf(model, windows: list[list[int]]) -> float:
    import torch

    nll, count = 0.0, 0
    model.eval()
    with torch.inference_mode():
        for ids in windows:
            x = torch.tensor([ids])
            logits = model(input_ids=x, use_cache=False).logits[0, :-1].float()
            target = x[0, 1:]
            logp = torch.log_softmax(logits, dim=-1)
            nll -= float(logp.gather(1, target[:, None]).sum())
            count += len(ids) - 1
    if count == 0:
        raise ValueError("The evaluation set encodes to no scorable tokens.")
    return math.exp(nll / count)


def perplexity_vllm(
    base_url: str, model_name: str, windows: list[list[int]], *, api_key: str, timeout: float = 300
) -> float:
    """Score the same token ids through a running vLLM OpenAI server (completions, prompt_logprobs=0) that
    wants ``api_key``."""
    nll, count = 0.0, 0
    for ids in windows:
        body = json.dumps(
            {"model": model_name, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 0, "temperature": 0}
        ).encode()
        req = urllib.request.Request(
            f"{base_url}/v1/completions",
            data=body,
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {api_key}"},
        )
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            out = json.load(resp)
        plp = out["choices"][0]["prompt_logprobs"]
        for tok, entry in zip(ids[1:], plp[1:], strict=False):
            value = entry.get(str(tok)) if isinstance(entry, dict) else None
            if value is None:
                raise ValueError("vLLM did not return the prompt token's logprob.")
            nll -= float(value["logprob"] if isinstance(value, dict) else value)
            count += 1
    return math.exp(nll / max(count, 1))
