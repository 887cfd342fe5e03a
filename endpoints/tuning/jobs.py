"""The `tune` job kind: search an endpoint's launch settings for the most throughput that keeps its SLO. Imported by
EndpointsConfig.ready().

Each trial launches a trial replica (an endpoint of its own, `tune<id>-<n>`, one replica, the endpoint's spec with
the trial's settings, through endpoint_create's every check), waits for the node's agent to make it ready, measures
it with the console's benchmark client (endpoints.bench.client.execute_run, vLLM's `bench serve`), then stops and
deletes it. Trial 0 is the endpoint's own settings (the baseline); the search asks Optuna (a seeded TPE sampler
with the SLO as its trials' named constraints) or walks a grid with early stopping; at the end the best two trials
that meet the SLO are measured again, which says how sure the advice is.

Durable and resumable: every trial is a TuningTrial row. A Retry of a job whose worker died resumes: trials left
running are marked failed and their replicas removed, the finished ones are replayed into a fresh in-memory study
(optuna.trial.create_trial + Study.add_trial, with their SLO constraints), and the search goes on from there. No
Optuna RDB storage: the rows are the one record."""

import itertools
import logging
import random
import time
from dataclasses import dataclass

import optuna
from django.conf import settings
from django.core.exceptions import ValidationError
from django.utils import timezone

from console.exceptions import Conflict
from console.validation import error_text
from endpoints.bench.client import execute_run
from endpoints.bench.models import BenchmarkRun, BenchStatus
from endpoints.models import Endpoint, Replica
from endpoints.services import endpoint_create, endpoint_delete, endpoint_stop
from endpoints.tuning import search
from endpoints.tuning.models import TrialKind, TrialState, Tuning, TuningStatus, TuningTrial
from endpoints.tuning.services import base_of, trial_spec, tuned_target_missing, tuning_resubmit
from workers.jobs.context import JobCancelled, JobFailed
from workers.jobs.runner import JobRunner

log = logging.getLogger("console.job")
STOP_TIMEOUT_S = 120
GRID_PATIENCE = 3  # a grid stops after this many trials in a row that do not beat the best meeting the SLO


class Tune(JobRunner):
    name = "tune"
    queue = "bench"  # a tuning goes to its endpoint's node queue (the benchmark client reads the tokenizer there)
    timeout = 6 * 3600

    def run(self, job, ctx) -> dict:
        tuning = (
            Tuning.objects.select_related("endpoint__node", "artifact", "node")
            .filter(pk=job.params.get("tuning"))
            .first()
        )
        if tuning is None:
            raise JobFailed("This job's tuning was deleted.")
        if why := tuned_target_missing(tuning):
            raise JobFailed(why)
        Tuning.objects.filter(pk=tuning.pk).update(status=TuningStatus.RUNNING, error="")
        try:
            result = execute(tuning, ctx)
        except JobCancelled:
            _end(tuning, TuningStatus.CANCELLED, "Cancelled.")
            raise
        except JobFailed as exc:
            _end(tuning, TuningStatus.FAILED, str(exc))
            raise
        except Exception as exc:
            _end(tuning, TuningStatus.FAILED, f"{type(exc).__name__}: {exc}")
            raise
        finally:
            remove_trial_replicas(tuning, wait=False)
        _end(tuning, TuningStatus.SUCCEEDED)
        return result

    def resubmit(self, *, job, user, request=None):
        return tuning_resubmit(job=job, user=user, request=request)

    def on_failure(self, job) -> None:
        """A job that died or was reaped: its running trial ends failed and its trial replicas stop (the Retry
        that resumes the tuning deletes them)."""
        tuning = Tuning.objects.filter(pk=job.params.get("tuning")).first()
        if tuning is None:
            return
        TuningTrial.objects.filter(tuning=tuning, state=TrialState.RUNNING).update(
            state=TrialState.FAILED, error=job.error or f"The job ended {job.status}.", finished_at=timezone.now()
        )
        if tuning.status in (TuningStatus.QUEUED, TuningStatus.RUNNING):
            _end(tuning, TuningStatus.CANCELLED if job.status == "cancelled" else TuningStatus.FAILED, job.error)
        remove_trial_replicas(tuning, wait=False)

    def result_object(self, job):
        return Tuning.objects.filter(pk=job.params.get("tuning")).first()


