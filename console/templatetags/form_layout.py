"""{% field form.name %} or {% field "name" label="Name" kind="number" value=... errors=... maxlength=100 %}: one
field in the console's one form layout (console.form_layout, templates/_field.html)."""

import inspect

from django import forms, template

from console.form_layout import bound_field_context, field_context

register = template.Library()
_PARAMETERS = set(inspect.signature(field_context).parameters)


@register.inclusion_tag("_field.html")
def field(bound, **options):
    """`bound`: a Django form's bound field (its label, help, value and errors; `options` override them), or a
    field's name with field_context's keywords (help as help_text). Other keywords are the input's attributes
    (maxlength, placeholder, min, accept, ...)."""
    if "help" in options:
        options["help_text"] = options.pop("help")
    extra = {k: options.pop(k) for k in list(options) if k not in _PARAMETERS}
    if isinstance(bound, forms.BoundField):
        context = bound_field_context(bound, **options)
    else:
        context = field_context(name=bound, **options)
    context["attrs"].update(extra)
    return {"f": context}
