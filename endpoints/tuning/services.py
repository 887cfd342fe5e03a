"""Writes for tunings: validate and queue one (a `tune` job on the endpoint's node), Retry (which resumes it), and
apply the best settings to the endpoint (its replicas then restart one at a time, as profiling's option does).
The job itself is endpoints.tuning.jobs; the search's logic, endpoints.tuning.search."""

from dataclasses import fields

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone

from console.audit import audit_log
from console.exceptions import Conflict
from console.roles import OPERATOR, at_least
from console.teams import team_role
from console.validation import int_in_range
from endpoints.bench.workload import VIA_REPLICA, WorkloadRequest, clean_workload, resolve_endpoint
from endpoints.endpoint_spec import EndpointSpec
from endpoints.models import Endpoint, EndpointEvent
from endpoints.recipes import spec_of
from endpoints.services import _nodes_of, endpoint_create, nudge_all
from endpoints.tuning import search
from endpoints.tuning.models import Tuning, TuningStatus
from models_registry.models import Artifact
from workers.jobs.queues import node_queue
from workers.jobs.services import job_enqueue

DEDUPE = "tune:endpoint:{}"
WORKLOAD_FIELDS = {f.name for f in fields(WorkloadRequest)} - {"replica", "via", "concurrencies"}
#: The endpoint's fields a tuning's settings may change (what endpoint_create derives from the spec's knobs).
APPLIED_FIELDS = (
    "max_num_seqs",
    "tensor_parallel_size",
    "data_parallel_size",
    "artifact_id",
    "quantization",
    "dtype",
    "extra_args",
    "engine_configs",
    "draft_artifact_id",
)


class _RolledBack(Exception):
    """Raised inside a check's transaction to undo the endpoint it made."""


def _checked_workload(raw, endpoint: Endpoint) -> dict:
    """The benchmark form's settings, with its rules, under the names `workload.<field>`."""
    if not isinstance(raw, dict):
        raise ValidationError(
            {"workload": "An object of benchmark settings, e.g. {\"num_prompts\": 16, \"max_concurrency\": 8}."}
        )
    if unknown := sorted(set(raw) - WORKLOAD_FIELDS):
        raise ValidationError({f"workload.{unknown[0]}": f"Unknown (known: {', '.join(sorted(WORKLOAD_FIELDS))})."})
    try:
        cleaned = clean_workload(WorkloadRequest(**raw, via=VIA_REPLICA), endpoint=endpoint)
    except ValidationError as exc:
        raise ValidationError({f"workload.{field}": messages for field, messages in exc.message_dict.items()}) from None
    except TypeError as exc:
        raise ValidationError({"workload": str(exc)}) from None
    return cleaned


def _variants(endpoint: Endpoint) -> set[int]:
    """The ready checkpoints of the endpoint's model (bf16, W8A8, ...): the variants a space may try."""
    return set(
        Artifact.objects.alive()
        .filter(model_id=endpoint.artifact.model_id, status=Artifact.Status.READY)
        .values_list("pk", flat=True)
    )


def _device_count(endpoint: Endpoint) -> int | None:
    """How many devices a trial replica's TP x DP may use on the node; None for a CPU node (one rank)."""
    if endpoint.node.platform == "cpu":
        return None
    return endpoint.node.devices.count()


def tuning_create(
    *,
    endpoint: int | str,
    workload,
    slo,
    space,
    trials=None,
    search_kind: str = "tpe",
    seed=None,
    user,
    request=None,
) -> Tuning:
    """Validate a tuning of an endpoint and queue its job on the endpoint's node (the benchmark client reads the
    tokenizer there). Nothing is stored when a field is refused. Only an endpoint of a team where `user` is an
    Operator: another team's is refused as if it did not exist."""
    target = resolve_endpoint(endpoint)
    if user is not None and not at_least(team_role(user, target.team_id), OPERATOR):
        raise ValidationError({"endpoint": "Choose an endpoint of this console (its id or name)."})
    cleaned_workload = _checked_workload(workload if workload is not None else {}, target)
    parsed_slo = search.parse_slo(slo)
    parsed_space = search.parse_space(
        space,
        device_count=_device_count(target),
        artifacts=_variants(target),
        speculative_config=(target.engine_configs or {}).get("speculative"),
    )
    wanted = int_in_range(trials, "trials", low=1, high=50, default=6)
    if search_kind not in search.SEARCHES:
        raise ValidationError({"search": f"Choose {' or '.join(search.SEARCHES)}."})
    seed = int_in_range(seed, "seed", low=0, high=2**31 - 1, default=0)
    # Every trial: a replica's start, the workload, the teardown; plus the baseline and the two repeats.
    per_trial = settings.ENDPOINT_START_TIMEOUT_SECONDS + cleaned_workload["timeout_s"] + 300
    with transaction.atomic():
        Endpoint.objects.select_for_update().filter(pk=target.pk).first()
        tuning = Tuning.objects.create(
            endpoint=target,
            endpoint_name=target.name,
            workload=cleaned_workload,
            slo=parsed_slo.as_json(),
            space=parsed_space.as_json(),
            search=search_kind,
            trials_wanted=wanted,
            seed=seed,
            created_by=user if user is not None and user.pk else None,
        )
        tuning.job = _enqueue(tuning, user=user, request=request, retry_of=None, timeout_s=(wanted + 3) * per_trial)
        tuning.save(update_fields=["job"])
        audit_log(
            actor=user,
            action="tuning.create",
            obj=tuning,
            request=request,
            changes={
                "endpoint": target.name,
                "job": tuning.job.pk,
                "slo": tuning.slo,
                "space": tuning.space,
                "trials": wanted,
                "search": search_kind,
                "seed": seed,
            },
        )
    return tuning


