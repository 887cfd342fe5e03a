"""The `bench` job kind (workers.runtime.HANDLERS): thin over endpoints.bench.services."""


def run_benchmark(job, ctx) -> dict:
    from endpoints.bench.services import execute_job

    return execute_job(job, ctx)
