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
from console.teams import team_role, visible
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
from workers.models import Node

DEDUPE = "tune:endpoint:{}"
DEDUPE_ARTIFACT = "tune:artifact:{}:node:{}"
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
    """`endpoint` may be unsaved (an artifact's tuning: the launch it would be); the fields a tuning's workload
    may set never read its replicas."""
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


def _variants(artifact: Artifact) -> set[int]:
    """The ready checkpoints of the artifact's model (bf16, W8A8, ...): the variants a space may try."""
    return set(
        Artifact.objects.alive()
        .filter(model_id=artifact.model_id, status=Artifact.Status.READY)
        .values_list("pk", flat=True)
    )


def _device_count(node: Node) -> int | None:
    """How many devices a trial replica's TP x DP may use on the node; None for a CPU node (one rank)."""
    if node.platform == "cpu":
        return None
    return node.devices.count()


def _resolve_artifact_on_node(artifact, node, user) -> tuple[Artifact, Node]:
    """The artifact (one the user's teams see) and the node named for a tuning without an endpoint."""
    if isinstance(artifact, bool) or not isinstance(artifact, int | str) or not str(artifact).strip().isdigit():
        raise ValidationError({"artifact": "Give the artifact's id (or an endpoint instead)."})
    found = visible(Artifact.objects.alive(), user).select_related("model").filter(pk=int(artifact)).first()
    if found is None:
        raise ValidationError({"artifact": f"No artifact #{artifact} in this console."})
    if found.status != Artifact.Status.READY:
        raise ValidationError({"artifact": f"{found} is {found.status}, not ready."})
    if isinstance(node, bool) or node in (None, ""):
        raise ValidationError({"node": "Name the node whose agent runs the trial replicas (its name or id)."})
    lookup = {"pk": int(node)} if str(node).strip().isdigit() else {"name": str(node).strip()}
    where = Node.objects.filter(**lookup).first()
    if where is None:
        raise ValidationError({"node": f"No node {node!r} in this console."})
    return found, where


def artifact_base_spec(*, artifact: Artifact, node: Node, user) -> tuple[EndpointSpec, Endpoint]:
    """The launch an endpoint of `artifact` on `node` would be, through endpoint_create's every check (in a
    transaction rolled back, as the launch preview does): the spec the trials start from, its defaults filled in,
    and the unsaved endpoint it would make (the workload's rules read its max_model_len). A refusal names its
    field (the artifact's format on the node's platform, the node's room)."""
    spec = EndpointSpec(name=f"tune-check-a{artifact.pk}", artifact=artifact.pk, node=node.name, replicas=1)
    checked = None
    try:
        with transaction.atomic():
            checked = endpoint_create(spec=spec, user=user)
            base = spec_of(checked)
            raise _RolledBack
    except _RolledBack:
        pass
    assert checked is not None
    return base, checked


