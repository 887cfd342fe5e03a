"""One layout for every form of the console: each field as templates/_field.html draws it (a visible label, the
input, its help under it, its errors beside it, tied to the input by aria-describedby). The launch page builds its
fields here (endpoints.launch_page); other pages use the {% field %} tag (console.templatetags.form_layout), with a
Django form's bound field or a name and keywords."""

from django import forms
from django.core.exceptions import ValidationError

from console.validation import field_errors

#: Widgets drawn by a kind of their own; any other input is <input type=...> of its widget's input_type.
_KINDS = (
    (forms.CheckboxInput, "checkbox"),
    (forms.SelectMultiple, "multiple"),
    (forms.Select, "select"),
    (forms.Textarea, "textarea"),
)


def field_context(
    *,
    name: str,
    label: str,
    kind: str = "text",
    value=None,
    help_text: str = "",
    flag: str = "",
    errors=(),
    options=None,
    attrs: dict | None = None,
    rows: int = 2,
    wide: bool = False,
    required: bool = False,
    field_id: str = "",
) -> dict:
    """What templates/_field.html draws. `kind`: checkbox, select, multiple, textarea, or an input type (text,
    number, password, file, ...). `options`: values, or (value, text) or (value, text, model id) tuples; `value` a
    list in a multiple select."""
    field_id = field_id or f"id_{name}"
    errors = list(errors or [])
    value = "" if value is None else value
    chosen = {str(v) for v in value} if isinstance(value, (list, tuple)) else {str(value)}
    described_by = ([f"{field_id}-help"] if flag or help_text else []) + ([f"{field_id}-errors"] if errors else [])
    return {
        "name": name,
        "id": field_id,
        # The box's id: by the name, unless the input's id is its own (a form drawn once per table row).
        "box_id": f"field-{name}" if field_id == f"id_{name}" else f"field-{field_id}",
        "described_by": " ".join(described_by),
        "label": label,
        "flag": flag,
        "help": help_text,
        "kind": kind,
        "value": value,
        "errors": errors,
        "options": None if options is None else _options(options, chosen),
        # Django's grouped choices, (label, [options]): drawn as <optgroup>s.
        "groups": _groups(options, chosen) if options and any(_is_group(o) for o in options) else [],
        "attrs": dict(attrs or {}),
        "rows": rows,
        "wide": wide,
        "required": required,
    }


def _is_group(option) -> bool:
    return not isinstance(option, str) and isinstance(option[1], (list, tuple))


def _options(options, chosen: set[str]) -> list[tuple]:
    """(value, text, selected, model id) of each option; a group's options in their place, flattened."""
    flat = []
    for o in options:
        if _is_group(o):
            flat += _options(o[1], chosen)
            continue
        o = (o, o) if isinstance(o, str) else o
        flat.append((str(o[0]), o[1], str(o[0]) in chosen, str(o[2]) if len(o) > 2 and o[2] is not None else ""))
    return flat


def _groups(options, chosen: set[str]) -> list[tuple]:
    """(label, options) in order; options outside any group are a group of their own with no label."""
    groups: list[tuple] = []
    for o in options:
        if _is_group(o):
            groups.append((o[0], _options(o[1], chosen)))
        elif groups and not groups[-1][0]:
            groups[-1][1].extend(_options([o], chosen))
        else:
            groups.append(("", _options([o], chosen)))
    return groups


def bound_field_context(bound: forms.BoundField, **overrides) -> dict:
    """field_context of a Django form's bound field: its label, help, value, errors, choices and the attributes its
    field gives the widget (min, max, maxlength, ...); `overrides` win."""
    widget = bound.field.widget
    kind = next((k for cls, k in _KINDS if isinstance(widget, cls)), getattr(widget, "input_type", "text"))
    attrs = {**widget.attrs, **bound.field.widget_attrs(widget)}
    rows = int(attrs.pop("rows", 2))
    attrs.pop("cols", None)
    value = bound.value()
    if kind == "checkbox":
        value = bool(value)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)
    context = {
        "name": bound.name,
        "label": bound.label,
        "kind": kind,
        "value": value,
        "help_text": str(bound.help_text or ""),
        "errors": bound.errors,
        "options": list(bound.field.choices) if hasattr(bound.field, "choices") else None,
        "attrs": {k: v for k, v in attrs.items() if v is not None and k != "required"},
        "rows": rows,
        "required": bound.field.required,
        "field_id": bound.auto_id or f"id_{bound.name}",
    }
    return field_context(**{**context, **overrides})


def errors_by_field(exc: ValidationError) -> dict[str, list[str]]:
    """A refusal's messages by the field they go beside; those of no field under "general" (shown above the
    fields)."""
    return {("general" if field == "__all__" else field): msgs for field, msgs in field_errors(exc).items()}


def bind_errors(form: forms.Form, exc: ValidationError) -> None:
    """A service's refusal onto the form it came from: each message beside its field, those of a field the form
    does not have (or of none) above the fields (form.non_field_errors)."""
    for field, errors in field_errors(exc).items():
        form.add_error(field if field in form.fields else None, errors)


class OpenChoiceField(forms.ChoiceField):
    """A select whose choices only draw it: any value passes the form. A list filter's unknown value (an old
    bookmark, a link from another page) matches nothing, as before filters were forms; a write form's value is
    checked by its service, whose message names the field (the same message the API gives)."""

    def valid_value(self, value) -> bool:
        return True


class FilterForm(forms.Form):
    """A list page's filters (GET): drawn in one row (<form class="filters">, each field through _field.html with its
    label visible); values() gives each filter's cleaned value, blank where it was refused (its error is shown beside
    it)."""

    def values(self) -> dict:
        self.is_valid()
        return {name: self.cleaned_data.get(name) or "" for name in self.fields}
