"""The tasks an evaluation may run on this host, air-gapped: the suites shipped in evaluations/suites/ (lm-eval task
YAML over local JSONL), the tasks Operators uploaded (UploadedTask), and lm-eval's registry tasks whose dataset is
already in the local Hugging Face cache. Anything else would need a download, and is refused with that reason.

The registry is read from lm-eval's own task files (lm_eval/tasks/**.yaml in the installed package, 0.4.13: each
has `task:` and `dataset_path:`, or takes them from the file it `include:`s) without importing lm-eval, which would
load datasets and torch into the web process."""

from __future__ import annotations

import importlib.util
import json
import os
import re
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

import yaml
from django.conf import settings

from evaluations.models import UploadedTask

SUITES_DIR = Path(__file__).resolve().parent / "suites"
# What the gates run: the shipped multiple-choice and generation suites.
DEFAULT_SUITE = ("console_mc", "console_gen")
# The figure each output type is judged on (a gate compares these; the pages list every metric).
PRIMARY_METRIC = {"multiple_choice": "acc,none", "generate_until": "exact_match,strip"}

_KEY = re.compile(r"^(task|dataset_path|include):\s*(.+?)\s*$", re.MULTILINE)


@dataclass(frozen=True)
class TaskInfo:
    name: str
    source: str  # shipped | uploaded | registry (cached)
    output_type: str
    documents: int | None
    description: str
    dataset: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


def _shipped_file(name: str) -> Path:
    return SUITES_DIR / f"{name}.yaml"


def _read_yaml(path: Path) -> dict:
    return yaml.safe_load(path.read_text()) or {}


def _documents(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())


def shipped_tasks() -> list[TaskInfo]:
    out = []
    for path in sorted(SUITES_DIR.glob("*.yaml")):
        config = _read_yaml(path)
        data = SUITES_DIR / config["dataset_kwargs"]["data_files"]["test"]
        first = next((line for line in path.read_text().splitlines() if line.startswith("#")), "#")
        out.append(
            TaskInfo(
                name=config["task"],
                source="shipped",
                output_type=config["output_type"],
                documents=_documents(data),
                description=first.lstrip("# ").strip(),
                dataset=data.name,
            )
        )
    return out


def uploaded_tasks() -> list[TaskInfo]:
    return [
        TaskInfo(
            name=t.name,
            source="uploaded",
            output_type=t.output_type,
            documents=t.documents,
            description=t.description,
            dataset=Path(t.path).name,
        )
        for t in UploadedTask.objects.all()
    ]


def hf_home() -> Path:
    return Path(settings.EVALUATION_HF_HOME)


def cached_datasets(home: Path | None = None) -> set[str]:
    """Dataset repos present in the Hugging Face cache: the hub cache's `datasets--owner--name` folders and the
    datasets library's `owner___name` ones (datasets 5.x reads either when offline)."""
    home = home or hf_home()
    found = set()
    hub = Path(os.environ.get("HF_HUB_CACHE") or home / "hub")
    if hub.is_dir():
        found |= {p.name[len("datasets--") :].replace("--", "/") for p in hub.glob("datasets--*") if p.is_dir()}
    data = home / "datasets"
    if data.is_dir():
        found |= {p.name.replace("___", "/") for p in data.iterdir() if p.is_dir() and not p.name.startswith(".")}
    return found


def _lm_eval_tasks_dir() -> Path | None:
    spec = importlib.util.find_spec("lm_eval")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "tasks"


@lru_cache(maxsize=1)
def registry_datasets() -> dict[str, str]:
    """lm-eval's registry tasks and their dataset repo: {task: dataset_path}, from the installed task files."""
    root = _lm_eval_tasks_dir()
    if root is None or not root.is_dir():
        return {}
    keys: dict[Path, dict[str, str]] = {}
    for path in root.rglob("*.yaml"):
        try:
            keys[path] = {k: v.strip("'\"") for k, v in _KEY.findall(path.read_text(errors="replace"))}
        except OSError:
            continue
    out = {}
    for path, found in keys.items():
        task = found.get("task")
        if not task or task.startswith("["):
            continue
        dataset = found.get("dataset_path")
        if not dataset and found.get("include"):  # one level of include, as most families use
            dataset = keys.get(path.parent / found["include"], {}).get("dataset_path")
        if dataset:
            out[task] = dataset
    return out


