"""Which job kinds exist and how the job list filters by target. Filled by the apps that own
the work (their AppConfig.ready() imports their jobs module); the runtime keeps no table of its own."""

from collections.abc import Callable
from dataclasses import dataclass

from django.db.models import Q, QuerySet

from workers.jobs.models import Job


class JobKind:
    """What the runtime asks of a job kind outside its run: its name, queue and timeout, and its hooks.
    workers.jobs.runner.JobRunner, a subclass, adds the work and Retry's default (that module imports this one)."""

    name: str = ""
    queue: str = "default"
    timeout: int = 3600  # seconds a job may run before RQ stops it

    def resubmit(self, *, job: Job, user, request=None) -> Job:
        """What Retry submits (JobRunner's default: a new job with the same parameters and target)."""
        raise NotImplementedError

    def on_failure(self, job: Job) -> None:
        """Clean up after a job that failed, was cancelled or was reaped (its staging is already gone)."""

    def result_object(self, job: Job):
        """What the job made, for the job page's Result link (None: nothing to link)."""
        return None


_runners: dict[str, type[JobKind]] = {}


def register_runner(cls: type[JobKind]) -> None:
    if cls.name in _runners and _runners[cls.name] is not cls:
        raise ValueError(
            f"Job kind {cls.name!r} is registered twice ({_runners[cls.name].__qualname__}, {cls.__qualname__})."
        )
    _runners[cls.name] = cls


def runner_class(kind: str) -> type[JobKind] | None:
    return _runners.get(kind)


def runner_kinds() -> list[str]:
    return sorted(_runners)


@dataclass(frozen=True)
class TargetFilter:
    """A job-list filter by something the jobs work on (e.g. `model`): the jobs whose target
    belongs to it, and the choices the list page offers."""

    jobs_q: Callable[[int], Q]
    choices: Callable[[], QuerySet]


_target_filters: dict[str, TargetFilter] = {}


def register_target_filter(name: str, *, jobs_q: Callable[[int], Q], choices: Callable[[], QuerySet]) -> None:
    _target_filters[name] = TargetFilter(jobs_q=jobs_q, choices=choices)


def target_filter(name: str) -> TargetFilter | None:
    return _target_filters.get(name)
