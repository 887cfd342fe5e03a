from dataclasses import replace

from django.conf import settings
from django.contrib import messages
from django.core.exceptions import ValidationError
from django.http import Http404
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from console import teams
from console.exceptions import Conflict, ServiceUnavailable
from console.form_layout import bind_errors
from console.roles import ADMIN, OPERATOR, VIEWER, has_role, require_role
from console.validation import error_text, field_errors
from endpoints import launch_page, selectors, services
from endpoints.bench import services as bench_services
from endpoints.bench.forms import BenchmarkForm
from endpoints.commands import format_for_shell
from endpoints.forms import AdapterForm, EndpointLaunchForm
from endpoints.gateway import services as gateway_services
from endpoints.launch import recorded_log
from endpoints.lora import adapter_choices, endpoint_adapter_change
from endpoints.models import Endpoint
from endpoints.preview import endpoint_preview
from endpoints.profiling.forms import ProfileForm
from endpoints.profiling.services import profile_create
from endpoints.recipes import recipe_save
from endpoints.tuning.forms import TuningForm
from endpoints.tuning.services import tuning_create
from models_registry.views import _errors
from workers.agent.supervisor import tail_lines
from workers.models import Node


@require_role(VIEWER)
@require_GET
def endpoint_list(request):
    return render(request, "endpoints/endpoint_list.html", {"endpoints": selectors.endpoint_list(user=request.user)})


@require_role(OPERATOR)
@require_http_methods(["GET", "POST"])
def endpoint_launch(request):
    values = {**launch_page.DEFAULTS, "artifact": request.GET.get("artifact", "")}
    errors = {}
    if request.method == "POST":
        form = EndpointLaunchForm(request.POST)
        values = launch_page.posted_values(form, request.POST)  # shown again with the errors
        try:
            endpoint = gateway_services.endpoint_launch(
                spec=launch_page.parsed_spec(form), user=request.user, request=request
            )
        except ValidationError as exc:
            errors = launch_page.launch_errors(exc)
        else:
            messages.success(request, f"Launching {endpoint.name}.")
            return redirect(endpoint)
    return render(
        request,
        "endpoints/endpoint_launch.html",
        launch_page.page_context(values=values, errors=errors, user=request.user),
        status=400 if errors else 200,
    )


@require_role(OPERATOR)
@require_POST
def endpoint_launch_preview(request):
    """The launch page's "Show command": the commands the form's launch would run, per node, with their checks.
    Nothing is stored (endpoints.preview), so nothing is audited. A refusal is shown in the fragment, naming the
    fields (200, so that htmx swaps it in)."""
    form = EndpointLaunchForm(request.POST)
    context = {}
    try:
        context["preview"] = endpoint_preview(spec=launch_page.parsed_spec(form), user=request.user)
    except ValidationError as exc:
        context["errors"] = launch_page.labelled_errors(launch_page.launch_errors(exc))
    return render(request, "endpoints/_launch_preview.html", context)


def _detail_context(endpoint, user):
    """The endpoint page's live part. The replica log's lines (the tail, and the last lines before a failure)
    go to Operators only: an Operator may have turned on request logging (VLLM_LOGGING_LEVEL=DEBUG,
    --enable-log-requests), which writes prompts; a Viewer is told that a log exists, and nothing is read."""
    replicas = list(selectors.replicas_of(endpoint))
    log_replica = next((r for r in replicas if r.log_path), None)
    show_logs = has_role(user, OPERATOR)

    return {
        "endpoint": endpoint,
        "replicas": replicas,
        "events": endpoint.events.all()[:40],
        "show_logs": show_logs,
        "log_replica": log_replica,
        "log_tail": tail_lines(recorded_log(log_replica.log_path), 30) if log_replica and show_logs else "",
        "commands": [(r, format_for_shell(r.argv, r.env)) for r in replicas if r.argv]
        + [(m, format_for_shell(m.argv, m.env)) for r in replicas for m in r.members.all() if m.argv],
        "failed_logs": [r for r in replicas if r.state == Endpoint.State.FAILED and r.last_log],
    }


