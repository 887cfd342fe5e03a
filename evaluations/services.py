"""Writes for evaluations: start one (of an endpoint, or of an artifact launched for the purpose), upload a task,
and what the `evaluate` job records. Each state change is audited."""

from __future__ import annotations

import ast
import hashlib
from pathlib import Path

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone
from jinja2 import StrictUndefined, TemplateError
from jinja2.sandbox import SandboxedEnvironment

from console.audit import audit_log
from console.validation import int_in_range
from endpoints.models import Endpoint
from endpoints.services import launch_refusal
from evaluations import tasks as catalogue
from evaluations.models import Evaluation, EvaluationStatus, UploadedTask
from models_registry.models import Artifact
from workers.jobs.services import job_enqueue

TASK_NAME_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789_"
MAX_TASKS = 20


def checked_tasks(names) -> list[str]:
    """The requested task names, each available here (shipped, uploaded, or a registry task whose dataset is
    cached); a task needing a download is refused with that reason, naming the field."""
    if isinstance(names, str):
        names = [n for n in names.replace(",", " ").split() if n]
    if not isinstance(names, (list, tuple)) or not names or not all(isinstance(n, str) for n in names):
        raise ValidationError({"tasks": "Name one task or more (GET /api/v1/evaluations/tasks lists them)."})
    names = list(dict.fromkeys(n.strip() for n in names if n.strip()))
    if len(names) > MAX_TASKS:
        raise ValidationError({"tasks": f"At most {MAX_TASKS} tasks in one evaluation."})
    available = {t.name: t for t in catalogue.available_tasks()}
    problems = [reason for n in names if (reason := catalogue.unavailable_reason(n, available))]
    if problems:
        raise ValidationError({"tasks": "; ".join(problems) + "."})
    return names


def checked_limit(limit) -> int | None:
    return int_in_range(
        limit,
        "limit",
        low=1,
        high=settings.EVALUATION_MAX_LIMIT,
        message=f"limit must be a whole number of documents per task, 1 to {settings.EVALUATION_MAX_LIMIT} "
        "(blank: every document).",
    )


def tokenizer_refusal(artifact: Artifact) -> str:
    """lm-eval counts the prompt's tokens itself (a log-likelihood's context length): it needs the artifact's
    tokenizer files in a local Hugging Face directory."""
    path = Path(artifact.path)
    if not path.is_dir() or not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return (
            f"{artifact} has no Hugging Face tokenizer files (tokenizer.json) in {path}: an evaluation needs them "
            "to count tokens (convert a GGUF artifact to HF first)."
        )
    return ""


