"""The artifact page's quantize form: request text in, QuantizeOptions out (parsed once, here; the
API's schema produces the same type)."""

from django import forms
from django.core.exceptions import ValidationError

from console.validation import int_in_range
from models_registry.options import QuantizeOptions
from models_registry.quantize.services import GATE_PCT, MAX_FALLBACK_LAYERS, NUM_SAMPLES, SMOOTHING


def _float_field(bounds):
    low, high = bounds
    return forms.FloatField(required=False, error_messages={"invalid": f"Enter a number between {low} and {high}."})


class QuantizeForm(forms.Form):
    target = forms.CharField(required=False)
    scheme = forms.CharField(required=False)
    method = forms.CharField(required=False)
    calibration = forms.CharField(required=False)  # a dataset's id or name
    evaluation = forms.CharField(required=False)
    smoothing = _float_field(SMOOTHING)
    anti_outlier = forms.CharField(required=False)
    gate_pct = _float_field(GATE_PCT)
    max_fallback_layers = forms.CharField(required=False)
    num_samples = forms.CharField(required=False)
    fallback = forms.BooleanField(required=False)  # a checkbox: "on" or absent
    gptq = forms.BooleanField(required=False)

    def options(self) -> QuantizeOptions:
        """The options given; raises ValidationError for a number that is not one."""
        if not self.is_valid():
            raise ValidationError(self.errors.as_data())
        given = {k: v for k, v in self.cleaned_data.items() if v not in ("", None)}
        for key, (low, high) in (("max_fallback_layers", MAX_FALLBACK_LAYERS), ("num_samples", NUM_SAMPLES)):
            if key in given:
                given[key] = int_in_range(given[key], key, low=low, high=high)
        return QuantizeOptions(**given)
