"""Tuning to an SLO, the pure part: the SLO and the search space (parsed once, errors naming the field), which
measured trials meet the SLO, their Pareto front (throughput against P99 latency), the best one, and how a trial's
settings become a launch spec. No database and no clock: endpoints.tuning.jobs runs the trials.

The objective: output tokens per second under the tuning's workload (the console's benchmark client, vLLM's
`bench serve`), maximised subject to the SLO (TTFT P99, inter-token P99, a minimum throughput). Optuna sees the
SLO as named constraints (<= 0 is met: `Trial.set_constraint`), which its TPE sampler honours."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from django.core.exceptions import ValidationError

#: The knobs a search space may vary, each with the launch spec field or vLLM flag it sets.
KNOBS = (
    "max_num_seqs",
    "max_num_batched_tokens",
    "enable_chunked_prefill",
    "enable_prefix_caching",
    "tensor_parallel_size",
    "data_parallel_size",
    "artifact",
    "speculative",
)
INT_RANGES = {
    "max_num_seqs": (1, 4096),  # endpoint_create's range
    "max_num_batched_tokens": (1, 16_777_216),  # endpoints/commands/flags.py's rule
    "tensor_parallel_size": (1, 64),
    "data_parallel_size": (1, 64),
}
BOOL_KNOBS = ("enable_chunked_prefill", "enable_prefix_caching", "speculative")
#: Spec extra_args flags of the boolean and integer knobs vLLM takes as options (vllm/engine/arg_utils.py
#: EngineArgs.add_cli_args: --max-num-batched-tokens, --[no-]enable-chunked-prefill, --[no-]enable-prefix-caching).
FLAG_OF = {
    "max_num_batched_tokens": "--max-num-batched-tokens",
    "enable_chunked_prefill": "--enable-chunked-prefill",
    "enable_prefix_caching": "--enable-prefix-caching",
}
MAX_CHOICES = 16
SEARCHES = ("tpe", "grid")
#: The metrics a trial keeps, under vLLM's saved-result names (endpoints.bench.client.parse_saved_result).
METRICS = ("output_throughput", "request_throughput", "p99_ttft_ms", "p99_itl_ms", "p99_e2el_ms", "completed", "failed")


@dataclass(frozen=True)
class Slo:
    """What the endpoint must keep under the workload; None: no bound on that figure."""

    ttft_p99_ms: float | None = None
    itl_p99_ms: float | None = None
    min_throughput: float | None = None  # output tokens per second

    def violations(self, metrics: dict) -> list[float]:
        """Optuna's constraints: one value per bound, <= 0 where it is met (relative excess above it)."""
        out = []
        for value, bound, higher_is_worse in (
            (metrics.get("p99_ttft_ms"), self.ttft_p99_ms, True),
            (metrics.get("p99_itl_ms"), self.itl_p99_ms, True),
            (metrics.get("output_throughput"), self.min_throughput, False),
        ):
            if bound is None:
                out.append(0.0)
            elif not isinstance(value, int | float) or math.isnan(value):
                out.append(1.0)  # not measured: not met
            else:
                out.append((value - bound) / bound if higher_is_worse else (bound - value) / bound)
        return out

    def constraints(self, metrics: dict) -> dict[str, float]:
        """The violations by bound name, as Optuna 5 keeps a trial's constraints (Trial.set_constraint)."""
        return dict(zip(("ttft_p99_ms", "itl_p99_ms", "min_throughput"), self.violations(metrics), strict=True))

    def met_by(self, metrics: dict) -> bool:
        return all(v <= 0 for v in self.violations(metrics)) and not metrics.get("failed")

    def as_json(self) -> dict:
        return asdict(self)


def _number(raw: dict, name: str, *, low: float, high: float) -> float | None:
    value = raw.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not low < value <= high or math.isnan(value):
        raise ValidationError({f"slo.{name}": f"A number above {low:g} and up to {high:g}, or null (no bound)."})
    return float(value)


