from django.contrib import messages
from django.core.exceptions import ValidationError
from django.shortcuts import redirect, render
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from console.exceptions import Conflict, ServiceUnavailable
from console.roles import ADMIN, OPERATOR, VIEWER, require_role
from console.teams import default_team_for, team_options
from console.validation import NumberError, field_errors, parse_float
from models_registry import hooks, selectors, services
from models_registry.capacity_view import artifact_capacity, reference_devices
from models_registry.forms import ConvertForm
from models_registry.quantize.selectors import modelslim_scheme_support


def _errors(exc: ValidationError) -> dict:
    """Field -> messages for the templates; errors not tied to a field go under "general"."""
    return {("general" if field == "__all__" else field): msgs for field, msgs in field_errors(exc).items()}


@require_role(VIEWER)
@require_GET
def model_list(request):
    return render(request, "models_registry/model_list.html", {"models": selectors.model_list(user=request.user)})


@require_role(OPERATOR)
@require_http_methods(["GET", "POST"])
def model_register(request):
    values = {"name": "", "path": "", "description": "", "team": str(default_team_for(request.user) or "")}
    errors = {}
    if request.method == "POST":
        values = {k: request.POST.get(k, "") for k in values}
        try:
            team = values["team"].strip()
            if team and not team.isdigit():
                raise ValidationError({"team": "Choose one of your teams."})
            model = services.model_register(
                user=request.user,
                request=request,
                team_id=int(team) if team else None,
                **{k: v for k, v in values.items() if k != "team"},
            )
        except ValidationError as exc:
            errors = _errors(exc)
        else:
            messages.success(request, f"Registered {model.name}.")
            return redirect(model)
    from django.conf import settings

    return render(
        request,
        "models_registry/model_register.html",
        {
            "values": values,
            "errors": errors,
            "roots": settings.MODEL_ROOTS,
            "team_options": team_options(request.user),  # offered where there is a choice
            "path_help": "A Hugging Face directory (config.json, safetensors or bin weights, tokenizer) or a .gguf "
            f"file, inside: {', '.join(map(str, settings.MODEL_ROOTS))}.",
        },
        status=400 if errors else 200,
    )


@require_role(VIEWER)
@require_GET
def model_detail(request, model_id: int):
    model = selectors.model_get(model_id, user=request.user, role=VIEWER)
    return render(
        request, "models_registry/model_detail.html", {"model": model, "artifacts": selectors.artifacts_of(model)}
    )


@require_role(ADMIN)
@require_POST
def model_delete(request, model_id: int):
    model = selectors.model_get(model_id, user=request.user, role=ADMIN)
    if request.POST.get("confirm") != model.name:
        messages.error(request, f"Type the model's name ({model.name}) to confirm the delete.")
        return redirect(model)
    try:
        services.model_delete(model=model, user=request.user, request=request)
    except Conflict as exc:
        messages.error(request, exc.message)
        return redirect(model)
    messages.success(request, f"Deleted {request.POST['confirm']}.")
    return redirect("model_list")


def _jobs_context(artifact) -> dict:
    jobs = list(selectors.artifact_jobs(artifact)[:20])
    return {"artifact": artifact, "jobs": jobs, "jobs_active": any(j.is_active for j in jobs)}


#: The convert form's targets, as people read them (services.convert_targets says which an artifact has).
CONVERT_TARGET_TEXT = {
    "hf": "Hugging Face safetensors (dequantised)",
    "fp16": "float16 (Ascend, 310P)",
    "bf16": "bfloat16",
    "om": "OM offline model (ONNX + ATC)",
}


def _quantize_choices(schemes: dict) -> dict[str, list[tuple[str, str]]]:
    """The quantize form's selects (models_registry.options.QuantizeOptions checks the values)."""
    w8a16 = "" if schemes["w8a16"].supported else " — compressed-tensors only here"
    return {
        "target": [
            ("compressed-tensors", "compressed-tensors (vLLM on GPU/CPU)"),
            ("ascend-modelslim", "Ascend ModelSlim (vllm-ascend)"),
        ],
        "scheme": [
            ("w8a8_dynamic", "W8A8 dynamic (per-token activations)"),
            ("w8a8_static", "W8A8 static (per-tensor activations, calibrated)"),
            ("w8a16", f"W8A16 (weights only){w8a16}"),
        ],
        "method": [
            ("kl", "KL divergence"),
            ("minmax", "min-max"),
            ("histogram", "histogram"),
            ("auto", "library automatic"),
        ],
        "anti_outlier": [
            ("", "off"),
            ("m1", "m1 SmoothQuant"),
            ("m2", "m2 outlier suppression"),
            ("m3", "m3 weight-aware (AWQ-like)"),
            ("m4", "m4 iterative smoothing"),
            ("m5", "m5 SmoothQuant (fast)"),
            ("m6", "m6 flex smoothing"),
        ],
    }


