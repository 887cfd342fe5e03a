"""vLLM's JSON-valued config flags as typed fields: each value is checked against the JSON Schema of the config
class it becomes, as the node's own vLLM defines that class (the agent's probe generates it in the engine python,
workers.engine_info._CONFIG_SCHEMAS_PROBE, kept in Node.engine_cli["configs"] under the flag), and rendered as
the flag and its JSON.

What a schema says is the class's field-level validation: known keys (vLLM's config classes forbid others),
each value's type, bounds, Literal and enum values (with the names an enum field's validator takes). What
vLLM checks in __post_init__ or with the model (cross-field rules, the draft model, a connector's settings) is
not in it: vLLM still refuses those when the replica starts. The console is stricter than pydantic's lax mode
in one way: a number as text ("3") or a boolean where an integer is due is refused here, although vLLM would
convert it.

Pure: imports neither Django nor vLLM."""

from __future__ import annotations

import difflib
import json
import math
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError, UnknownType
from jsonschema.exceptions import ValidationError as SchemaValidationError
from jsonschema.validators import validator_for
from referencing.exceptions import Unresolvable

from endpoints.commands.checks import CommandSpecError
from endpoints.commands.spec import ENGINE_CONFIG_FLAGS as ALL_CONFIG_FLAGS

#: The typed fields and the vLLM flag each renders. vLLM 0.32.0 (vllm/engine/arg_utils.py) parses them into
#: SpeculativeConfig (json.loads, then SpeculativeConfig(**...) with the target model's config:
#: create_speculative_config), CompilationConfig and KVTransferConfig (TypeAdapter(cls).validate_json at parse
#: time) and, for --hf-overrides, a plain dict (union_dict_and_str) that ModelConfig applies to the Hugging Face
#: config (config.update, nested dicts to nested configs): no class, so no schema.
#: vllm-ascend's "ascend" (--additional-config) is no vLLM class: endpoints.launch_checks holds it to the keys
#: vllm_ascend/ascend_config.py reads. One table of flags, the launch spec's.
ENGINE_CONFIG_FLAGS: dict[str, str] = {field: flag for field, flag in ALL_CONFIG_FLAGS.items() if field != "ascend"}

_MAX_MESSAGES = 5
_MAX_CHOICES = 12


def _flag(field: str) -> str:
    try:
        return ENGINE_CONFIG_FLAGS[field]
    except KeyError:
        raise CommandSpecError(
            f"{field!r} is not a typed engine config; allowed: {', '.join(ENGINE_CONFIG_FLAGS)}"
        ) from None


def _path(field: str, parts) -> str:
    out = field
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out


def _check_json(value: Any, where: str) -> None:
    """Plain JSON: objects with text keys, arrays, text, finite numbers, true/false/null."""
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise CommandSpecError(f"{where}: keys must be text, got {key!r}")
            _check_json(item, f"{where}.{key}")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_json(item, f"{where}[{i}]")
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise CommandSpecError(f"{where}: {value!r} is not a JSON number")
    elif value is not None and not isinstance(value, (str, int, bool)):
        raise CommandSpecError(f"{where}: {type(value).__name__} is not a JSON value")


def _check_object(field: str, value: Any) -> None:
    if not isinstance(value, dict):
        raise CommandSpecError(f"{field} must be a JSON object, got {type(value).__name__}")
    _check_json(value, field)


def _choices(values: list) -> str:
    """An enum's values for people: text first, each name once (an enum field's validator takes the lower-case
    name too), then the rest."""
    texts = [v for v in values if isinstance(v, str)]
    shown = [v for v in texts if not (v == v.lower() and any(w != v and w.lower() == v for w in texts))]
    folded = len(shown) < len(texts)
    items = [repr(v) for v in shown]
    if folded:
        items[-1] += " (or in lower case)"
    items += [repr(v) for v in values if not isinstance(v, str)]
    more = f", … ({len(items)} in all)" if len(items) > _MAX_CHOICES else ""
    return ", ".join(items[:_MAX_CHOICES]) + more


