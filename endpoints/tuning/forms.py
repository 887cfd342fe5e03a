"""The endpoint page's Tune form: what was typed, parsed once into the service's arguments (the service checks the
rest against the endpoint and names the field)."""

import json

from django import forms
from django.core.exceptions import ValidationError

from endpoints.bench.forms import BenchmarkForm

WORKLOAD_FIELDS = ("num_prompts", "input_len", "output_len", "max_concurrency", "request_rate", "seed")


class TuningForm(forms.Form):
    num_prompts = BenchmarkForm.base_fields["num_prompts"]
    input_len = BenchmarkForm.base_fields["input_len"]
    output_len = BenchmarkForm.base_fields["output_len"]
    max_concurrency = BenchmarkForm.base_fields["max_concurrency"]
    request_rate = BenchmarkForm.base_fields["request_rate"]
    ttft_p99_ms = forms.FloatField(required=False, error_messages={"invalid": "A number of milliseconds."})
    itl_p99_ms = forms.FloatField(required=False, error_messages={"invalid": "A number of milliseconds."})
    min_throughput = forms.FloatField(required=False, error_messages={"invalid": "Output tokens per second."})
    space = forms.CharField(widget=forms.Textarea)
    trials = forms.IntegerField(required=False, error_messages={"invalid": "A whole number from 1 to 50."})
    search = forms.ChoiceField(choices=[("tpe", "Optuna TPE"), ("grid", "grid, early stopping")], initial="tpe")
    seed = forms.IntegerField(required=False, error_messages={"invalid": "A whole number."})

    def clean_space(self):
        try:
            return json.loads(self.cleaned_data["space"])
        except json.JSONDecodeError as exc:
            raise ValidationError(f"Not JSON: {exc.msg} (line {exc.lineno}).") from None

    def arguments(self) -> dict:
        """The service's keyword arguments; a ValidationError keyed by field when something does not parse."""
        if not self.is_valid():
            raise ValidationError(self.errors.as_data())
        data = self.cleaned_data
        return {
            "workload": {k: data[k] for k in WORKLOAD_FIELDS if k != "seed" and data.get(k) is not None},
            "slo": {k: data[k] for k in ("ttft_p99_ms", "itl_p99_ms", "min_throughput") if data.get(k) is not None},
            "space": data["space"],
            "trials": data.get("trials"),
            "search_kind": data["search"],
            "seed": data.get("seed"),
        }
