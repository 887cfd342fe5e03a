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
