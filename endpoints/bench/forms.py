"""The benchmark form (endpoint page): parses what was typed into a WorkloadRequest; the service
checks it against the endpoint (ranges that depend on it, readiness)."""

from django import forms
from django.core.exceptions import ValidationError

from console.form_layout import FilterForm, OpenChoiceField
from endpoints.bench.workload import WorkloadRequest, parse_levels


def whole_number_field(
    low: int, high: int, *, label: str = "", initial=None, help_text: str = ""
) -> forms.IntegerField:
    # The bounds are the service's (they may depend on the endpoint); min/max only help the browser's spinner.
    return forms.IntegerField(
        required=False,
        label=label,
        initial=initial,
        help_text=help_text,
        widget=forms.NumberInput({"min": low, "max": high}),
        error_messages={"invalid": f"Enter a whole number between {low} and {high}."},
    )


def replica_field() -> forms.IntegerField:
    # A select of the endpoint's replicas, filled by the form; the service says which index does not exist.
    return forms.IntegerField(
        required=False,
        label="Replica",
        widget=forms.Select,
        error_messages={"invalid": "Enter a whole number between 0 and 10000."},
    )


class BenchmarkForm(forms.Form):
    """The page's order: what to run, the workload, where to send it. `mode`, `dataset`, `prompt_file` and
    `ignore_eos` are read by the view (they choose the service and the upload); the rest is the WorkloadRequest."""

    _DRAWN_ONLY = ("mode", "dataset", "prompt_file", "ignore_eos")

    endpoint = forms.CharField(required=False, widget=forms.HiddenInput)
    mode = forms.ChoiceField(
        required=False,
        label="Run",
        choices=[("run", "one benchmark"), ("sweep", "concurrency sweep 1, 2, 4 … N")],
    )
    dataset = forms.ChoiceField(
        required=False,
        label="Prompts",
        choices=[("random", "random (fixed lengths)"), ("file", "uploaded file (JSONL)")],
    )
    input_len = whole_number_field(1, 1_000_000, label="Input tokens", initial=512)
    output_len = whole_number_field(1, 1_000_000, label="Output tokens", initial=128)
    num_prompts = whole_number_field(
        1, 100_000, label="Number of prompts", help_text="blank: 100 (a sweep: 4× the concurrency)."
    )
    max_concurrency = whole_number_field(1, 4096, label="Max concurrency", initial=32, help_text="a sweep: its N.")
    request_rate = forms.FloatField(
        required=False,
        label="Request rate (req/s)",
        help_text="Poisson arrivals instead of a concurrency cap; blank: all at once.",
        widget=forms.NumberInput({"min": 0, "step": "any"}),
        error_messages={"invalid": "Enter a number above 0 and up to 100000."},
    )
    num_warmups = whole_number_field(0, 1000, label="Warm-up requests", initial=0)
    timeout_s = whole_number_field(10, 7 * 24 * 3600, label="Timeout per run (s)", initial=1800)
    seed = whole_number_field(0, 2**31 - 1, label="Seed", initial=0, help_text="of the prompts and the arrivals.")
    via = OpenChoiceField(  # the service names an unknown target
        required=False,
        label="Target",
        choices=[("replica", "a replica directly"), ("gateway", "through the gateway (every ready replica)")],
    )
    replica = replica_field()
    label = forms.CharField(
        required=False,
        strip=True,
        label="Label",
        help_text="the set-up's name, e.g. W8A8 TP2.",
        widget=forms.TextInput({"maxlength": 200}),  # the service's limit (its message)
    )
    prompt_file = forms.FileField(
        required=False,
        label="Prompt file",
        help_text='with "uploaded file": JSON lines {"prompt": …, "output_tokens"?: …}.',
        widget=forms.FileInput({"accept": ".jsonl,.json,application/json,text/plain"}),
    )
    ignore_eos = forms.BooleanField(
        required=False, initial=True, label="Ignore EOS (generate exactly the output tokens)"
    )
    concurrencies = forms.CharField(required=False)

    def __init__(self, *args, endpoint=None, **kwargs):
        kwargs.setdefault("auto_id", "bench-%s")
        super().__init__(*args, **kwargs)
        if endpoint is not None:
            self.initial["endpoint"] = endpoint.pk
        # The replica select's options: the endpoint's replicas (the page draws the form for one endpoint).
        self.replica_options = [("", "any ready replica")] + (
            [(r.index, f"#{r.index} ({r.state})") for r in endpoint.replica_set.all()] if endpoint is not None else []
        )

    def clean_concurrencies(self):
        return parse_levels(self.cleaned_data["concurrencies"]) or None

    def workload(self, *, ignore_eos: bool) -> WorkloadRequest:
        """The parsed request; a ValidationError keyed by field when something isn't a number."""
        if not self.is_valid():
            raise ValidationError(self.errors.as_data())
        data = {k: v for k, v in self.cleaned_data.items() if k != "endpoint" and k not in self._DRAWN_ONLY}
        return WorkloadRequest(**data, ignore_eos=ignore_eos)


class BenchFilterForm(FilterForm):
    endpoint = OpenChoiceField(required=False, label="Endpoint")
    state = OpenChoiceField(required=False, label="State")

    def __init__(self, data=None, *, endpoints=(), states=()):
        super().__init__(data)
        self.fields["endpoint"].choices = [("", "all endpoints")] + [(e, e) for e in endpoints]
        self.fields["state"].choices = [("", "any state")] + [(s, s) for s in states]


class CompareForm(forms.Form):
    """The comparison's baseline and each device type's cost per hour (GET). The view reads the same names for the
    page, the CSV and the JSON; compare.cost_rates checks the costs."""

    baseline = OpenChoiceField(required=False, label="Baseline")

    def __init__(self, data=None, *, rows=(), device_types=(), default_rates=None):
        super().__init__(data, auto_id="compare-%s")
        self.fields["baseline"].choices = [
            (r["id"], f"#{r['id']} {r['setup']}") for r in rows if r["request_throughput"] is not None
        ]
        for device_type in device_types:
            configured = (default_rates or {}).get(device_type)
            self.fields[f"cost_{device_type.lower()}"] = forms.CharField(
                required=False,
                label=f"Cost per {device_type}-hour",
                help_text=f"blank: the configured {configured}." if configured is not None else "blank: none.",
                widget=forms.NumberInput({"min": 0, "step": "any"}),
            )

    def cost_fields(self):
        return [self[name] for name in self.fields if name.startswith("cost_")]
