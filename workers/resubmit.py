"""Retry = a new Job with the same parameters, validated again by the same service."""
from console.exceptions import Conflict


def resubmit(*, job, user, request=None):
    if job.kind == "convert":
        from models_registry.options import ConvertOptions
        from models_registry.services import artifact_convert

        return artifact_convert(artifact=job.target_artifact, user=user, options=ConvertOptions.from_params(job.params),
                                request=request, retry_of=job)
    if job.kind == "hash_artifact":
        from workers.services import job_enqueue

        return job_enqueue(kind=job.kind, params=job.params, user=user, target_model=job.target_model,
                           target_artifact=job.target_artifact, dedupe_key=job.dedupe_key,
                           request=request, retry_of=job)
    if job.kind == "bench":
        from endpoints.bench.services import benchmark_resubmit

        return benchmark_resubmit(job=job, user=user, request=request)
    if job.kind == "quantize":
        from models_registry.options import QuantizeOptions
        from models_registry.quantize.services import artifact_quantize

        return artifact_quantize(artifact=job.target_artifact, user=user, options=QuantizeOptions.from_params(job.params),
                                 request=request, retry_of=job)
    raise Conflict(f"Jobs of kind {job.kind!r} cannot be retried.")
