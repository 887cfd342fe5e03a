"""Input checks shared by the whole project; the one place numbers are parsed and bounded.

`parse_int` / `parse_float` are the parser: they raise `NumberError` (a ValueError, free of
Django) whose message names the field ("max_num_seqs must be between 1 and 4096, got 0"),
for callers that report their own way (the vLLM command builder raises CommandSpecError
with it). `int_in_range` / `float_in_range` wrap them for forms and services: blank gives
the default, and a bad value raises ValidationError keyed by the field.
"""

import math
import re

from django.core.exceptions import ValidationError

_INT_TEXT = re.compile(r"-?[0-9]{1,12}")


class NumberError(ValueError):
    """A value that is not a number within its bounds; the message names the field."""


def parse_int(value, field: str, *, low: int, high: int, accept_text: bool = True, accept_float: bool = False) -> int:
    """`value` as an int within [low, high]. Never a bool; decimal text (up to 12 digits) only
    with `accept_text`; a float only with `accept_float`, and only a whole one (3.0, not 3.7)."""
    number = value
    if accept_text and isinstance(value, str) and _INT_TEXT.fullmatch(value.strip()):
        number = int(value.strip())
    elif accept_float and isinstance(value, float) and value.is_integer():
        number = int(value)
    if isinstance(number, bool) or not isinstance(number, int):
        raise NumberError(f"{field} must be an integer, got {value!r}")
    if not low <= number <= high:
        raise NumberError(f"{field} must be between {low} and {high}, got {number}")
    return number


def parse_float(
    value, field: str, *, low: float, high: float, low_open: bool = False, accept_text: bool = True
) -> float:
    """`value` as a finite float within [low, high] ((low, high] with `low_open`); never a bool."""
    number = value
    if accept_text and isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            raise NumberError(f"{field} must be a number, got {value!r}") from None
    if isinstance(number, bool) or not isinstance(number, (int, float)):
        raise NumberError(f"{field} must be a number, got {value!r}")
    number = float(number)
    if math.isnan(number) or (number <= low if low_open else number < low) or number > high:
        bound = f"greater than {low}" if low_open else f"at least {low}"
        raise NumberError(f"{field} must be {bound} and at most {high}, got {number}")
    return number


def int_in_range(value, field: str, *, low: int, high: int, default=None, message: str | None = None):
    """`value` as an int within [low, high]; blank gives `default` (which may be None).
    Text and whole floats are accepted (form and JSON input); ValidationError keyed by `field`."""
    if value in (None, ""):
        return default
    try:
        return parse_int(value, field, low=low, high=high, accept_float=True)
    except NumberError:
        raise ValidationError({field: message or f"Enter a whole number between {low} and {high}."}) from None


def float_in_range(
    value, field: str, *, low: float, high: float, low_open: bool = False, default=None, message: str | None = None
):
    """`value` as a float within [low, high] ((low, high] with `low_open`); blank gives `default`."""
    if value in (None, ""):
        return default
    try:
        return parse_float(value, field, low=low, high=high, low_open=low_open)
    except NumberError:
        shown = f"above {low} and up to {high}" if low_open else f"between {low} and {high}"
        raise ValidationError({field: message or f"Enter a number {shown}."}) from None


def field_errors(exc: ValidationError) -> dict[str, list[str]]:
    """A ValidationError's messages by field ("__all__" for those tied to no field)."""
    if hasattr(exc, "error_dict"):
        return {field: [m for e in errs for m in e.messages] for field, errs in exc.error_dict.items()}
    return {"__all__": list(exc.messages)}


def error_lines(exc: ValidationError) -> list[str]:
    """One "field: message" line per message (no prefix for messages tied to no field)."""
    return [m if field == "__all__" else f"{field}: {m}" for field, msgs in field_errors(exc).items() for m in msgs]


def error_text(exc: ValidationError) -> str:
    """A ValidationError as one line for a page's message: 'field: message …' per field."""
    return " ".join(
        (f"{field}: " if field != "__all__" else "") + " ".join(msgs) for field, msgs in field_errors(exc).items()
    )