def evaluation_create(
    *,
    endpoint: Endpoint | None = None,
    artifact: Artifact | None = None,
    tasks,
    limit=None,
    seed: int | None = None,
    api: str = "completions",
    node: str | int | None = None,
    label: str = "",
    purpose: str = Evaluation.Purpose.MANUAL,
    user=None,
    request=None,
) -> Evaluation:
    """Queue an evaluation of a running endpoint (scored through the gateway) or of an artifact (an endpoint is
    launched for it on `node`, scored the same way, then stopped and deleted)."""
    if (endpoint is None) == (artifact is None):
        raise ValidationError({"endpoint": "Give an endpoint or an artifact, not both."})
    names = checked_tasks(tasks)
    limit = checked_limit(limit)
    if api not in ("completions", "chat"):
        raise ValidationError({"api": "api must be completions or chat."})
    types = catalogue.output_types(names)
    if api == "chat" and any(t == "multiple_choice" for t in types.values()):
        raise ValidationError(
            {"api": "Chat completions give no prompt log-likelihoods: multiple-choice tasks need api completions."}
        )
    if endpoint is not None:
        if endpoint.desired_state != Endpoint.Desired.RUNNING:
            raise ValidationError({"endpoint": f"{endpoint.name} is not running: start it first."})
        artifact = endpoint.artifact
    assert artifact is not None  # the one given, or the endpoint's (checked above: exactly one of the two)
    if refusal := tokenizer_refusal(artifact):
        raise ValidationError({"artifact" if endpoint is None else "endpoint": refusal})
    if endpoint is None:
        from_registry = launch_refusal(artifact)
        if from_registry:
            raise ValidationError({"artifact": from_registry})
    seed = settings.EVALUATION_SEED if seed is None else int_in_range(seed, "seed", low=0, high=2**31 - 1)
    with transaction.atomic():
        evaluation = Evaluation.objects.create(
            endpoint=endpoint,
            endpoint_name=endpoint.name if endpoint else "",
            artifact=artifact,
            artifact_label=str(artifact),
            launched=endpoint is None,
            tasks=names,
            limit=limit,
            seed=seed,
            api=api,
            purpose=purpose,
            label=label.strip()[:200],
            spec={"node": str(node)} if node not in (None, "") else {},
            created_by=user if getattr(user, "pk", None) else None,
        )
        job = job_enqueue(
            kind="evaluate",
            params={"evaluation": evaluation.pk},
            user=user,
            target=evaluation,
            timeout_s=settings.EVALUATION_TIMEOUT_SECONDS,
            request=request,
        )
        evaluation.job = job
        evaluation.save(update_fields=["job"])
        audit_log(
            actor=user,
            action="evaluation.create",
            obj=evaluation,
            request=request,
            via="" if request else "system",
            changes={
                "endpoint": evaluation.endpoint_name or None,
                "artifact": artifact.pk,
                "tasks": names,
                "limit": limit,
                "seed": seed,
                "purpose": purpose,
            },
        )
    return evaluation


def record_status(evaluation: Evaluation, status: str, **fields) -> None:
    Evaluation.objects.filter(pk=evaluation.pk).update(status=status, **fields)
    for name, value in {"status": status, **fields}.items():
        setattr(evaluation, name, value)


def record_failure(evaluation: Evaluation, error: str) -> None:
    record_status(evaluation, EvaluationStatus.FAILED, error=error[:4000], finished_at=timezone.now())


def results_rows(summary: dict) -> list[dict]:
    """lm-eval's figures as rows: {"task", "metric", "value", "stderr", "n"}; a metric's key is "name,filter"
    and its standard error "name_stderr,filter" (lm-eval 0.4.13 evaluator_utils.consolidate_results)."""
    rows = []
    for task, figures in sorted((summary.get("results") or {}).items()):
        for key, value in sorted(figures.items()):
            name, _, flt = key.partition(",")
            if name.endswith("_stderr"):
                continue
            rows.append(
                {
                    "task": task,
                    "metric": key,
                    "value": value,
                    "stderr": figures.get(f"{name}_stderr,{flt}"),
                    "n": (summary.get("n") or {}).get(task),
                }
            )
    return rows