def _artifact_context(request, artifact, *, convert_values=None, convert_errors=None):
    convert_targets, convert_refusal = services.convert_targets(artifact=artifact)
    return {
        **_jobs_context(artifact),
        "precision_modes": services.ATC_PRECISION_MODES,
        "convert_dtypes": ["bfloat16", "float16"],
        "model": artifact.model,
        "children": artifact.children.alive(),
        # the live devices' rows come from serving's fragment (endpoints.fragments.artifact_capacity_live)
        "capacity": artifact_capacity(
            artifact, memory_utilization=_float(request.GET.get("util")), devices=reference_devices()
        ),
        "convert_values": convert_values
        or {
            "to": "hf" if artifact.format == "gguf" else "fp16",
            "dtype": "bfloat16",
            "batch_size": 1,
            "seq_len": 128,
            "soc_version": "",
            "precision_mode": "force_fp16",
        },
        "convert_errors": convert_errors or {},
        "convert_targets": convert_targets,
        "convert_options": [(t, text) for t, text in CONVERT_TARGET_TEXT.items() if t in convert_targets],
        "convert_refusal": convert_refusal,
        # serving answers through a hook (the registry does not import it): no Launch button it would refuse
        "launch_refusal": hooks.launch_refusal(artifact),
        "modelslim_schemes": (schemes := modelslim_scheme_support()),
        "quantize_choices": _quantize_choices(schemes),
    }


def _float(raw):
    """The page's optional ?util=: a number, else the default (a bad value is not worth an error page)."""
    try:
        return parse_float(raw, "util", low=0.0, high=1.0) if raw else None
    except NumberError:
        return None


@require_role(VIEWER)
@require_GET
def artifact_detail(request, artifact_id: int):
    artifact = selectors.artifact_get(artifact_id, user=request.user, role=VIEWER)
    return render(request, "models_registry/artifact_detail.html", _artifact_context(request, artifact))


@require_role(OPERATOR)
@require_POST
def artifact_convert(request, artifact_id: int):
    artifact = selectors.artifact_get(artifact_id, user=request.user, role=OPERATOR)
    form = ConvertForm(request.POST, artifact=artifact)
    try:
        job = services.artifact_convert(artifact=artifact, user=request.user, options=form.options(), request=request)
    except ValidationError as exc:
        context = _artifact_context(request, artifact, convert_values=form.values, convert_errors=_errors(exc))
        return render(request, "models_registry/artifact_detail.html", context, status=400)
    except (Conflict, ServiceUnavailable) as exc:
        messages.error(request, str(exc))
        if isinstance(exc, Conflict) and exc.link:
            return redirect(exc.link)
        return redirect(artifact)
    messages.success(request, f"Conversion queued as job #{job.pk}.")
    return redirect(job)


@require_role(ADMIN)
@require_POST
def artifact_delete(request, artifact_id: int):
    artifact = selectors.artifact_get(artifact_id, user=request.user, role=ADMIN)
    if request.POST.get("confirm") != "delete":
        messages.error(request, "Type 'delete' to confirm.")
        return redirect(artifact)
    try:
        services.artifact_delete(artifact=artifact, user=request.user, request=request)
    except Conflict as exc:
        messages.error(request, exc.message)
        return redirect(artifact)
    messages.success(request, f"Artifact #{artifact.pk} deleted.")
    return redirect(artifact.model)


@require_role(VIEWER)
@require_GET
def artifact_jobs(request, artifact_id: int):
    """The artifact page's job table, polled while a job on it is active."""
    artifact = selectors.artifact_get(artifact_id, user=request.user, role=VIEWER)
    return render(request, "models_registry/_artifact_jobs.html", _jobs_context(artifact))
