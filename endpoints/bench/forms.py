"""The benchmark form (endpoint page): parses what was typed into a WorkloadRequest; the service
checks it against the endpoint (ranges that depend on it, readiness)."""

from django import forms
from django.core.exceptions import ValidationError

from endpoints.bench.workload import WorkloadRequest, parse_levels


def _whole(low: int, high: int) -> forms.IntegerField:
    return forms.IntegerField(
        required=False, error_messages={"invalid": f"Enter a whole number between {low} and {high}."}
    )


class BenchmarkForm(forms.Form):
    endpoint = forms.CharField(required=False)
    replica = _whole(0, 10_000)
    via = forms.CharField(required=False)
    label = forms.CharField(required=False, strip=True)
    num_prompts = _whole(1, 100_000)
    input_len = _whole(1, 1_000_000)
    output_len = _whole(1, 1_000_000)
    max_concurrency = _whole(1, 4096)
    request_rate = forms.FloatField(
        required=False, error_messages={"invalid": "Enter a number above 0 and up to 100000."}
    )
    num_warmups = _whole(0, 1000)
    timeout_s = _whole(10, 7 * 24 * 3600)
    seed = _whole(0, 2**31 - 1)
    concurrencies = forms.CharField(required=False)

    def clean_concurrencies(self):
        return parse_levels(self.cleaned_data["concurrencies"]) or None

    def workload(self, *, ignore_eos: bool) -> WorkloadRequest:
        """The parsed request; a ValidationError keyed by field when something isn't a number."""
        if not self.is_valid():
            raise ValidationError(self.errors.as_data())
        data = {k: v for k, v in self.cleaned_data.items() if k != "endpoint"}
        return WorkloadRequest(**data, ignore_eos=ignore_eos)