def _end(tuning: Tuning, status: str, error: str = "") -> None:
    Tuning.objects.filter(pk=tuning.pk).update(status=status, error=(error or "")[:5000], finished_at=timezone.now())


def replica_name(tuning: Tuning, number: int) -> str:
    return f"tune{tuning.pk}-{number}"


def remove_trial_replicas(tuning: Tuning, *, wait: bool, ctx=None) -> None:
    """Stop the tuning's trial replicas; with `wait`, until their agent stopped them, then delete them."""
    for endpoint in Endpoint.objects.filter(name__startswith=f"tune{tuning.pk}-"):
        if endpoint.desired_state != Endpoint.Desired.STOPPED:
            endpoint_stop(endpoint=endpoint, user=None)
        if not wait:
            continue
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                endpoint_delete(endpoint=endpoint, user=None)
                break
            except Conflict:  # its agent has not stopped the process yet
                time.sleep(1)
                if ctx is not None:
                    ctx.check_cancelled()
        else:
            log.warning("trial replica %s did not stop within %s s: left stopping", endpoint.name, STOP_TIMEOUT_S)


@dataclass(frozen=True)
class Sweep:
    """A leftover trial replica deleted by the serving controller (its log line: action and reason)."""

    action: str
    reason: str


def sweep_trial_replicas(now: float | None = None) -> list[tuple[Endpoint, Sweep, bool]]:
    """The serving controller's pass over the trial replicas of tunings that ended: each one stopped is deleted.
    A job stops its trial replicas as it ends but cannot wait for their agents when it is cancelled or reaped
    (on_failure); a Retry that resumes the tuning deletes its own leftover first, so none is needed by then. Only
    endpoints named in a trial row of the tuning, and stopped by it, are touched."""
    ended = (TuningStatus.SUCCEEDED, TuningStatus.FAILED, TuningStatus.CANCELLED)
    stopped = list(Endpoint.objects.filter(name__startswith="tune", desired_state=Endpoint.Desired.STOPPED))
    if not stopped:  # the usual pass: no trial replica left
        return []
    of_tuning = dict(
        TuningTrial.objects.filter(
            tuning__status__in=ended, replica_endpoint__in=[e.name for e in stopped]
        ).values_list("replica_endpoint", "tuning_id")
    )
    swept = []
    for endpoint in (e for e in stopped if e.name in of_tuning):
        if not endpoint.name.startswith(f"tune{of_tuning[endpoint.name]}-"):
            continue  # a name a trial row holds, but not its tuning's trial replica's
        reason = f"trial replica of tuning #{of_tuning[endpoint.name]}, which ended"
        try:
            endpoint_delete(endpoint=endpoint, user=None)
        except Conflict:  # its agent has not stopped the process yet: the next pass
            swept.append((endpoint, Sweep("delete", f"{reason}: still stopping"), False))
            continue
        swept.append((endpoint, Sweep("delete", reason), True))
    return swept


def _wait_ready(endpoint: Endpoint, ctx, *, pct: float, what: str) -> str:
    """'' once the trial replica is ready, else why it never will be (failed, crashed, timed out)."""
    deadline = time.monotonic() + settings.ENDPOINT_START_TIMEOUT_SECONDS + 60
    ctx.progress(pct, f"{what}: starting its replica")
    while time.monotonic() < deadline:
        replica = Replica.objects.filter(endpoint=endpoint).first()
        if replica is not None and replica.state == Endpoint.State.READY:
            return ""
        if replica is not None and (
            replica.state == Endpoint.State.FAILED
            or (replica.state == Endpoint.State.CRASHED and replica.crashes_in_a_row)
        ):
            return f"the trial replica {replica.state}: {replica.state_reason or replica.last_log[-500:]}"
        time.sleep(1)
        ctx.progress(pct)
    return f"the trial replica was not ready within {settings.ENDPOINT_START_TIMEOUT_SECONDS + 60} s"