def parse_slo(raw) -> Slo:
    if not isinstance(raw, dict):
        raise ValidationError({"slo": 'An object like {"ttft_p99_ms": 2000, "itl_p99_ms": 200, "min_throughput": 50}.'})
    if unknown := sorted(set(raw) - {"ttft_p99_ms", "itl_p99_ms", "min_throughput"}):
        raise ValidationError({f"slo.{unknown[0]}": "Unknown (known: ttft_p99_ms, itl_p99_ms, min_throughput)."})
    slo = Slo(
        ttft_p99_ms=_number(raw, "ttft_p99_ms", low=0, high=3_600_000),
        itl_p99_ms=_number(raw, "itl_p99_ms", low=0, high=3_600_000),
        min_throughput=_number(raw, "min_throughput", low=0, high=10_000_000),
    )
    if slo == Slo():
        raise ValidationError({"slo": "Give at least one bound: ttft_p99_ms, itl_p99_ms or min_throughput."})
    return slo


@dataclass(frozen=True)
class Space:
    """Each knob's choices, in the order given. `speculative_config` is the config a trial with speculative
    decoding on launches with (the endpoint's own when it has one)."""

    choices: dict[str, tuple]
    speculative_config: dict | None = None

    def as_json(self) -> dict:
        return {
            **{k: list(v) for k, v in self.choices.items()},
            **({"speculative_config": self.speculative_config} if self.speculative_config else {}),
        }

    def size(self) -> int:
        return math.prod(len(v) for v in self.choices.values())


def parse_space(raw, *, device_count: int | None, artifacts: set[int], speculative_config: dict | None) -> Space:
    """The search space against what the endpoint can run: TP x DP within the node's devices (`device_count`
    None: a CPU node, one rank), variants among `artifacts` (the checkpoints of the endpoint's model), speculative
    decoding only with a config (given here as speculative_config, or the endpoint's own)."""
    if not isinstance(raw, dict) or not raw:
        raise ValidationError(
            {"space": f'An object of knob -> choices, e.g. {{"max_num_seqs": [4, 8, 16]}}; knobs: {", ".join(KNOBS)}.'}
        )
    raw = dict(raw)
    given_config = raw.pop("speculative_config", None)
    if unknown := sorted(set(raw) - set(KNOBS)):
        raise ValidationError({f"space.{unknown[0]}": f"Not a knob the search can turn (known: {', '.join(KNOBS)})."})
    choices: dict[str, tuple] = {}
    for knob in KNOBS:
        if knob not in raw:
            continue
        values = raw[knob]
        field = f"space.{knob}"
        if not isinstance(values, list) or not values or len(values) > MAX_CHOICES:
            raise ValidationError({field: f"A list of 1 to {MAX_CHOICES} choices."})
        if len(set(map(repr, values))) != len(values):
            raise ValidationError({field: "Each choice once."})
        if knob in BOOL_KNOBS:
            if not all(isinstance(v, bool) for v in values):
                raise ValidationError({field: "Choices are true and/or false."})
        else:
            low, high = INT_RANGES.get(knob, (1, 2**31 - 1))
            if not all(isinstance(v, int) and not isinstance(v, bool) and low <= v <= high for v in values):
                raise ValidationError({field: f"Whole numbers from {low} to {high}."})
        choices[knob] = tuple(values)
    ranks = max(choices.get("tensor_parallel_size", (1,))) * max(choices.get("data_parallel_size", (1,)))
    if ranks > 1 and device_count is None:
        raise ValidationError(
            {
                "space.tensor_parallel_size" if "tensor_parallel_size" in choices else "space.data_parallel_size": (
                    "This node runs one rank per replica (a CPU node): TP and DP stay 1."
                )
            }
        )
    if device_count is not None and ranks > device_count:
        raise ValidationError(
            {
                "space.tensor_parallel_size" if "tensor_parallel_size" in choices else "space.data_parallel_size": (
                    f"TP x DP up to {ranks} needs {ranks} devices; the node has {device_count}."
                )
            }
        )
    if bad := [a for a in choices.get("artifact", ()) if a not in artifacts]:
        raise ValidationError(
            {
                "space.artifact": f"Artifact {bad[0]} is not a ready checkpoint of the endpoint's model "
                f"(choose among {sorted(artifacts)})."
            }
        )
    config = None
    if True in choices.get("speculative", ()):
        config = given_config if given_config is not None else speculative_config
        if not isinstance(config, dict) or not config:
            raise ValidationError(
                {
                    "space.speculative_config": "Speculative decoding on needs its config (vLLM's SpeculativeConfig, "
                    'e.g. {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}): the endpoint '
                    "has none."
                }
            )
    elif given_config is not None:
        raise ValidationError({"space.speculative_config": "Only with speculative: [..., true]."})
    return Space(choices=choices, speculative_config=config)


