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
from console.form_layout import bind_errors
from console.roles import OPERATOR, VIEWER, at_least, require_role
from console.teams import team_role
from endpoints.bench.selectors import parse_ids
from evaluations import selectors, services
from evaluations import tasks as catalogue
from evaluations.compare import compare_rows
from evaluations.forms import CompareWithForm, EvaluationForm, TaskUploadForm
from evaluations.models import Evaluation


def _evaluation(request, evaluation_id: int) -> Evaluation:
    return selectors.evaluation_get(evaluation_id, user=request.user)


@require_role(VIEWER)
@require_GET
def evaluation_list(request):
    return _list_page(request)


def _list_page(request, *, new_form=None, upload_form=None):
    """The list with its two forms; a refused form is shown again with each error beside its field (400)."""
    tasks = catalogue.available_tasks()
    return render(
        request,
        "evaluations/evaluation_list.html",
        {
            "evaluations": selectors.recent(user=request.user, limit=100),
            "tasks": tasks,
            "new_form": new_form or EvaluationForm(task_names=[t.name for t in tasks], user=request.user),
            "upload_form": upload_form or TaskUploadForm(),
            "gates": selectors.recent_gates(user=request.user),
            "hf_home": settings.EVALUATION_HF_HOME,
            "max_task_bytes": settings.EVALUATION_TASK_MAX_BYTES,
        },
        status=400 if new_form is not None or upload_form is not None else 200,
    )


@require_role(OPERATOR)
@require_POST
def evaluation_new(request):
    form = EvaluationForm(request.POST, task_names=[t.name for t in catalogue.available_tasks()], user=request.user)
    if not form.is_valid():
        return _list_page(request, new_form=form)
    # The form offers the user's teams' endpoints and artifacts (another team's: "Choose an existing ..."); starting
    # one is an Operator's of that team (console.teams).
    for chosen in (form.cleaned_data["endpoint"], form.cleaned_data["artifact"]):
        if chosen is not None and not at_least(team_role(request.user, chosen.team_id), OPERATOR):
            raise Http404("Not found.")
    try:
        evaluation = services.evaluation_create(**form.cleaned_data, user=request.user, request=request)
    except ValidationError as exc:
        bind_errors(form, exc)
        return _list_page(request, new_form=form)
    except (Conflict, ServiceUnavailable) as exc:
        messages.error(request, str(exc))
        return redirect("evaluation_list")
    messages.success(request, f"Evaluation #{evaluation.pk} queued ({', '.join(evaluation.tasks)}).")
    return redirect(evaluation)


@require_role(OPERATOR)
@require_POST
def task_upload(request):
    form = TaskUploadForm(request.POST, request.FILES)
    if not form.is_valid():
        return _list_page(request, upload_form=form)
    data = dict(form.cleaned_data)
    upload = data.pop("file")
    try:
        task = services.uploaded_task_create(**data, upload=upload, user=request.user, request=request)
    except ValidationError as exc:
        bind_errors(form, exc)
        return _list_page(request, upload_form=form)
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
        {
            "evaluation": evaluation,
            "compare_form": CompareWithForm(others=others) if others else None,
            "chart": selectors.chart_rows([evaluation]),
        },
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