def run_trial(
    tuning: Tuning,
    ctx,
    *,
    number: int,
    params: dict,
    kind: str,
    space: search.Space,
    slo: search.Slo,
    pct: float,
    repeat_of=None,
) -> TuningTrial:
    """Launch one trial replica, measure it, remove it; the row records what happened."""
    name = replica_name(tuning, number)
    trial, _ = TuningTrial.objects.update_or_create(
        tuning=tuning,
        number=number,
        defaults={
            "kind": kind,
            "params": params,
            "repeat_of": repeat_of,
            "state": TrialState.RUNNING,
            "metrics": {},
            "meets_slo": None,
            "error": "",
            "replica_endpoint": name,
            "benchmark": None,
            "started_at": timezone.now(),
            "finished_at": None,
        },
    )
    as_is = "the launch defaults" if tuning.for_artifact else "the endpoint as it is"
    what = f"trial {number} ({kind}: {search_label(params) if params else as_is})"
    try:
        try:
            spec = trial_spec(base_of(tuning), name=name, params=params, space=space)
            endpoint = endpoint_create(spec=spec, user=tuning.created_by)
        except (ValidationError, Conflict) as exc:
            return _trial_failed(
                trial, f"refused at launch: {error_text(exc) if isinstance(exc, ValidationError) else exc}"
            )
        why = _wait_ready(endpoint, ctx, pct=pct, what=what)
        if why:
            return _trial_failed(trial, why)
        run = BenchmarkRun.objects.create(
            job=ctx.job,
            endpoint=endpoint,
            endpoint_name=endpoint.name,
            label=f"tuning #{tuning.pk} trial {number}",
            dataset=tuning.workload.get("dataset", "random"),
            num_prompts=tuning.workload["num_prompts"],
            input_len=tuning.workload.get("input_len"),
            output_len=tuning.workload.get("output_len"),
            max_concurrency=tuning.workload.get("max_concurrency"),
            request_rate=tuning.workload.get("request_rate"),
            num_warmups=tuning.workload.get("num_warmups") or 0,
            timeout_s=tuning.workload["timeout_s"],
            params={**tuning.workload, "replica": None, "via": "replica"},
            created_by=tuning.created_by,
        )
        TuningTrial.objects.filter(pk=trial.pk).update(benchmark=run)
        try:
            execute_run(run, ctx, span=(pct, pct), step=f"{what}: ")
        except JobFailed as exc:
            BenchmarkRun.objects.filter(pk=run.pk).exclude(status=BenchStatus.FAILED).update(
                status=BenchStatus.FAILED, error=str(exc), finished_at=timezone.now()
            )
            return _trial_failed(trial, f"benchmark: {exc}")
        run.refresh_from_db()
        metrics = {k: run.result.get(k) for k in search.METRICS}
        meets = slo.met_by(metrics)
        TuningTrial.objects.filter(pk=trial.pk).update(
            state=TrialState.COMPLETE, metrics=metrics, meets_slo=meets, finished_at=timezone.now()
        )
        ctx.log.info(
            "%s: %.1f tok/s, P99 TTFT %.0f ms, P99 ITL %.0f ms: %s",
            what,
            metrics.get("output_throughput") or 0,
            metrics.get("p99_ttft_ms") or 0,
            metrics.get("p99_itl_ms") or 0,
            "meets the SLO" if meets else "misses the SLO",
        )
    finally:
        remove_trial_replicas(tuning, wait=True, ctx=ctx)
    trial.refresh_from_db()
    return trial


def _trial_failed(trial: TuningTrial, error: str) -> TuningTrial:
    log.warning("trial %s failed: %s", trial.number, error)
    TuningTrial.objects.filter(pk=trial.pk).update(
        state=TrialState.FAILED, error=error[:5000], finished_at=timezone.now()
    )
    trial.refresh_from_db()
    return trial


