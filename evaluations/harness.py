"""The evaluation job's child process: lm-evaluation-harness (lm-eval 0.4.13) scoring one served model through
the console's gateway, with its `local-completions` model (`local-chat-completions` for generation-only runs).

Run as `python -m evaluations.harness SPEC.json OUT_DIR` by the `evaluate` job (evaluations/jobs.py) with an
allow-listed environment: the gateway key in OPENAI_API_KEY (what lm-eval's API models read,
lm_eval/models/openai_completions.py `api_key`) and Hugging Face offline (HF_DATASETS_OFFLINE=1, HF_HUB_OFFLINE=1),
so a task whose data is not on this host fails at once with the dataset's name instead of waiting on a
download. Imports lm-eval only, never Django: the job reads what it writes.

SPEC: {"base_url", "model", "api": "completions"|"chat", "tokenizer" (a local HF directory), "tasks": [names],
"include_path" (a directory of task YAML files, or null), "limit", "seed", "num_concurrent", "max_length"}.
OUT_DIR/results.json: {"results": {task: {metric: value, metric_stderr: se}}, "n": {task: samples},
"versions": {task: version, "lm_eval": ...}, "configs": {task: {output_type, ...}}}; OUT_DIR/samples.jsonl: one
line per scored document (task, doc_id, target, the model's answers or log-likelihoods, per-sample metrics).
On failure OUT_DIR/error.json: {"error": one line for the operator}."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import lm_eval
from lm_eval.tasks import TaskManager

# datasets' messages when offline mode meets a dataset that is not cached (datasets 5.x load.py / utils).
_OFFLINE_HINTS = ("offline", "couldn't reach", "localentrynotfound", "not cached", "couldn't find a dataset")


def _number(value):
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None  # lm-eval writes "N/A" for a standard error it could not compute


def _sample_line(task: str, sample: dict) -> dict:
    """What the samples file keeps of lm-eval's sample: the document's id, the target, what the model answered
    (a generation's text, or each choice's log-likelihood and whether it was greedy) and the per-sample metrics."""
    responses = sample.get("filtered_resps") or sample.get("resps") or []
    line = {"task": task, "doc_id": sample.get("doc_id"), "target": sample.get("target")}
    answers = []
    for response in responses:
        value = response[0] if isinstance(response, list) and len(response) == 1 else response
        if isinstance(value, tuple):  # a choice's (log-likelihood, is_greedy)
            value = list(value)
        answers.append(value if isinstance(value, (str, int, float, bool, list, type(None))) else str(value))
    line["answers"] = answers
    for key in ("acc", "acc_norm", "exact_match"):
        if key in sample:
            line[key] = sample[key]
    return line


def evaluate(spec: dict, out_dir: Path) -> dict:
    model = "local-chat-completions" if spec.get("api") == "chat" else "local-completions"
    path = "/v1/chat/completions" if model == "local-chat-completions" else "/v1/completions"
    model_args = {
        "model": spec["model"],
        "base_url": spec["base_url"].rstrip("/") + path,
        "tokenizer_backend": "huggingface",
        "tokenizer": spec["tokenizer"],
        "tokenized_requests": model == "local-completions",  # token-id prompts: what log-likelihoods need
        "num_concurrent": int(spec.get("num_concurrent") or 1),
        "max_retries": 2,
        "max_length": int(spec.get("max_length") or 2048),
        "seed": int(spec["seed"]),
        "timeout": 600,
    }
    if model == "local-chat-completions":
        model_args.pop("tokenized_requests")
    manager = TaskManager(include_path=spec.get("include_path") or None, include_defaults=True)
    seed = int(spec["seed"])
    output = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=list(spec["tasks"]),
        limit=spec.get("limit"),
        task_manager=manager,
        log_samples=True,
        random_seed=seed,
        numpy_random_seed=seed,
        torch_random_seed=seed,
        fewshot_random_seed=seed,
        apply_chat_template=model == "local-chat-completions",
    )
    results, n, configs = {}, {}, {}
    for task, figures in (output.get("results") or {}).items():
        results[task] = {k: _number(v) for k, v in figures.items() if k != "alias" and "," in k}
    for task, count in (output.get("n-samples") or {}).items():
        n[task] = count.get("effective") if isinstance(count, dict) else count
    for task, config in (output.get("configs") or {}).items():
        configs[task] = {k: config.get(k) for k in ("output_type", "num_fewshot", "dataset_path") if k in config}
    versions = {task: str(v) for task, v in (output.get("versions") or {}).items()}
    versions["lm_eval"] = getattr(lm_eval, "__version__", "")
    with open(out_dir / "samples.jsonl", "w") as f:
        for task, samples in (output.get("samples") or {}).items():
            f.writelines(json.dumps(_sample_line(task, sample), default=str) + "\n" for sample in samples)
    return {"results": results, "n": n, "versions": versions, "configs": configs, "model": model}


def operator_error(exc: BaseException, tasks: list[str]) -> str:
    """One line that says what went wrong; a dataset that offline mode could not find says it needs a download."""
    text = f"{type(exc).__name__}: {exc}".strip()
    first = text.splitlines()[0][:500]
    if any(hint in text.lower() for hint in _OFFLINE_HINTS):
        return (
            f"A task needs a download: its dataset is not in this host's Hugging Face cache and evaluations run "
            f"offline (HF_DATASETS_OFFLINE=1). Tasks: {', '.join(tasks)}. lm-eval said: {first}"
        )
    return f"lm-eval failed: {first}"


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    out_dir = Path(argv[1])
    try:
        summary = evaluate(spec, out_dir)
    except BaseException as exc:
        (out_dir / "error.json").write_text(json.dumps({"error": operator_error(exc, spec.get("tasks", []))}))
        raise
    (out_dir / "results.json").write_text(json.dumps(summary, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
