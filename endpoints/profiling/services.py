"""Writes for profiles: validate and queue one (a `profile` job on the replica's node), delete one.
The job itself is endpoints.profiling.jobs; the trace's reading, endpoints.profiling.analysis."""

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import transaction

from console.audit import audit_log
from console.exceptions import Conflict
from console.validation import int_in_range
from endpoints.bench.client import pick_replica
from endpoints.bench.workload import WorkloadRequest, clean_workload, resolve_endpoint
from endpoints.commands import PROFILER_FLAG
from endpoints.models import Endpoint, Replica
from endpoints.profiling import storage
from endpoints.profiling.models import Profile
from endpoints.profiling.selectors import active_profile_of_replica
from workers.jobs.queues import node_queue
from workers.jobs.services import job_enqueue

DEDUPE = "profile:endpoint:{}:replica:{}"
LOAD_FIELDS = ("num_prompts", "input_len", "output_len", "max_concurrency", "request_rate")
# The load runs until the recording stops: enough prompts for a long window, ended early by the job.
DEFAULT_LOAD = {"num_prompts": 1000, "input_len": 128, "output_len": 64, "max_concurrency": 4}


def replica_records_profiles(replica: Replica) -> bool:
    """The replica's running command has vLLM's profiler configured (the endpoint's `profiling`
    option at its last start): only then does it serve /start_profile."""
    return PROFILER_FLAG in (replica.argv or [])


def _ready_replica(endpoint: Endpoint, index: int | None) -> Replica:
    if index is not None and not endpoint.replica_set.filter(index=index).exists():
        raise ValidationError({"replica": f"{endpoint.name} has no replica {index}."})
    replica = pick_replica(endpoint, index)
    if replica is None:
        which = f"Replica {index} of {endpoint.name}" if index is not None else endpoint.name
        raise ValidationError(
            {
                "endpoint": f"{which} is not serving (state: {endpoint.state}): only a ready "
                "replica can be profiled; start it and wait for ready first."
            }
        )
    return replica


def _clean_load(load, *, endpoint: Endpoint, replica: Replica) -> dict:
    """The console's own load for the window, with the benchmark form's rules; {} for none."""
    if load in (None, False, {}):
        return {}
    if load is True:
        load = {}
    if not isinstance(load, dict):
        raise ValidationError({"load": "Give the load as an object of benchmark settings, or leave it out."})
    unknown = sorted(set(load) - set(LOAD_FIELDS))
    if unknown:
        raise ValidationError({"load": f"Unknown load setting(s): {', '.join(unknown)}; use {', '.join(LOAD_FIELDS)}."})
    wanted = {**DEFAULT_LOAD, **{k: v for k, v in load.items() if v not in (None, "")}}
    if wanted.get("request_rate") not in (None, "") and "max_concurrency" not in load:
        wanted.pop("max_concurrency")
    try:
        cleaned = clean_workload(WorkloadRequest(replica=replica.index, **wanted), endpoint=endpoint)
    except ValidationError as exc:  # the benchmark form's messages, under the load's own field names
        raise ValidationError({f"load.{field}": messages for field, messages in exc.message_dict.items()}) from None
    return {k: cleaned[k] for k in ("dataset", *LOAD_FIELDS, "ignore_eos")}


def _check_disk() -> None:
    per, total = settings.PROFILE_MAX_BYTES, settings.PROFILE_TOTAL_MAX_BYTES
    used = storage.used_bytes()
    if used + per > total:
        raise Conflict(
            f"Profiles take {used / 2**20:.0f} MiB of the {total / 2**20:.0f} MiB allowed "
            f"(PROFILE_TOTAL_MAX_BYTES) and a new one may take up to {per / 2**20:.0f} MiB "
            "(PROFILE_MAX_BYTES): delete old profiles first."
        )


def profile_create(
    *,
    endpoint: int | str | Endpoint,
    user,
    replica: int | None = None,
    duration_s=None,
    load=None,
    label: str = "",
    request=None,
) -> Profile:
    """Validate a profile of one ready replica and queue its job on the replica's node."""
    if not isinstance(endpoint, Endpoint):
        endpoint = resolve_endpoint(endpoint)
    duration = int_in_range(
        duration_s, "duration_s", low=1, high=settings.PROFILE_MAX_SECONDS, default=settings.PROFILE_DEFAULT_SECONDS
    )
    index = int_in_range(replica, "replica", low=0, high=10_000)
    label = (label or "").strip()
    if len(label) > 200:
        raise ValidationError({"label": "Keep the label under 200 characters."})
    target = _ready_replica(endpoint, index)
    if not replica_records_profiles(target):
        how = (
            "its replicas restart one at a time with it"
            if endpoint.profiling
            else "enable profiling on the endpoint: its replicas restart one at a time with it"
        )
        raise Conflict(
            f"{endpoint.name}#{target.index} runs without vLLM's profiler ({PROFILER_FLAG}): {how}, "
            "then profile again.",
            link=endpoint.get_absolute_url(),
        )
    cleaned_load = _clean_load(load, endpoint=endpoint, replica=target)
    with transaction.atomic():
        # One profile per replica at a time: the lock serialises concurrent requests.
        Endpoint.objects.select_for_update().filter(pk=endpoint.pk).first()
        running = active_profile_of_replica(endpoint, target.index)
        if running is not None:
            raise Conflict(
                f"{endpoint.name}#{target.index} is already being profiled (profile #{running.pk}, {running.state}).",
                link=running.get_absolute_url(),
                object_id=running.pk,
            )
        _check_disk()
        params = {
            "endpoint": endpoint.pk,
            "endpoint_name": endpoint.name,
            "replica": target.index,
            "duration_s": duration,
            "load": cleaned_load,
            "label": label,
        }
        job = job_enqueue(
            kind="profile",
            params=params,
            user=user,
            request=request,
            dedupe_key=DEDUPE.format(endpoint.pk, target.index),
            queue=node_queue(target.node.name),
            timeout_s=duration + 900,
            team_id=endpoint.team_id,
        )
        profile = Profile.objects.create(
            endpoint=endpoint,
            endpoint_name=endpoint.name,
            replica_index=target.index,
            job=job,
            label=label,
            duration_s=duration,
            load=cleaned_load,
            created_by=user if user is not None and user.pk else None,
        )
        audit_log(
            actor=user,
            action="profile.create",
            obj=profile,
            request=request,
            changes={
                "endpoint": endpoint.name,
                "replica": target.index,
                "duration_s": duration,
                "load": cleaned_load or None,
                "job": job.pk,
            },
        )
    return profile


def profile_resubmit(*, job, user, request=None):
    """Retry of a profile job: the same replica, window and load, validated again. Returns the new job."""
    params = job.params
    return profile_create(
        endpoint=params.get("endpoint"),
        replica=params.get("replica"),
        duration_s=params.get("duration_s"),
        load=params.get("load") or None,
        label=params.get("label") or "",
        user=user,
        request=request,
    ).job


def profile_delete(*, profile: Profile, user, request=None) -> None:
    """Remove a profile and its trace files (never one still recording or analysing)."""
    if profile.is_active:
        raise Conflict(
            f"Profile #{profile.pk} is {profile.state}: cancel its job or wait for it to end.",
            link=profile.get_absolute_url(),
        )
    pk = profile.pk
    with transaction.atomic():
        audit_log(
            actor=user,
            action="profile.delete",
            obj=profile,
            request=request,
            changes={"endpoint": profile.endpoint_name, "replica": profile.replica_index, "bytes": profile.total_bytes},
        )
        profile.delete()
        transaction.on_commit(lambda: storage.remove_profile_files(pk))
