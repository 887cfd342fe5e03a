"""Evaluation pages: the list with the forms to start one and to upload a task, an evaluation's results and samples,
and the comparison of two."""

from pathlib import Path

from django.conf import settings
from django.contrib import messages
from django.core.exceptions import ValidationError
from django.http import FileResponse, Http404
from django.shortcuts import redirect, render
from django.views.decorators.http import require_GET, require_POST

from console.exceptions import Conflict, ServiceUnavailable
from console.roles import OPERATOR, VIEWER, require_role
from console.teams import visible
from console.validation import error_text
from endpoints.bench.selectors import parse_ids
from endpoints.models import Endpoint
from endpoints.selectors import endpoint_get
from evaluations import selectors, services
from evaluations import tasks as catalogue
from evaluations.compare import compare_rows
from evaluations.models import Evaluation
from models_registry.models import Artifact
from models_registry.selectors import artifact_get


def _evaluation(request, evaluation_id: int) -> Evaluation:
    return selectors.evaluation_get(evaluation_id, user=request.user)


def _posted(request, name: str, get):
    """The endpoint or artifact the form names: another team's is a 404, as one that does not exist; an Operator
    of its team only (console.teams)."""
    raw = request.POST.get(name, "").strip()
    if not raw:
        return None
    if not raw.isdigit():
        raise Http404("Not found.")
    return get(int(raw), user=request.user, role=OPERATOR)


@require_role(VIEWER)
@require_GET
def evaluation_list(request):
    return render(
        request,
        "evaluations/evaluation_list.html",
        {
            "evaluations": selectors.recent(user=request.user, limit=100),
            "tasks": catalogue.available_tasks(),
            "endpoints": visible(
                Endpoint.objects.filter(desired_state=Endpoint.Desired.RUNNING), request.user
            ).order_by("name"),
            "artifacts": visible(Artifact.objects.alive(), request.user)
            .select_related("model")
            .order_by("model__name", "pk"),
            "gates": selectors.recent_gates(user=request.user),
            "hf_home": settings.EVALUATION_HF_HOME,
            "max_task_bytes": settings.EVALUATION_TASK_MAX_BYTES,
        },
    )


@require_role(OPERATOR)
@require_POST
def evaluation_new(request):
    post = request.POST
    try:
        endpoint = _posted(request, "endpoint", endpoint_get)
        artifact = _posted(request, "artifact", artifact_get)
        evaluation = services.evaluation_create(
            endpoint=endpoint,
            artifact=artifact,
            tasks=post.getlist("tasks"),
            limit=post.get("limit") or None,
            label=post.get("label", ""),
            user=request.user,
            request=request,
        )
    except ValidationError as exc:
        messages.error(request, "Evaluation not started: " + error_text(exc))
        return redirect("evaluation_list")
    except (Conflict, ServiceUnavailable) as exc:
        messages.error(request, str(exc))
        return redirect("evaluation_list")
    messages.success(request, f"Evaluation #{evaluation.pk} queued ({', '.join(evaluation.tasks)}).")
    return redirect(evaluation)


@require_role(OPERATOR)
@require_POST
def task_upload(request):
    post = request.POST
    try:
        task = services.uploaded_task_create(
            name=post.get("name", ""),
            upload=request.FILES.get("file"),
            output_type=post.get("output_type", ""),
            doc_to_text=post.get("doc_to_text", ""),
            doc_to_target=post.get("doc_to_target", ""),
            doc_to_choice=post.get("doc_to_choice", ""),
            until=post.get("until", ""),
            description=post.get("description", ""),
            user=request.user,
            request=request,
        )
    except ValidationError as exc:
        messages.error(request, "Task not added: " + error_text(exc))
        return redirect("evaluation_list")
    messages.success(request, f"Task {task.name} added ({task.documents} documents).")
    return redirect("evaluation_list")


@require_role(VIEWER)
@require_GET
def evaluation_detail(request, evaluation_id: int):
    evaluation = _evaluation(request, evaluation_id)
    others = (
        selectors.evaluations_of(request.user)
        .filter(status="succeeded")
        .exclude(pk=evaluation.pk)
        .order_by("-created_at")[:20]
    )
    return render(
        request,
        "evaluations/evaluation_detail.html",
        {"evaluation": evaluation, "others": others, "chart": selectors.chart_rows([evaluation])},
    )


@require_role(VIEWER)
@require_GET
def evaluation_samples(request, evaluation_id: int):
    """The scored documents lm-eval logged, as JSON lines: only the file the job recorded, inside the data dir."""
    evaluation = _evaluation(request, evaluation_id)
    root = Path(settings.EVALUATION_DATA_DIR).resolve()
    path = Path(evaluation.samples_path).resolve() if evaluation.samples_path else None
    if path is None or root not in path.parents or not path.is_file():
        raise Http404("This evaluation kept no samples.")
    return FileResponse(
        open(path, "rb"),
        as_attachment=True,
        filename=f"evaluation-{evaluation.pk}-samples.jsonl",
        content_type="application/x-ndjson",
    )


@require_role(VIEWER)
@require_GET
def evaluation_compare(request):
    """Two evaluations (the first the baseline): each common figure, the difference and whether it is beyond noise."""
    ids = parse_ids(request.GET.getlist("ids"))[:2]
    found = {e.pk: e for e in selectors.evaluations_of(request.user).filter(pk__in=ids).select_related("job")}
    pair = [found[i] for i in ids if i in found]
    rows = compare_rows(pair[0].results, pair[1].results) if len(pair) == 2 else []
    return render(
        request,
        "evaluations/compare.html",
        {"pair": pair, "rows": rows, "chart": selectors.chart_rows(pair)},
    )