def _enqueue(tuning: Tuning, *, user, request, retry_of, timeout_s: int | None):
    endpoint = tuning.endpoint
    assert endpoint is not None  # both callers hold a tuning whose endpoint exists (just made, or checked)
    return job_enqueue(
        kind="tune",
        params={"tuning": tuning.pk},
        user=user,
        dedupe_key=DEDUPE.format(tuning.endpoint_id),
        request=request,
        retry_of=retry_of,
        queue=node_queue(endpoint.node.name),
        timeout_s=timeout_s,
        team_id=tuning.team_id,
    )


def tuning_resubmit(*, job, user, request=None):
    """Retry of a tune job resumes its tuning: the new job replays the trials that finished and goes on."""
    tuning = Tuning.objects.select_related("endpoint__node").filter(pk=job.params.get("tuning")).first()
    if tuning is None or tuning.endpoint is None:
        raise ValidationError({"tuning": "The tuning or its endpoint was deleted: start a new one."})
    with transaction.atomic():
        new = _enqueue(tuning, user=user, request=request, retry_of=job, timeout_s=job.timeout_s)
        Tuning.objects.filter(pk=tuning.pk).update(job=new, status=TuningStatus.QUEUED, error="", finished_at=None)
        audit_log(actor=user, action="tuning.resume", obj=tuning, request=request, changes={"job": new.pk})
    return new


def trial_spec(endpoint: Endpoint, *, name: str, params: dict, space: search.Space) -> EndpointSpec:
    """The launch spec of a trial replica: the endpoint's own, one replica, with the trial's settings; nothing
    of what belongs to the live endpoint only (autoscaling, scheduled restarts, the profiler, the gateway)."""
    base = spec_of(endpoint)
    changes = search.spec_changes(params, base_extra_args=dict(base.extra_args), space=space)
    data = base.model_dump()
    data.update(
        name=name,
        recipe="",
        replicas=1,
        autoscale=None,
        restart_every_hours=None,
        restart_daily_at=None,
        profiling=False,
        # A name of its own: a trial replica must not join the live endpoint's gateway pool (nor may it, since
        # endpoints.services refuses a second endpoint under one served model name).
        served_model_name=name,
        **changes,
    )
    if "speculative" in changes and changes["speculative"] is None:
        data["speculative"] = None
    return EndpointSpec(**data)


def _checked_settings(endpoint: Endpoint, params: dict, space: search.Space, user) -> dict:
    """The endpoint's fields with a trial's settings, through every check of a launch (endpoint_create in a
    transaction then rolled back, as the launch preview does): what apply writes."""
    spec = trial_spec(endpoint, name=f"tune-check-{endpoint.pk}", params=params, space=space)
    spec = spec.model_copy(update={"replicas": endpoint.replicas, "share_devices": True})
    out = {}
    try:
        with transaction.atomic():
            checked = endpoint_create(spec=spec, user=user)
            out = {f: getattr(checked, f) for f in APPLIED_FIELDS}
            raise _RolledBack
    except _RolledBack:
        pass
    return out


def tuning_apply(*, tuning: Tuning, user, request=None, number: int | None = None) -> Endpoint:
    """Apply the best configuration (or trial `number`'s) to the endpoint: its launch settings change and its
    running replicas restart one at a time, each when every other one is ready (ReplicaWorkload's
    maybe_scheduled_restart), so an endpoint of two or more keeps serving."""
    endpoint = tuning.endpoint
    if endpoint is None:
        raise Conflict(f"{tuning.endpoint_name} was deleted.")
    if tuning.is_active:
        raise Conflict(
            f"Tuning #{tuning.pk} is {tuning.state}: apply once it has ended.", link=tuning.get_absolute_url()
        )
    if number is None:
        if not tuning.best:
            raise Conflict(f"Tuning #{tuning.pk} found no configuration that meets its SLO: nothing to apply.")
        params, number = tuning.best["params"], tuning.best["number"]
    else:
        trial = tuning.trials.filter(number=number, state="complete").first()
        if trial is None:
            raise ValidationError({"trial": f"Tuning #{tuning.pk} has no measured trial {number}."})
        params = trial.params
    space = search.Space(choices={}, speculative_config=tuning.space.get("speculative_config"))
    new = _checked_settings(endpoint, params, space, user)
    with transaction.atomic():
        endpoint = Endpoint.objects.select_for_update().get(pk=endpoint.pk)
        diff = {f: [getattr(endpoint, f), v] for f, v in new.items() if getattr(endpoint, f) != v}
        running = endpoint.desired_state == Endpoint.Desired.RUNNING
        if diff:
            Endpoint.objects.filter(pk=endpoint.pk).update(
                **{f: v for f, (_, v) in diff.items()}, settings_changed_at=timezone.now()
            )
            then = "replicas restart one at a time" if running else "applies at the next start"
            EndpointEvent.objects.create(
                endpoint=endpoint,
                kind="tuning",
                message=f"tuning #{tuning.pk} trial {number} applied by {getattr(user, 'username', 'system')}: "
                + "; ".join(f"{f}: {was} → {now}" for f, (was, now) in diff.items())
                + f" ({then})",
            )
        Tuning.objects.filter(pk=tuning.pk).update(applied_at=timezone.now(), applied_params=params)
        audit_log(
            actor=user,
            action="tuning.apply",
            obj=tuning,
            request=request,
            changes={"endpoint": endpoint.name, "trial": number, "params": params, **diff},
        )
        if diff and running:
            nodes = _nodes_of(endpoint)
            transaction.on_commit(lambda: nudge_all(nodes))
    endpoint.refresh_from_db()
    return endpoint