def _detail_page(request, endpoint, *, status=200, **extra):
    choices = adapter_choices(endpoint)
    return render(
        request,
        "endpoints/endpoint_detail.html",
        {
            **_detail_context(endpoint, request.user),
            "gateway_url": settings.GATEWAY_URL,
            # Candidates to stage beside this one: other endpoints serving the same model name.
            "staged_options": [
                (other.pk, f"{other.name} ({other.state})")
                for other in selectors.endpoint_list(user=request.user)
                .exclude(pk=endpoint.pk)
                .filter(served_model_name=endpoint.served_model_name)
            ]
            or [("", "no other endpoint")],
            "routing_choices": Endpoint.Routing.choices,
            "advisory_events": endpoint.events.filter(kind__startswith="advisory-")[:10],
            "recipe_values": {"name": "", "title": ""},
            "recipe_errors": {},
            "adapters": list(endpoint.adapters.all()),
            "adapter_choices": choices,
            "adapter_form": AdapterForm(adapters=choices, initial={"action": "load"}),
            "bench_form": BenchmarkForm(endpoint=endpoint),
            "profile_form": ProfileForm(endpoint=endpoint),
            "tuning_form": TuningForm(),
            **extra,
        },
        status=status,
    )


@require_role(VIEWER)
@require_GET
def endpoint_detail(request, endpoint_id: int):
    endpoint = selectors.endpoint_get(endpoint_id, user=request.user, role=VIEWER)
    return _detail_page(request, endpoint)


@require_role(OPERATOR)
@require_POST
def endpoint_recipe_save(request, endpoint_id: int):
    """The endpoint page's "Save as recipe": its settings as the operator's recipe (a new version of a name saved
    before), audited by recipe_save. Refused: the page again, the errors under their fields."""
    endpoint = selectors.endpoint_get(endpoint_id, user=request.user, role=OPERATOR)
    values = {"name": request.POST.get("name", "").strip(), "title": request.POST.get("title", "").strip()}
    try:
        recipe = recipe_save(
            endpoint=endpoint, name=values["name"], title=values["title"], user=request.user, request=request
        )
    except ValidationError as exc:
        messages.error(request, "The recipe was not saved: see Save as recipe below.")
        return _detail_page(request, endpoint, status=400, recipe_values=values, recipe_errors=_errors(exc))
    messages.success(
        request, f"Saved recipe {recipe.ref} from {endpoint.name}: the launch page's recipe picker offers it."
    )
    return redirect(endpoint)


@require_role(OPERATOR)
@require_POST
def endpoint_bench_new(request):
    """The endpoint page's "Benchmark this endpoint": one run, or a sweep over concurrencies. Refused: the page
    again (400), the form open with each error beside its field; busy or unreachable: the page's message."""
    ref = request.POST.get("endpoint", "").strip()
    endpoint = selectors.endpoint_list(user=request.user).filter(pk=ref).first() if ref.isdigit() else None
    if endpoint is None:
        raise Http404("No such endpoint.")
    form = BenchmarkForm(request.POST, request.FILES, endpoint=endpoint)
    upload = request.FILES.get("prompt_file") if request.POST.get("dataset") == "file" else None
    sweep = request.POST.get("mode") == "sweep"
    try:
        if request.POST.get("dataset") == "file" and upload is None:
            raise ValidationError({"prompt_file": "Choose a prompt file (JSONL), or use random prompts."})
        # An unticked box is not posted: EOS is ignored unless the form says otherwise.
        workload = form.workload(ignore_eos=request.POST.get("ignore_eos", "on") == "on")
        if sweep:
            created = bench_services.sweep_create(
                endpoint=ref, workload=workload, prompt_file=upload, user=request.user, request=request
            )
        else:
            created = bench_services.benchmark_create(
                endpoint=ref,
                workload=replace(workload, concurrencies=None),
                prompt_file=upload,
                user=request.user,
                request=request,
            )
    except ValidationError as exc:
        if not form.errors:  # the form's own errors are on it already
            bind_errors(form, exc)
        messages.error(request, "Benchmark not started: see Benchmark this endpoint below.")
        return _detail_page(request, endpoint, status=400, bench_form=form)
    except (Conflict, ServiceUnavailable) as exc:
        messages.error(request, str(exc))
        return redirect(endpoint)
    messages.success(request, f"Queued {'sweep' if sweep else 'benchmark'} #{created.pk} on {created.endpoint_name}.")
    return redirect(created)


@require_role(OPERATOR)
@require_POST
def endpoint_profile_new(request, endpoint_id: int):
    """The endpoint page's "Profile this endpoint". Refused: the page again (400), the form open with each error
    beside its field; busy (a profile running) or unreachable: the page's message."""
    endpoint = selectors.endpoint_get(endpoint_id, user=request.user, role=OPERATOR)
    form = ProfileForm(request.POST, endpoint=endpoint)
    if form.is_valid():
        try:
            profile = profile_create(
                endpoint=endpoint,
                replica=form.cleaned_data["replica"],
                duration_s=form.cleaned_data["duration_s"],
                load=form.load_settings(),
                label=form.cleaned_data["label"],
                user=request.user,
                request=request,
            )
        except ValidationError as exc:
            bind_errors(form, exc)
        except (Conflict, ServiceUnavailable) as exc:
            messages.error(request, str(exc))
            return redirect(endpoint)
        else:
            what = f"{endpoint.name}#{profile.replica_index} for {profile.duration_s} s"
            messages.success(request, f"Profiling {what} (profile #{profile.pk}).")
            return redirect(profile)
    messages.error(request, "Profile not started: see Profile this endpoint below.")
    return _detail_page(request, endpoint, status=400, profile_form=form)


