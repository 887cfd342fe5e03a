"""Node settings forms: the page's text as the strings the service checks (its messages name the field)."""

from django import forms

from console.form_layout import FilterForm, OpenChoiceField


class NodeEngineRuntimeForm(forms.Form):
    """The node page's engine runtime (an Admin's); the service checks both values and names the field."""

    engine_runtime = OpenChoiceField(required=False, label="Runtime")
    engine_image_variant = OpenChoiceField(required=False, label="Image")

    def __init__(self, *args, runtimes=(), image_variants=(), **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["engine_runtime"].choices = list(runtimes)
        self.fields["engine_image_variant"].choices = list(image_variants)


class JobFilterForm(FilterForm):
    status = OpenChoiceField(required=False, label="Status")
    kind = OpenChoiceField(required=False, label="Kind")
    model = OpenChoiceField(required=False, label="Model")
    user = forms.CharField(required=False, label="User", max_length=150)

    def __init__(self, data=None, *, statuses=(), kinds=(), models=()):
        super().__init__(data)
        self.fields["status"].choices = [("", "any status")] + [(s, s) for s in statuses]
        self.fields["kind"].choices = [("", "any kind")] + [(k, k) for k in kinds]
        self.fields["model"].choices = [("", "any model")] + [(str(m.pk), m.name) for m in models]

    def model_id(self) -> int | None:
        """The model filter as an id; not a number (an old link): no filter, as before."""
        value = self.values()["model"]
        return int(value) if value.isdigit() else None
