"""The durable job runtime: Job rows, JobRunner kinds (registered by the apps that own the work), queues,
the runner inside a worker, and the enqueue/cancel/retry/reap services. It imports no domain app."""
