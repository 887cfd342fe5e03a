"""Writes of budgets: set (a second one for the same period replaces the first) and delete, audited."""

from __future__ import annotations

from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction

from console.audit import audit_log
from console.models import Team
from endpoints.gateway.models import Budget, GatewayKey


def _checked(*, tokens: int, period: str, mode: str) -> None:
    errors = {}
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
        errors["tokens"] = "A whole number of tokens, at least 1."
    if period not in Budget.Period.values:
        errors["period"] = f"One of {', '.join(Budget.Period.values)}."
    if mode not in Budget.Mode.values:
        errors["mode"] = f"One of {', '.join(Budget.Mode.values)}."
    if errors:
        raise ValidationError(errors)


def budget_set(
    *,
    team: Team | None = None,
    key: GatewayKey | None = None,
    tokens: int,
    period: str,
    mode: str = Budget.Mode.HARD,
    actor=None,
    request=None,
    via: str = "",
) -> Budget:
    """The team's or the key's budget for `period`, created or replaced. The audit row is about the key for a key's
    budget (so that it stays within the key's team, console.teams.visible_audit), else about the budget."""
    if (team is None) == (key is None):
        raise ValueError("a budget is of one team or one key")
    _checked(tokens=tokens, period=period, mode=mode)
    owner = {"team": team} if team is not None else {"key": key}
    try:
        return _set(owner, tokens=tokens, period=period, mode=mode, actor=actor, request=request, via=via)
    except IntegrityError:  # the same budget created at the same moment: the unique index decided; replace it
        return _set(owner, tokens=tokens, period=period, mode=mode, actor=actor, request=request, via=via)


def _set(owner: dict, *, tokens: int, period: str, mode: str, actor, request, via: str) -> Budget:
    with transaction.atomic():
        budget, created = Budget.objects.select_for_update().get_or_create(
            **owner, period=period, defaults={"tokens": tokens, "mode": mode, "created_by": actor}
        )
        before = {"tokens": budget.tokens, "mode": budget.mode}
        if not created:
            # A new size or mode is a new budget for the alerts: 80 % and 100 % of it may fire in this period.
            budget.tokens, budget.mode = tokens, mode
            budget.alerted_80_for = budget.alerted_100_for = None
            budget.save(update_fields=["tokens", "mode", "alerted_80_for", "alerted_100_for"])
        changes = {"period": period, "tokens": tokens, "mode": mode}
        if not created:
            changes["was"] = before
        _audit(budget, "budget.set", changes=changes, actor=actor, request=request, via=via)
    return budget


def budget_delete(*, budget: Budget, actor=None, request=None, via: str = "") -> None:
    with transaction.atomic():
        _audit(
            budget,
            "budget.delete",
            changes={"period": budget.period, "tokens": budget.tokens, "mode": budget.mode},
            actor=actor,
            request=request,
            via=via,
        )
        budget.delete()


def _audit(budget: Budget, action: str, *, changes: dict, actor, request, via: str) -> None:
    if budget.key_id:
        audit_log(
            actor=actor, action=f"gateway_key.{action}", obj=budget.key, changes=changes, request=request, via=via
        )
    else:
        audit_log(actor=actor, action=action, obj=budget, changes=changes, request=request, via=via)
