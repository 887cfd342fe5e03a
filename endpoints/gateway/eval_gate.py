"""Gates on an automatic rollout that layers above serving answer (evaluations/ registers its accuracy gate in
its AppConfig.ready(); serving never imports it). The controller passes each decision through them: a gate may
hold it (an evaluation is still running) or turn it into a rollback (the staged side scored worse), with its
figures in the decision; with none registered, the SLO decision stands."""

from __future__ import annotations

from collections.abc import Callable

from endpoints.gateway.rollout import Decision

# (pair, the SLO policy's decision, now) -> a replacement decision, or None (no opinion)
RolloutGate = Callable[[object, Decision, float], Decision | None]

_gates: list[RolloutGate] = []


def register_rollout_gate(gate: RolloutGate) -> None:
    if gate not in _gates:
        _gates.append(gate)


def gated(gw, decision: Decision, now: float) -> Decision:
    for gate in _gates:
        replaced = gate(gw, decision, now)
        if replaced is not None:
            return replaced
    return decision