def uploaded_task_create(
    *,
    name: str,
    upload,
    output_type: str,
    doc_to_text: str,
    doc_to_target: str,
    doc_to_choice: str = "",
    until=None,
    description: str = "",
    user=None,
    request=None,
) -> UploadedTask:
    """Keep an Operator's task: its JSONL (refused by size before it is read) and lm-eval template fields, each
    rendered on the first document to prove it works."""
    errors = {}
    name = (name or "").strip()
    if not name or len(name) > 64 or any(c not in TASK_NAME_CHARS for c in name) or not name[0].isalpha():
        errors["name"] = "A task name is 1-64 lower-case letters, digits and underscores, starting with a letter."
    elif name in {t.name for t in catalogue.shipped_tasks()} or UploadedTask.objects.filter(name=name).exists():
        errors["name"] = f"A task named {name!r} exists already."
    elif name in catalogue.registry_datasets():
        errors["name"] = f"{name!r} is the name of an lm-eval registry task: choose another."
    if output_type not in UploadedTask.OutputType.values:
        errors["output_type"] = "output_type must be multiple_choice or generate_until."
    for field, value in (("doc_to_text", doc_to_text), ("doc_to_target", doc_to_target)):
        if not (value or "").strip():
            errors[field] = f"{field} is needed (a Jinja template over a document's fields, e.g. {{{{question}}}})."
    if output_type == UploadedTask.OutputType.MULTIPLE_CHOICE and not (doc_to_choice or "").strip():
        errors["doc_to_choice"] = "A multiple-choice task needs doc_to_choice (e.g. {{choices}})."
    if isinstance(until, str):
        until = [u for u in until.split("|") if u] if until else []
    until = list(until or [])
    if upload is None:
        errors["file"] = "Choose a JSONL file."
    elif upload.size > settings.EVALUATION_TASK_MAX_BYTES:
        errors["file"] = f"The file is {upload.size} bytes; at most {settings.EVALUATION_TASK_MAX_BYTES} are accepted."
    if errors:
        raise ValidationError(errors)
    raw = upload.read()
    try:
        docs = catalogue.load_json_lines(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValidationError({"file": f"Not JSONL: {exc}."}) from None
    if not docs:
        raise ValidationError({"file": "The file holds no document."})
    template_errors = render_check(
        docs, output_type=output_type, text=doc_to_text, target=doc_to_target, choice=doc_to_choice
    )
    if template_errors:
        raise ValidationError(template_errors)
    directory = Path(settings.EVALUATION_DATA_DIR) / "tasks"
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.jsonl"
    path.write_bytes(raw)
    task = UploadedTask.objects.create(
        name=name,
        description=description.strip()[:300],
        output_type=output_type,
        doc_to_text=doc_to_text,
        doc_to_target=doc_to_target,
        doc_to_choice=doc_to_choice if output_type == UploadedTask.OutputType.MULTIPLE_CHOICE else "",
        until=until,
        path=str(path),
        documents=len(docs),
        size_bytes=len(raw),
        sha256=hashlib.sha256(raw).hexdigest(),
        created_by=user if getattr(user, "pk", None) else None,
    )
    audit_log(
        actor=user,
        action="evaluation_task.upload",
        obj=task,
        request=request,
        changes={"name": name, "documents": len(docs), "bytes": len(raw), "sha256": task.sha256},
    )
    return task


def render_check(docs: list[dict], *, output_type: str, text: str, target: str, choice: str) -> dict:
    """Render the templates on every document the way lm-eval does (Jinja2 over the document's fields): a template
    that names a missing field, a target that is not a choice's index or text, or choices that are not a list, is
    refused with the document's line."""
    env = SandboxedEnvironment(undefined=StrictUndefined)
    try:
        templates = {"doc_to_text": env.from_string(text), "doc_to_target": env.from_string(target)}
        if output_type == UploadedTask.OutputType.MULTIPLE_CHOICE:
            templates["doc_to_choice"] = env.from_string(choice)
    except TemplateError as exc:
        return {"doc_to_text": f"A template does not parse: {exc}."}
    for number, doc in enumerate(docs, start=1):
        rendered = {}
        for field, template in templates.items():
            try:
                rendered[field] = template.render(**doc)
            except (TemplateError, TypeError, ValueError) as exc:
                return {field: f"Document {number}: {exc}."}
        if output_type == UploadedTask.OutputType.MULTIPLE_CHOICE:
            try:
                choices = ast.literal_eval(rendered["doc_to_choice"])
            except (ValueError, SyntaxError):
                return {"doc_to_choice": f"Document {number}: doc_to_choice must render a list of strings."}
            if not isinstance(choices, list) or len(choices) < 2:
                return {"doc_to_choice": f"Document {number}: doc_to_choice must render a list of 2 or more choices."}
            answer = rendered["doc_to_target"].strip()
            if not (answer.isdigit() and int(answer) < len(choices)) and answer not in choices:
                return {"doc_to_target": f"Document {number}: the target {answer!r} is not a choice or its index."}
    return {}