def tuning_create(
    *,
    endpoint: int | str | None = None,
    artifact: int | str | None = None,
    node: int | str | None = None,
    workload,
    slo,
    space,
    trials=None,
    search_kind: str = "tpe",
    seed=None,
    user,
    request=None,
) -> Tuning:
    """Validate a tuning of an endpoint, or of an artifact on a node (no endpoint: its trials start from the launch
    the artifact would have there), and queue its job on that node (the benchmark client reads the tokenizer
    there). Nothing is stored when a field is refused. Only an endpoint (or artifact) of a team where `user` is an
    Operator: another team's is refused as if it did not exist."""
    base_spec: dict = {}
    if artifact is not None or node is not None:
        if endpoint not in (None, ""):
            raise ValidationError({"endpoint": "Give an endpoint, or an artifact and a node, not both."})
        chosen, where = _resolve_artifact_on_node(artifact, node, user)
        if user is not None and not at_least(team_role(user, chosen.team_id), OPERATOR):
            raise ValidationError({"artifact": f"No artifact #{artifact} in this console."})
        spec, target = artifact_base_spec(artifact=chosen, node=where, user=user)
        base_spec = spec.model_dump(mode="json")
    else:
        target = resolve_endpoint(endpoint)
        if user is not None and not at_least(team_role(user, target.team_id), OPERATOR):
            raise ValidationError({"endpoint": "Choose an endpoint of this console (its id or name)."})
        chosen, where = target.artifact, target.node
    cleaned_workload = _checked_workload(workload if workload is not None else {}, target)
    parsed_slo = search.parse_slo(slo)
    parsed_space = search.parse_space(
        space,
        device_count=_device_count(where),
        artifacts=_variants(chosen),
        speculative_config=(target.engine_configs or {}).get("speculative"),
    )
    wanted = int_in_range(trials, "trials", low=1, high=50, default=6)
    if search_kind not in search.SEARCHES:
        raise ValidationError({"search": f"Choose {' or '.join(search.SEARCHES)}."})
    seed = int_in_range(seed, "seed", low=0, high=2**31 - 1, default=0)
    # Every trial: a replica's start, the workload, the teardown; plus the baseline and the two repeats.
    per_trial = settings.ENDPOINT_START_TIMEOUT_SECONDS + cleaned_workload["timeout_s"] + 300
    with transaction.atomic():
        if not base_spec:
            Endpoint.objects.select_for_update().filter(pk=target.pk).first()
        tuning = Tuning.objects.create(
            endpoint=None if base_spec else target,
            endpoint_name="" if base_spec else target.name,
            artifact=chosen if base_spec else None,
            node=where if base_spec else None,
            base_spec=base_spec,
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
                **({"artifact": chosen.pk, "node": where.name} if base_spec else {"endpoint": target.name}),
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
    if tuning.for_artifact:  # one tuning of an artifact on a node at a time
        assert tuning.node is not None  # both callers checked it
        dedupe, node = DEDUPE_ARTIFACT.format(tuning.artifact_id, tuning.node_id), tuning.node
    else:
        assert tuning.endpoint is not None  # both callers hold a tuning whose endpoint exists (just made, or checked)
        dedupe, node = DEDUPE.format(tuning.endpoint_id), tuning.endpoint.node
    return job_enqueue(
        kind="tune",
        params={"tuning": tuning.pk},
        user=user,
        dedupe_key=dedupe,
        request=request,
        retry_of=retry_of,
        queue=node_queue(node.name),
        timeout_s=timeout_s,
        team_id=tuning.team_id,
    )


def tuned_target_missing(tuning: Tuning) -> str:
    """Why the tuning cannot run (its endpoint, or its artifact or node, was deleted), else ''."""
    if tuning.for_artifact:
        if tuning.artifact is None or tuning.node is None or tuning.artifact.deleted_at is not None:
            return f"The artifact or node of tuning #{tuning.pk} ({tuning.subject}) was deleted: start a new one."
        return ""
    return "" if tuning.endpoint is not None else f"The endpoint of tuning #{tuning.pk} was deleted: start a new one."


def tuning_resubmit(*, job, user, request=None):
    """Retry of a tune job resumes its tuning: the new job replays the trials that finished and goes on."""
    tuning = (
        Tuning.objects.select_related("endpoint__node", "artifact", "node").filter(pk=job.params.get("tuning")).first()
    )
    if tuning is None or tuned_target_missing(tuning):
        raise ValidationError({"tuning": tuned_target_missing(tuning) if tuning else "The tuning was deleted."})
    with transaction.atomic():
        new = _enqueue(tuning, user=user, request=request, retry_of=job, timeout_s=job.timeout_s)
        Tuning.objects.filter(pk=tuning.pk).update(job=new, status=TuningStatus.QUEUED, error="", finished_at=None)
        audit_log(actor=user, action="tuning.resume", obj=tuning, request=request, changes={"job": new.pk})
    return new


def base_of(tuning: Tuning) -> Endpoint | EndpointSpec:
    """What a tuning's trials start from: its endpoint, or the launch spec of its artifact on its node."""
    if tuning.for_artifact:
        return EndpointSpec(**tuning.base_spec)
    assert tuning.endpoint is not None  # the job checked it (tuned_target_missing)
    return tuning.endpoint


def trial_spec(source: Endpoint | EndpointSpec, *, name: str, params: dict, space: search.Space) -> EndpointSpec:
    """The launch spec of a trial replica: the endpoint's own (or an artifact tuning's base spec), one replica,
    with the trial's settings; nothing of what belongs to the live endpoint only (autoscaling, scheduled
    restarts, the profiler, the gateway)."""
    base = spec_of(source) if isinstance(source, Endpoint) else source
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
    if tuning.for_artifact:
        raise Conflict(
            f"Tuning #{tuning.pk} tuned {tuning.subject}, not an endpoint: launch one with its best settings "
            "(GET /api/v1/tunings/{id}: best.spec)."
        )
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
