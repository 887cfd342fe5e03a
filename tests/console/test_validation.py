"""console.validation: the project's one number parser and its form/service wrappers."""

import math

import pytest
from django.core.exceptions import ValidationError

from console.validation import NumberError, float_in_range, int_in_range, parse_float, parse_int


@pytest.mark.parametrize(
    "value,kwargs,expected",
    [
        (5, {}, 5),
        ("5", {}, 5),
        (" -3 ", {"low": -5}, -3),
        (4.0, {"accept_float": True}, 4),
    ],
)
def test_parse_int_accepts(value, kwargs, expected):
    assert parse_int(value, "n", **{"low": 0, "high": 10, **kwargs}) == expected


@pytest.mark.parametrize(
    "value,kwargs,message",
    [
        (True, {}, "n must be an integer, got True"),
        ("5", {"accept_text": False}, "n must be an integer, got '5'"),
        (4.0, {}, "n must be an integer, got 4.0"),
        (4.5, {"accept_float": True}, "n must be an integer, got 4.5"),
        ("1e3", {}, "n must be an integer"),
        ("9" * 13, {}, "n must be an integer"),
        (11, {}, "n must be between 0 and 10, got 11"),
        ("-1", {}, "n must be between 0 and 10, got -1"),
    ],
)
def test_parse_int_refuses_naming_the_field(value, kwargs, message):
    with pytest.raises(NumberError, match=message.replace("(", r"\(")):
        parse_int(value, "n", low=0, high=10, **kwargs)


def test_parse_float_bounds_and_types():
    assert parse_float("0.5", "u", low=0, high=1) == 0.5 and parse_float(1, "u", low=0, high=1) == 1.0
    for bad, message in [
        ("x", "u must be a number"),
        (True, "u must be a number"),
        (None, "u must be a number"),
        (float("nan"), "u must be at least 0 and at most 1"),
        ("inf", "at most 1"),
        (1.5, "at most 1"),
    ]:
        with pytest.raises(NumberError, match=message):
            parse_float(bad, "u", low=0, high=1)
    with pytest.raises(NumberError, match="u must be greater than 0 and at most 1, got 0.0"):
        parse_float(0, "u", low=0, high=1, low_open=True)
    assert not math.isnan(parse_float("1e-9", "u", low=0, high=1, low_open=True))


def test_form_wrappers_give_defaults_and_keyed_messages():
    assert int_in_range("", "replicas", low=1, high=64, default=1) == 1
    assert int_in_range(None, "replicas", low=1, high=64) is None
    assert int_in_range("3", "replicas", low=1, high=64) == 3 and int_in_range(3.0, "replicas", low=1, high=64) == 3
    for bad in ("x", 0, 3.5, True):
        with pytest.raises(ValidationError) as exc:
            int_in_range(bad, "replicas", low=1, high=64)
        assert exc.value.message_dict == {"replicas": ["Enter a whole number between 1 and 64."]}
    assert float_in_range("", "u", low=0.1, high=0.99) is None
    with pytest.raises(ValidationError) as exc:
        float_in_range("2", "u", low=0, high=1, low_open=True)
    assert exc.value.message_dict == {"u": ["Enter a number above 0 and up to 1."]}
    with pytest.raises(ValidationError) as exc:
        float_in_range(1.5, "gpu_memory_utilization", low=0.1, high=0.99, message="Between 0.1 and 0.99.")
    assert exc.value.message_dict == {"gpu_memory_utilization": ["Between 0.1 and 0.99."]}
