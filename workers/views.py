from django.conf import settings
from django.contrib import messages
from django.core.paginator import Paginator
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_GET, require_POST

from console.exceptions import Conflict, ServiceUnavailable
from console.roles import OPERATOR, VIEWER, require_role
from workers.jobs import selectors as job_selectors
from workers.jobs import services as job_services
from workers.jobs.models import Job
from workers.models import Node


@require_role(VIEWER)
@require_GET
def job_list(request):
    filters = {k: request.GET.get(k, "").strip() for k in ("status", "kind", "model", "user")}
    model_id = int(filters["model"]) if filters["model"].isdigit() else None
    jobs = job_selectors.job_list(status=filters["status"], kind=filters["kind"], targets={"model": model_id},
                                  username=filters["user"])
    page = Paginator(jobs, 50).get_page(request.GET.get("page"))
    return render(request, "workers/job_list.html", {
        "page": page, "filters": filters, "statuses": Job.Status.values,
        "kinds": Job.objects.values_list("kind", flat=True).distinct().order_by("kind"),
        "models": job_selectors.target_choices("model"),
    })


@require_role(VIEWER)
@require_GET
def job_detail(request, job_id: int):
    job = get_object_or_404(Job.objects.select_related("created_by", "target_type"), pk=job_id)
    return render(request, "workers/job_detail.html", {"job": job, "result_object": job_selectors.result_object(job)})


@require_role(VIEWER)
@require_GET
def job_status(request, job_id: int):
    """The live part of the job page, polled by htmx; polling stops when the job ends."""
    job = get_object_or_404(Job, pk=job_id)
    return render(request, "workers/_job_status.html", {"job": job, "result_object": job_selectors.result_object(job)})


@require_role(OPERATOR)
@require_POST
def job_cancel(request, job_id: int):
    job = get_object_or_404(Job, pk=job_id)
    try:
        job_services.job_cancel(job=job, user=request.user, request=request)
        messages.success(request, f"Job #{job.pk} cancelled.")
    except (Conflict, ServiceUnavailable) as exc:
        messages.error(request, str(exc))
    return redirect(job)


@require_role(OPERATOR)
@require_POST
def job_retry(request, job_id: int):
    job = get_object_or_404(Job, pk=job_id)
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


@require_role(VIEWER)
@require_GET
def node_detail(request, node_id: int):
    node = get_object_or_404(Node, pk=node_id)
    return render(request, "endpoints/node_detail.html", {
        "node": node, "devices": node.devices.all(),
        "doctor_interval_minutes": int(settings.DOCTOR_INTERVAL_SECONDS // 60),
    })