@require_role(OPERATOR)
@require_POST
def endpoint_tuning_new(request, endpoint_id: int):
    """The endpoint page's "Tune this endpoint". Refused: the page again (400), the form open with each error
    beside its field (the service's workload.*, slo.* and space.* keys on the form's fields); busy or unreachable:
    the page's message."""
    endpoint = selectors.endpoint_get(endpoint_id, user=request.user, role=OPERATOR)
    form = TuningForm(request.POST)
    if form.is_valid():
        try:
            tuning = tuning_create(endpoint=endpoint.pk, **form.arguments(), user=request.user, request=request)
        except ValidationError as exc:
            _bind_tuning_errors(form, exc)
        except (Conflict, ServiceUnavailable) as exc:
            messages.error(request, str(exc))
            return redirect(endpoint)
        else:
            messages.success(
                request, f"Tuning {endpoint.name} (tuning #{tuning.pk}): trial replicas start one at a time."
            )
            return redirect(tuning)
    messages.error(request, "Tuning not started: see Tune this endpoint below.")
    return _detail_page(request, endpoint, status=400, tuning_form=form)


def _bind_tuning_errors(form: TuningForm, exc: ValidationError) -> None:
    """The service names a workload or SLO field under its object (workload.input_len, slo.ttft_p99_ms) and a knob
    under the space (space.max_num_seqs): renamed to the form's field (the knob named in the message), then bound
    as any refusal is."""
    by_field: dict[str, list[str]] = {}
    for key, errors in field_errors(exc).items():
        head, _, rest = key.partition(".")
        if head in ("workload", "slo") and rest in form.fields:
            key = rest
        elif head == "space" and rest:
            key, errors = "space", [f"{rest}: {e}" for e in errors]
        by_field.setdefault(key, []).extend(errors)
    bind_errors(form, ValidationError(by_field))


@require_role(VIEWER)
@require_GET
def endpoint_live(request, endpoint_id: int):
    """The live part of the endpoint page (state, replicas, events, log), polled by htmx."""
    endpoint = selectors.endpoint_get(endpoint_id, user=request.user, role=VIEWER)
    return render(request, "endpoints/_endpoint_live.html", _detail_context(endpoint, request.user))


def _action(request, endpoint_id, service, done):
    endpoint = selectors.endpoint_get(endpoint_id, user=request.user, role=OPERATOR)
    try:
        service(endpoint=endpoint, user=request.user, request=request)
        messages.success(request, f"{endpoint.name}: {done}.")
    except Conflict as exc:
        messages.error(request, exc.message)
    return redirect(endpoint)


@require_role(OPERATOR)
@require_POST
def endpoint_start(request, endpoint_id: int):
    return _action(request, endpoint_id, services.endpoint_start, "start requested")


@require_role(OPERATOR)
@require_POST
def endpoint_stop(request, endpoint_id: int):
    return _action(request, endpoint_id, services.endpoint_stop, "stop requested")


@require_role(OPERATOR)
@require_POST
def endpoint_restart(request, endpoint_id: int):
    return _action(request, endpoint_id, services.endpoint_restart, "restart requested")


@require_role(OPERATOR)
@require_POST
def endpoint_profiling(request, endpoint_id: int):
    """The endpoint page's Enable / Disable profiling button (its form posts enabled=1 or 0)."""
    endpoint = selectors.endpoint_get(endpoint_id, user=request.user, role=OPERATOR)
    raw = request.POST.get("enabled", "")
    if raw not in ("0", "1"):  # never read as "disable": that restarts every replica
        messages.error(request, f"enabled must be 1 or 0, not {raw[:40]!r}: profiling is unchanged.")
        return redirect(endpoint)
    enabled = raw == "1"
    try:
        services.endpoint_set_profiling(endpoint=endpoint, enabled=enabled, user=request.user, request=request)
    except ValidationError as exc:
        messages.error(request, " ".join(exc.messages))
    else:
        messages.success(
            request,
            f"{endpoint.name}: profiling {'enabled' if enabled else 'disabled'}"
            + (
                "; replicas restart one at a time."
                if endpoint.desired_state == Endpoint.Desired.RUNNING
                else "; it applies at the next start."
            ),
        )
    return redirect(endpoint)