def _unknown_keys(field: str, error: SchemaValidationError) -> list[str]:
    """One message per key that the object's class lacks (additionalProperties: false)."""
    schema, instance = error.schema, error.instance
    known = set(schema.get("properties", {}))
    patterns = schema.get("patternProperties", {})
    owner = schema.get("title") or "the config"
    messages = []
    for key in instance:
        if key in known or any(Draft202012Validator({"pattern": p}).is_valid(key) for p in patterns):
            continue
        hint = [key.replace("-", "_")] if key.replace("-", "_") in known else []
        hint = hint or difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.8)
        did_you_mean = f"; did you mean {hint[0]}?" if hint else ""
        messages.append(
            f"{_path(field, [*error.absolute_path, key])}: unknown key ({owner} has no such field{did_you_mean})"
        )
    return messages


def _branch_errors(error: SchemaValidationError) -> list[SchemaValidationError]:
    """Of an anyOf/oneOf that failed, the errors of the first branch whose type the value has (it failed on a
    bound, an enum or a key inside there), else []: the value has none of the branches' types."""
    by_branch: dict[int, list[SchemaValidationError]] = {}
    for sub in error.context or []:
        by_branch.setdefault(sub.relative_schema_path[0], []).append(sub)
    for subs in by_branch.values():
        if not any(sub.validator == "type" and not sub.relative_path for sub in subs):
            return subs
    return []


def _describe(field: str, error: SchemaValidationError) -> list[str]:
    where = _path(field, error.absolute_path)
    if error.validator == "additionalProperties" and isinstance(error.instance, dict):
        return _unknown_keys(field, error) or [f"{where}: {error.message}"]
    if error.validator in ("anyOf", "oneOf"):
        if inner := _branch_errors(error):
            return [message for sub in inner for message in _describe(field, sub)]
        types = [sub.validator_value for sub in error.context or [] if sub.validator == "type"]
        flat = [t for ts in types for t in (ts if isinstance(ts, list) else [ts])]
        if flat:
            return [f"{where}: {error.instance!r} is not of type {' or '.join(repr(t) for t in flat)}"]
    if error.validator == "enum":
        return [f"{where}: {error.instance!r} is not one of {_choices(list(error.validator_value))}"]
    return [f"{where}: {error.message}"]


def check_engine_config(field: str, value: dict, schema: dict | None) -> None:
    """Refuse (CommandSpecError naming the field and the key path) a typed engine config that the node's vLLM
    would refuse at field level: `schema` is that node's JSON Schema of the flag's config class
    (Node.engine_cli["configs"][flag]); None (a node not probed, an older probe, --hf-overrides) checks only
    that the value is a JSON object with text keys."""
    _flag(field)
    _check_object(field, value)
    if schema is None:
        return
    if not isinstance(schema, dict):
        raise CommandSpecError(f"{field}: the node's schema of {_flag(field)} is not a JSON object")
    cls = validator_for(schema, default=Draft202012Validator)
    try:  # a corrupt report is not the operator's doing: say so rather than judge the value by it
        cls.check_schema(schema)
        errors = sorted(cls(schema).iter_errors(value), key=lambda e: [str(p) for p in e.absolute_path])
    except (SchemaError, UnknownType, Unresolvable, TypeError) as exc:
        why = exc.message if isinstance(exc, SchemaError) else exc
        raise CommandSpecError(f"{field}: the node's schema of {_flag(field)} cannot be used ({why})") from None
    messages: list[str] = []
    for error in errors:
        messages += [m for m in _describe(field, error) if m not in messages]
    if messages:
        more = len(messages) - _MAX_MESSAGES
        raise CommandSpecError("; ".join(messages[:_MAX_MESSAGES]) + (f"; and {more} more" if more > 0 else ""))


def config_argv(field: str, value: dict) -> list[str]:
    """[flag, its JSON]: the argv pieces of one typed config, the JSON compact and in the value's own key
    order (what vLLM's json.loads or TypeAdapter.validate_json reads back as the same object)."""
    flag = _flag(field)
    _check_object(field, value)
    return [flag, json.dumps(value, separators=(",", ":"), sort_keys=False)]