def registry_tasks(home: Path | None = None) -> list[TaskInfo]:
    cached = cached_datasets(home)
    if not cached:
        return []
    return [
        TaskInfo(name=t, source="registry", output_type="", documents=None, description="", dataset=d)
        for t, d in sorted(registry_datasets().items())
        if d in cached
    ]


def available_tasks() -> list[TaskInfo]:
    return [*shipped_tasks(), *uploaded_tasks(), *registry_tasks()]


def unavailable_reason(name: str, available: dict[str, TaskInfo]) -> str:
    if name in available:
        return ""
    dataset = registry_datasets().get(name)
    if dataset:
        return (
            f"{name!r} needs a download: its dataset {dataset!r} is not in this host's Hugging Face cache "
            f"({hf_home()}), and evaluations run offline"
        )
    return f"{name!r} is not a task here (GET /api/v1/evaluations/tasks lists them)"


def write_include_dir(names: list[str], target: Path) -> Path:
    """Task YAML for the shipped and uploaded tasks among `names`, with their JSONL named by absolute path (lm-eval
    reads a relative `data_files` from its working directory), into `target`, for lm-eval's include_path."""
    target.mkdir(parents=True, exist_ok=True)
    uploads = {t.name: t for t in UploadedTask.objects.filter(name__in=names)}
    for name in names:
        if _shipped_file(name).is_file():
            config = _read_yaml(_shipped_file(name))
            data = SUITES_DIR / config["dataset_kwargs"]["data_files"]["test"]
            config["dataset_kwargs"]["data_files"]["test"] = str(data)
        elif name in uploads:
            config = uploaded_config(uploads[name])
        else:
            continue
        (target / f"{name}.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return target


def uploaded_config(task: UploadedTask) -> dict:
    """The lm-eval task an upload stands for: the shipped suites' shape, its own templates."""
    config = {
        "task": task.name,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": task.path}},
        "test_split": "test",
        "output_type": task.output_type,
        "doc_to_text": task.doc_to_text,
        "doc_to_target": task.doc_to_target,
        "metadata": {"version": 1.0, "uploaded": True},
    }
    if task.output_type == UploadedTask.OutputType.MULTIPLE_CHOICE:
        config["doc_to_choice"] = task.doc_to_choice
        config["metric_list"] = [{"metric": m, "aggregation": "mean", "higher_is_better": True} for m in ("acc",)]
    else:
        config["generation_kwargs"] = {"until": task.until or ["\n"], "max_gen_toks": 32, "do_sample": False}
        config["filter_list"] = [
            {"name": "strip", "filter": [{"function": "remove_whitespace"}, {"function": "take_first"}]}
        ]
        config["metric_list"] = [
            {
                "metric": "exact_match",
                "aggregation": "mean",
                "higher_is_better": True,
                "ignore_case": True,
                "ignore_punctuation": True,
            }
        ]
    return config


def output_types(names: list[str]) -> dict[str, str]:
    known = {t.name: t.output_type for t in [*shipped_tasks(), *uploaded_tasks()]}
    return {n: known.get(n, "") for n in names}


def task_catalogue_json() -> list[dict]:
    return [t.as_dict() for t in available_tasks()]


def load_json_lines(raw: bytes) -> list[dict]:
    """Parse an upload's JSONL: every non-blank line a JSON object (ValueError naming the line otherwise)."""
    out = []
    for number, line in enumerate(raw.decode("utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            doc = json.loads(line)
        except ValueError as exc:
            raise ValueError(f"line {number} is not JSON ({exc})") from None
        if not isinstance(doc, dict):
            raise ValueError(f"line {number} is not a JSON object")
        out.append(doc)
    return out