def spec_changes(params: dict, *, base_extra_args: dict, space: Space) -> dict:
    """The launch spec fields a trial's settings change (EndpointSpec field -> value)."""
    out: dict[str, Any] = {}
    extra = dict(base_extra_args)
    for knob, value in params.items():
        if knob in ("max_num_seqs", "tensor_parallel_size", "data_parallel_size", "artifact"):
            out[knob] = value
        elif knob in FLAG_OF:
            extra[FLAG_OF[knob]] = value
        elif knob == "speculative":
            out["speculative"] = dict(space.speculative_config) if value else None
    if extra != base_extra_args:
        out["extra_args"] = extra
    return out


# --------------------------------------------------------------------------- reading measured trials


@dataclass(frozen=True)
class Point:
    """One measured trial as the analysis sees it."""

    number: int
    params: dict
    throughput: float  # output tokens/s
    p99_ms: float  # the latency the Pareto chart plots: P99 time to first token
    metrics: dict
    meets: bool


def points(trials: list[dict], slo: Slo) -> list[Point]:
    """The measured trials ({"number", "params", "metrics"} each, as stored) that have both figures."""
    out = []
    for t in trials:
        m = t.get("metrics") or {}
        tput, p99 = m.get("output_throughput"), m.get("p99_ttft_ms")
        if isinstance(tput, int | float) and isinstance(p99, int | float):
            out.append(Point(t["number"], t.get("params") or {}, float(tput), float(p99), m, slo.met_by(m)))
    return out


def pareto_front(found: list[Point]) -> list[Point]:
    """The trials no other beats on both throughput (higher) and P99 (lower), by rising P99."""
    front = [
        p
        for p in found
        if not any(
            (q.throughput >= p.throughput and q.p99_ms <= p.p99_ms)
            and (q.throughput > p.throughput or q.p99_ms < p.p99_ms)
            for q in found
        )
    ]
    return sorted(front, key=lambda p: (p.p99_ms, -p.throughput, p.number))


def best(found: list[Point]) -> Point | None:
    """The trial that meets the SLO with the highest throughput (ties: lower P99, then the earlier trial)."""
    meeting = [p for p in found if p.meets]
    return min(meeting, key=lambda p: (-p.throughput, p.p99_ms, p.number)) if meeting else None


def runner_up(found: list[Point], first: Point | None) -> Point | None:
    """The second-best trial meeting the SLO with other settings than the best (repeated beside it)."""
    rest = [p for p in found if p.meets and first is not None and p.params != first.params]
    return best(rest)


def spread(first: float, second: float) -> float:
    """Relative difference of two measurements of the same settings (0.05: 5 %)."""
    mean = (first + second) / 2
    return abs(first - second) / mean if mean else 0.0


def confidence(best_runs: list[float], other_runs: list[float]) -> dict:
    """How sure the advice is, from the best two trials each measured twice: each one's spread between its two
    runs, and whether the best stays ahead of the runner-up in both (its worse run above the other's better)."""
    out: dict[str, Any] = {"best": best_runs, "runner_up": other_runs}
    if len(best_runs) >= 2:
        out["best_spread"] = round(spread(best_runs[0], best_runs[1]), 4)
    if len(other_runs) >= 2:
        out["runner_up_spread"] = round(spread(other_runs[0], other_runs[1]), 4)
    if best_runs and other_runs:
        gap = min(best_runs) - max(other_runs)
        out["separated"] = gap > 0
        out["verdict"] = (
            "sure: the best stays ahead of the runner-up in every run"
            if gap > 0
            else "unsure: the two overlap within their repeat runs; either is as good under this workload"
        )
    elif len(best_runs) >= 2:
        out["verdict"] = f"the best's two runs differ by {100 * out['best_spread']:.1f} % (no runner-up meets the SLO)"
    return out