@require_role(OPERATOR)
@require_POST
def endpoint_routing(request, endpoint_id: int):
    """The endpoint page's gateway routing policy (least outstanding or prefix-aware)."""
    endpoint = selectors.endpoint_get(endpoint_id, user=request.user, role=OPERATOR)
    try:
        endpoint = services.endpoint_update(
            endpoint=endpoint, routing=request.POST.get("routing", ""), user=request.user, request=request
        )
    except ValidationError as exc:
        messages.error(request, error_text(exc))
    else:
        messages.success(
            request, f"{endpoint.name}: the gateway routes by {endpoint.get_routing_display()} within seconds."
        )
    return redirect(endpoint)


@require_role(OPERATOR)
@require_POST
def endpoint_advisory(request, endpoint_id: int):
    """The endpoint page's advisory-mode button (its form posts advisory=1 or 0)."""
    endpoint = get_object_or_404(Endpoint, pk=endpoint_id)
    raw = request.POST.get("advisory", "")
    if raw not in ("0", "1"):
        messages.error(request, f"advisory: 1 or 0, not {raw[:40]!r}. Nothing changed.")
        return redirect(endpoint)
    endpoint = services.endpoint_update(endpoint=endpoint, advisory=raw == "1", user=request.user, request=request)
    messages.success(
        request,
        f"{endpoint.name}: advisory mode "
        + (
            "on: the controllers record what they would do and change nothing."
            if endpoint.advisory
            else "off: the controllers act."
        ),
    )
    return redirect(endpoint)


@require_role(OPERATOR)
@require_POST
def endpoint_adapter(request, endpoint_id: int):
    """The endpoint page's LoRA section: load an adapter into the ready replicas, or unload one."""
    endpoint = selectors.endpoint_get(endpoint_id, user=request.user, role=OPERATOR)
    form = AdapterForm(request.POST)
    try:
        if not form.is_valid():
            raise ValidationError(form.errors.as_data())
        action = form.cleaned_data["action"]
        result = endpoint_adapter_change(
            endpoint=endpoint,
            adapter_id=form.cleaned_data["adapter"],
            action=action,
            user=request.user,
            request=request,
        )
    except ValidationError as exc:
        messages.error(request, error_text(exc))
    except Conflict as exc:
        messages.error(request, exc.message)
    else:
        where = ", ".join(str(r["replica"]) for r in result["replicas"]) or "no replica ready; at the next start"
        messages.success(request, f"{endpoint.name}: adapter {result['name']} {action}ed (replicas: {where}).")
    return redirect(endpoint)


@require_role(ADMIN)
@require_POST
def endpoint_delete(request, endpoint_id: int):
    endpoint = selectors.endpoint_get(endpoint_id, user=request.user, role=ADMIN)
    try:
        services.endpoint_delete(endpoint=endpoint, user=request.user, request=request)
    except Conflict as exc:
        messages.error(request, exc.message)
        return redirect(endpoint)
    messages.success(request, f"Deleted {endpoint.name}.")
    return redirect("endpoint_list")


@require_role(OPERATOR)
@require_POST
def endpoint_try(request, endpoint_id: int):
    endpoint = selectors.endpoint_get(endpoint_id, user=request.user, role=OPERATOR)
    context = {"endpoint": endpoint, "message": request.POST.get("message", "")}
    try:
        context["answer"] = services.endpoint_chat(
            endpoint=endpoint, message=context["message"], user=request.user, request=request
        )
    except ValidationError as exc:
        context["error"] = " ".join(exc.messages)
    except ServiceUnavailable as exc:
        context["error"] = str(exc)
    return render(request, "endpoints/_try_result.html", context)


@require_role(VIEWER)
@require_GET
def node_replicas(request, node_id: int):
    """The node page's list of the replicas it runs (loaded by htmx: serving facts come from here)."""
    node = get_object_or_404(Node, pk=node_id)
    team_ids = teams.visible_team_ids(request.user)  # None: the console Admin, who sees every team's
    replicas, members = list(selectors.replicas_on_node(node)), list(selectors.members_on_node(node))
    if team_ids is not None:
        # Another team's replica keeps its devices and state on show (they are taken) but not its name, port or
        # messages: the node is shared, the endpoint is not (issue 37).
        for row in replicas:
            row.other_team = row.endpoint.team_id not in team_ids
        for row in members:
            row.other_team = row.replica.endpoint.team_id not in team_ids
    return render(request, "endpoints/_node_replicas.html", {"node": node, "replicas": replicas, "members": members})
