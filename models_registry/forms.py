"""The registry's web forms: request text in, the services' typed options out (parsed once, here;
the API's schemas produce the same types)."""

from django import forms

from console.validation import int_in_range
from models_registry.options import ConvertOptions
from models_registry.services import OM_MAX_BATCH, om_max_seq_len

# The fields each conversion target takes from the artifact page's form.
CONVERT_FIELDS = {
    "hf": ("to", "dtype"),
    "fp16": ("to",),
    "bf16": ("to",),
    "om": ("to", "batch_size", "seq_len", "soc_version", "precision_mode"),
}


class ConvertForm(forms.Form):
    to = forms.CharField(required=False)
    dtype = forms.CharField(required=False)
    batch_size = forms.CharField(required=False)
    seq_len = forms.CharField(required=False)
    soc_version = forms.CharField(required=False)
    precision_mode = forms.CharField(required=False)

    def __init__(self, data, *, artifact):
        super().__init__(data)
        self.artifact = artifact

    @property
    def values(self) -> dict:
        """What was typed (stripped), to show the form again."""
        return {name: str(self.data.get(name, "")).strip() for name in self.fields}

    def options(self) -> ConvertOptions:
        """The options given for the chosen target; raises ValidationError for a number that is not one."""
        values = self.values
        given = {k: values[k] for k in CONVERT_FIELDS.get(values["to"], ("to",)) if values[k] != ""}
        if "batch_size" in given:
            given["batch_size"] = int_in_range(given["batch_size"], "batch_size", low=1, high=OM_MAX_BATCH)
        if "seq_len" in given:
            given["seq_len"] = int_in_range(given["seq_len"], "seq_len", low=1, high=om_max_seq_len(self.artifact))
        return ConvertOptions(**given)
