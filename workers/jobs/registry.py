"""Which job kinds exist and how the job list filters by target. Filled by the apps that own
the work (their AppConfig.ready() imports their jobs module); the runtime keeps no table of its own."""

from collections.abc import Callable
from dataclasses import dataclass

from django.db.models import Q, QuerySet

_runners: dict[str, type] = {}


def register_runner(cls: type) -> None:
    if cls.name in _runners and _runners[cls.name] is not cls:
        raise ValueError(
            f"Job kind {cls.name!r} is registered twice ({_runners[cls.name].__qualname__}, {cls.__qualname__})."
        )
    _runners[cls.name] = cls


def runner_class(kind: str) -> type | None:
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