def search_label(params: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in params.items())


def _stored(tuning: Tuning) -> list[TuningTrial]:
    return list(TuningTrial.objects.filter(tuning=tuning).order_by("number"))


def _study(tuning: Tuning, space: search.Space, slo: search.Slo, done: list[TuningTrial]) -> optuna.Study:
    """A fresh in-memory study with the finished search trials replayed into it (the resume)."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sampler = optuna.samplers.TPESampler(
        seed=tuning.seed,
        n_startup_trials=max(2, min(5, tuning.trials_wanted // 2)),
    )
    study = optuna.create_study(direction="maximize", sampler=sampler)
    distributions = {k: optuna.distributions.CategoricalDistribution(v) for k, v in space.choices.items()}
    for trial in done:
        if trial.kind == TrialKind.REPEAT or set(trial.params) != set(distributions):
            continue
        if trial.state == TrialState.COMPLETE:
            study.add_trial(
                optuna.trial.create_trial(
                    params=trial.params,
                    distributions=distributions,
                    value=float(trial.metrics.get("output_throughput") or 0.0),
                    constraints=slo.constraints(trial.metrics),
                )
            )
        elif trial.state == TrialState.FAILED:
            study.add_trial(
                optuna.trial.create_trial(
                    params=trial.params, distributions=distributions, state=optuna.trial.TrialState.FAIL
                )
            )
    return study


def _grid(tuning: Tuning, space: search.Space) -> list[dict]:
    """Every combination, in a seeded order."""
    keys = list(space.choices)
    combos = [dict(zip(keys, values, strict=True)) for values in itertools.product(*space.choices.values())]
    random.Random(tuning.seed).shuffle(combos)
    return combos


def _best_throughput(trials: list[TuningTrial], slo: search.Slo) -> float:
    found = search.best(search.points([_as_dict(t) for t in trials if t.state == TrialState.COMPLETE], slo))
    return found.throughput if found else float("-inf")


def _as_dict(trial: TuningTrial) -> dict:
    return {"number": trial.number, "params": trial.params, "metrics": trial.metrics, "kind": trial.kind}


def execute(tuning: Tuning, ctx) -> dict:
    slo = search.parse_slo(tuning.slo)
    space = search.Space(
        choices={k: tuple(v) for k, v in tuning.space.items() if k in search.KNOBS},
        speculative_config=tuning.space.get("speculative_config"),
    )
    # A resume: what a dead worker left running ended failed, and its replica goes.
    TuningTrial.objects.filter(tuning=tuning, state=TrialState.RUNNING).update(
        state=TrialState.FAILED, error="its worker stopped mid-trial", finished_at=timezone.now()
    )
    remove_trial_replicas(tuning, wait=True, ctx=ctx)
    done = _stored(tuning)
    if done:
        ctx.log.info("resuming: %d trial(s) recorded, replayed into the study", len(done))
    total = tuning.trials_wanted + 3  # the baseline, the search, two repeats
    numbers = itertools.count(max((t.number for t in done), default=-1) + 1)

    def pct(i: int) -> float:
        return min(99.0, 100.0 * i / total)

    if not any(t.kind == TrialKind.BASELINE and t.state == TrialState.COMPLETE for t in done):
        old = next((t for t in done if t.kind == TrialKind.BASELINE), None)
        run_trial(
            tuning,
            ctx,
            number=old.number if old else next(numbers),
            params={},
            kind=TrialKind.BASELINE,
            space=space,
            slo=slo,
            pct=pct(0),
        )
    searched = [t for t in _stored(tuning) if t.kind == TrialKind.SEARCH]
    if tuning.search == "grid":
        tried = [t.params for t in searched]
        since_best, best_so_far = 0, _best_throughput(_stored(tuning), slo)
        for params in _grid(tuning, space):
            if len(searched) >= tuning.trials_wanted or since_best >= GRID_PATIENCE:
                break
            if params in tried:
                continue
            trial = run_trial(
                tuning,
                ctx,
                number=next(numbers),
                params=params,
                kind=TrialKind.SEARCH,
                space=space,
                slo=slo,
                pct=pct(1 + len(searched)),
            )
            searched.append(trial)
            now_best = _best_throughput(_stored(tuning), slo)
            since_best = 0 if now_best > best_so_far else since_best + 1
            best_so_far = max(best_so_far, now_best)
        if since_best >= GRID_PATIENCE:
            ctx.log.info("grid stopped early: %d trials in a row without a better one meeting the SLO", since_best)
    else:
        study = _study(tuning, space, slo, searched)
        while len(searched) < tuning.trials_wanted:
            asked = study.ask({k: optuna.distributions.CategoricalDistribution(v) for k, v in space.choices.items()})
            params = dict(asked.params)
            same = next((t for t in searched if t.params == params and t.state == TrialState.COMPLETE), None)
            if same is not None:  # the sampler came back to measured settings: its figure, not a new replica
                ctx.log.info("trial %s repeats trial %d's settings: told its figure again", asked.number, same.number)
                trial = same
            else:
                trial = run_trial(
                    tuning,
                    ctx,
                    number=next(numbers),
                    params=params,
                    kind=TrialKind.SEARCH,
                    space=space,
                    slo=slo,
                    pct=pct(1 + len(searched)),
                )
                searched.append(trial)
            if trial.state == TrialState.COMPLETE:
                for name, value in slo.constraints(trial.metrics).items():
                    asked.set_constraint(name, value)
                study.tell(asked, float(trial.metrics.get("output_throughput") or 0.0))
            else:
                study.tell(asked, state=optuna.trial.TrialState.FAIL)
            if len(space.choices) and len({repr(t.params) for t in searched}) >= space.size():
                break  # every combination measured
    return conclude(tuning, ctx, slo=slo, space=space, numbers=numbers, pct=pct(total - 2))


def conclude(tuning: Tuning, ctx, *, slo: search.Slo, space: search.Space, numbers, pct: float) -> dict:
    """Repeat the best two trials meeting the SLO once each (unless a resume already did), then store the best and
    how sure it is."""
    measured = [_as_dict(t) for t in _stored(tuning) if t.state == TrialState.COMPLETE and t.kind != TrialKind.REPEAT]
    found = search.points(measured, slo)
    first = search.best(found)
    second = search.runner_up(found, first)
    runs: dict[int, list[float]] = {}
    for point in (p for p in (first, second) if p is not None):
        repeats = [t for t in _stored(tuning) if t.kind == TrialKind.REPEAT and t.repeat_of == point.number]
        if not any(t.state == TrialState.COMPLETE for t in repeats):
            old = repeats[0].number if repeats else next(numbers)
            repeats = [
                run_trial(
                    tuning,
                    ctx,
                    number=old,
                    params=point.params,
                    kind=TrialKind.REPEAT,
                    space=space,
                    slo=slo,
                    pct=pct,
                    repeat_of=point.number,
                )
            ]
        runs[point.number] = [point.throughput] + [
            float(t.metrics["output_throughput"]) for t in repeats if t.state == TrialState.COMPLETE
        ]
    best = {}
    if first is not None:
        best = {"number": first.number, "params": first.params, "metrics": first.metrics}
    sure = search.confidence(runs.get(first.number, []) if first else [], runs.get(second.number, []) if second else [])
    if second is not None:
        sure["runner_up_number"] = second.number
    Tuning.objects.filter(pk=tuning.pk).update(best=best, confidence=sure)
    baseline = next(
        (t for t in _stored(tuning) if t.kind == TrialKind.BASELINE and t.state == TrialState.COMPLETE), None
    )
    return {
        "best": best,
        "confidence": sure,
        "baseline_throughput": baseline.metrics.get("output_throughput") if baseline else None,
        "trials": TuningTrial.objects.filter(tuning=tuning).count(),
    }
