"""Retry = a new Job with the same parameters, validated again by the same service."""
from console.exceptions import Conflict


def resubmit(*, job, user, request=None):
    if job.kind == "convert":
        from models_registry.services import artifact_convert

        return artifact_convert(artifact=job.target_artifact, user=user, options=job.params,
                                request=request, retry_of=job)
    if job.kind == "hash_artifact":
        from workers.services import job_enqueue

        return job_enqueue(kind=job.kind, params=job.params, user=user, target_model=job.target_model,
                           target_artifact=job.target_artifact, dedupe_key=job.dedupe_key,
                           request=request, retry_of=job)
    raise Conflict(f"Jobs of kind {job.kind!r} cannot be retried.")
