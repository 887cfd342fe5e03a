from django.conf import settings
from django.contrib import messages
from django.core.exceptions import ValidationError
from django.core.paginator import Paginator
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_GET, require_POST

from console.exceptions import Conflict, ServiceUnavailable
from console.form_layout import bind_errors
from console.roles import ADMIN, OPERATOR, VIEWER, require_role
from workers import engine_images
from workers import services as node_services
from workers.forms import JobFilterForm, NodeEngineRuntimeForm
from workers.jobs import selectors as job_selectors
from workers.jobs import services as job_services
from workers.jobs.models import Job
from workers.models import Node


@require_role(VIEWER)
@require_GET
def job_list(request):
    form = JobFilterForm(
        request.GET,
        statuses=Job.Status.values,
        kinds=Job.objects.values_list("kind", flat=True).distinct().order_by("kind"),
        models=job_selectors.target_choices("model"),
    )
    filters = form.values()
    jobs = job_selectors.job_list(
        user=request.user,
        status=filters["status"],
        kind=filters["kind"],
        targets={"model": form.model_id()},
        username=filters["user"],
    )
    page = Paginator(jobs, 50).get_page(request.GET.get("page"))
    return render(request, "workers/job_list.html", {"page": page, "form": form, "filters": filters})


@require_role(VIEWER)
@require_GET
def job_detail(request, job_id: int):
    job = job_selectors.job_get(job_id, user=request.user)
    return render(request, "workers/job_detail.html", {"job": job, "result_object": job_selectors.result_object(job)})


@require_role(VIEWER)
@require_GET
def job_status(request, job_id: int):
    """The live part of the job page, polled by htmx; polling stops when the job ends."""
    job = job_selectors.job_get(job_id, user=request.user)
    return render(request, "workers/_job_status.html", {"job": job, "result_object": job_selectors.result_object(job)})


@require_role(OPERATOR)
@require_POST
def job_cancel(request, job_id: int):
    job = job_selectors.job_get(job_id, user=request.user, role=OPERATOR)
    try:
        job_services.job_cancel(job=job, user=request.user, request=request)
        messages.success(request, f"Job #{job.pk} cancelled.")
    except (Conflict, ServiceUnavailable) as exc:
        messages.error(request, str(exc))
    return redirect(job)


@require_role(OPERATOR)
@require_POST
def job_retry(request, job_id: int):
    job = job_selectors.job_get(job_id, user=request.user, role=OPERATOR)
    try:
        new = job_services.job_retry(job=job, user=request.user, request=request)
    except (Conflict, ServiceUnavailable) as exc:
        messages.error(request, str(exc))
        return redirect(job)
    except Exception as exc:  # validation of the new job (e.g. source deleted meanwhile)
        from django.core.exceptions import ValidationError

        if not isinstance(exc, ValidationError):
            raise
        messages.error(request, " ".join(exc.messages))
        return redirect(job)
    messages.success(request, f"Retrying as job #{new.pk}.")
    return redirect(new)


@require_role(VIEWER)
@require_GET
def node_list(request):
    return render(request, "endpoints/node_list.html", {"nodes": Node.objects.prefetch_related("devices")})


def _node_page(request, node: Node, *, runtime_form: NodeEngineRuntimeForm | None = None, status: int = 200):
    return render(
        request,
        "endpoints/node_detail.html",
        {
            "node": node,
            "devices": node.devices.all(),
            "doctor_interval_minutes": int(settings.DOCTOR_INTERVAL_SECONDS // 60),
            "image": node.engine_image() if node.platform == Node.Platform.ASCEND else "",
            "runtime_form": runtime_form
            or _runtime_form(
                initial={"engine_runtime": node.engine_runtime, "engine_image_variant": node.engine_image_variant}
            ),
        },
        status=status,
    )


def _runtime_form(*args, **kwargs) -> NodeEngineRuntimeForm:
    return NodeEngineRuntimeForm(
        *args, runtimes=Node.Runtime.choices, image_variants=engine_images.variant_choices(), **kwargs
    )


@require_role(VIEWER)
@require_GET
def node_detail(request, node_id: int):
    return _node_page(request, get_object_or_404(Node, pk=node_id))


@require_role(ADMIN, whole_console=True)
@require_POST
def node_engine_runtime(request, node_id: int):
    """Admin: how this node's agent runs replicas (process, or vllm-ascend's image under Docker/Podman)."""
    node = get_object_or_404(Node, pk=node_id)
    form = _runtime_form(request.POST)
    try:
        if not form.is_valid():
            raise ValidationError(form.errors.as_data())
        node_services.node_set_engine_runtime(node=node, **form.cleaned_data, user=request.user, request=request)
    except ValidationError as exc:
        node.refresh_from_db()
        bind_errors(form, exc)
        return _node_page(request, node, runtime_form=form, status=400)
    messages.success(
        request, f"{node.name}: replicas run as {node.get_engine_runtime_display()} from their next start."
    )
    return redirect(node)
