"""Where jobs are queued: the Redis connection and the queue names (one per kind, one per host)."""

import django_rq
from django.conf import settings
from redis.exceptions import RedisError

from console.exceptions import ServiceUnavailable


def node_queue(node_name: str) -> str:
    """The queue of work that must run on that host (settings.NODE_QUEUE for this one)."""
    return f"node-{node_name}"


def redis_connection():
    return django_rq.get_connection("default")


def redis_check() -> None:
    """Raise ServiceUnavailable with a clear message when Redis can't be reached."""
    try:
        redis_connection().ping()
    except RedisError as exc:
        raise ServiceUnavailable(
            f"The job queue (Redis at {settings.REDIS_URL}) is unreachable: {exc}. Try again shortly."
        ) from exc
