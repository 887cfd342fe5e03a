"""The endpoint page's Tune form: what was typed, parsed once into the service's arguments (the service checks the
rest against the endpoint and names the field)."""

import json

from django import forms
from django.core.exceptions import ValidationError

from endpoints.bench.forms import whole_number_field

WORKLOAD_FIELDS = ("num_prompts", "input_len", "output_len", "max_concurrency", "request_rate", "seed")
KNOBS_HELP = (
    "JSON: each knob and its choices. Knobs: max_num_seqs, max_num_batched_tokens, enable_chunked_prefill, "
    "enable_prefix_caching, tensor_parallel_size, data_parallel_size, artifact, speculative."
)


def _bound(label: str, help_text: str, invalid: str) -> forms.FloatField:
    return forms.FloatField(
        required=False,
        label=label,
        help_text=help_text,
        widget=forms.NumberInput({"min": 0, "step": "any"}),
        error_messages={"invalid": invalid},
    )


class TuningForm(forms.Form):
    """The page's order: the workload each trial is measured with, the SLO, the search."""

    num_prompts = whole_number_field(1, 100_000, label="Prompts", initial=32)
    input_len = whole_number_field(1, 1_000_000, label="Input tokens", initial=128)
    output_len = whole_number_field(1, 1_000_000, label="Output tokens", initial=64)
    max_concurrency = whole_number_field(1, 4096, label="Max concurrency", initial=16)
    request_rate = _bound(
        "Request rate (req/s)", "instead of a concurrency cap; blank: none.", "Enter a number above 0."
    )
    ttft_p99_ms = _bound("TTFT P99 (ms)", "time to first token; blank: no bound.", "A number of milliseconds.")
    itl_p99_ms = _bound("Inter-token P99 (ms)", "blank: no bound.", "A number of milliseconds.")
    min_throughput = _bound("Min output tokens/s", "blank: no bound.", "Output tokens per second.")
    space = forms.CharField(
        label="Search space",
        help_text=KNOBS_HELP,
        initial='{"max_num_seqs": [4, 8, 16, 32], "enable_prefix_caching": [true, false]}',
        widget=forms.Textarea({"rows": 3}),
    )
    trials = forms.IntegerField(
        required=False,
        label="Search trials",
        initial=6,
        help_text="besides the baseline and the best two measured again.",
        widget=forms.NumberInput({"min": 1, "max": 50}),
        error_messages={"invalid": "A whole number from 1 to 50."},
    )
    search = forms.ChoiceField(
        label="Search", choices=[("tpe", "Optuna TPE (seeded)"), ("grid", "grid, early stopping")], initial="tpe"
    )
    seed = whole_number_field(0, 2**31 - 1, label="Seed", initial=0, help_text="of the search and the prompts.")

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("auto_id", "tuning-%s")
        super().__init__(*args, **kwargs)

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
