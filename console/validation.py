"""Input checks shared by the services; each raises ValidationError keyed by field."""
from django.core.exceptions import ValidationError


def int_in_range(value, field: str, *, low: int, high: int, default=None):
    """`value` as an int within [low, high]; blank gives `default` (which may be None)."""
    if value in (None, ""):
        return default
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ValidationError({field: f"Enter a whole number between {low} and {high}."}) from None
    if not low <= number <= high:
        raise ValidationError({field: f"Enter a whole number between {low} and {high}."})
    return number


def field_errors(exc: ValidationError) -> dict[str, list[str]]:
    """A ValidationError's messages by field ("__all__" for those tied to no field)."""
    if hasattr(exc, "error_dict"):
        return {field: [m for e in errs for m in e.messages] for field, errs in exc.error_dict.items()}
    return {"__all__": list(exc.messages)}


def error_lines(exc: ValidationError) -> list[str]:
    """One "field: message" line per message (no prefix for messages tied to no field)."""
    return [m if field == "__all__" else f"{field}: {m}" for field, msgs in field_errors(exc).items() for m in msgs]
