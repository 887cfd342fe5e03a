from django.contrib import messages
from django.core.exceptions import ValidationError
from django.shortcuts import redirect, render
from django.views.decorators.http import require_GET, require_POST

from console.exceptions import Conflict, ServiceUnavailable
from console.form_layout import errors_by_field
from console.roles import OPERATOR, VIEWER, require_role
from console.validation import error_lines
from models_registry.quantize import selectors, services
from models_registry.quantize.forms import QuantizeForm
from models_registry.selectors import artifact_get


@require_role(OPERATOR)
@require_POST
def artifact_quantize(request, artifact_id: int):
    artifact = artifact_get(artifact_id, user=request.user, role=OPERATOR)  # another team's: 404
    try:
        job = services.artifact_quantize(
            artifact=artifact, user=request.user, options=QuantizeForm(request.POST).options(), request=request
        )
    except ValidationError as exc:
        for m in error_lines(exc):
            messages.error(request, m)
        return redirect(artifact)
    except (Conflict, ServiceUnavailable) as exc:
        messages.error(request, str(exc))
        if isinstance(exc, Conflict) and exc.link:
            return redirect(exc.link)
        return redirect(artifact)
    messages.success(request, f"Quantization queued as job #{job.pk}.")
    return redirect(job)


@require_role(VIEWER)
@require_GET
def calibration_list(request):
    return _calibration_page(request)


def _calibration_page(request, *, values=None, errors=None):
    return render(
        request,
        "quantize/calibration_list.html",
        {
            "datasets": selectors.dataset_list(user=request.user),
            "guidance": services.GUIDANCE,
            "purposes": ["calibration", "evaluation"],
            "values": values or {},
            "errors": errors or {},
        },
        status=400 if errors else 200,
    )


@require_role(VIEWER)
@require_GET
def calibration_detail(request, dataset_id: int):
    ds = selectors.dataset_get(dataset_id, user=request.user)
    return render(
        request,
        "quantize/calibration_detail.html",
        {"ds": ds, "preview": ds.preview(n=10, chars=600), "guidance": services.GUIDANCE},
    )


@require_role(OPERATOR)
@require_POST
def calibration_delete(request, dataset_id: int):
    ds = selectors.dataset_get(dataset_id, user=request.user, role=OPERATOR)
    try:
        services.dataset_delete(dataset=ds, user=request.user, request=request)
    except Conflict as exc:
        messages.error(request, exc.message)
        return redirect(ds)
    messages.success(request, f"Dataset {ds.name} deleted.")
    return redirect("calibration_list")


@require_role(OPERATOR)
@require_POST
def calibration_upload(request):
    upload = request.FILES.get("file")
    try:
        if upload is not None:
            services.dataset_upload_check(upload.size)  # before the file is read into memory
        content = upload.read().decode("utf-8", errors="replace") if upload else request.POST.get("content", "")
        ds = services.dataset_create(
            name=request.POST.get("name", ""),
            content=content,
            user=request.user,
            filename=upload.name if upload else "",
            request=request,
            purpose=request.POST.get("purpose") or "calibration",
            description=request.POST.get("description", ""),
            source=request.POST.get("source", ""),
        )
    except ValidationError as exc:  # the page again, each message beside its field (the file's under "file")
        errors = errors_by_field(exc)
        if "content" in errors:
            errors.setdefault("file", []).extend(errors.pop("content"))
        return _calibration_page(request, values=request.POST, errors=errors)
    messages.success(request, f"Dataset {ds.name} added with {ds.sample_count} samples.")
    return redirect(ds)
