"""The endpoint page's profile form: text to the typed values profile_create takes; its rules (the window's bounds,
a ready replica, the load's ranges, which are the benchmark form's) stay in the service."""

from django import forms
from django.conf import settings
from django.utils import timezone
from django.utils.dateformat import format as date_format

from endpoints.bench.forms import replica_field, whole_number_field

#: The load's settings the form offers (profile_create's load; blank ones take the load's defaults).
LOAD_FORM_FIELDS = ("num_prompts", "input_len", "output_len", "max_concurrency", "request_rate")


class ProfileForm(forms.Form):
    duration_s = whole_number_field(1, 100_000, label="Seconds to record")
    replica = replica_field()
    label = forms.CharField(
        required=False,
        label="Label",
        help_text="the set-up's name, e.g. bf16 baseline.",
        widget=forms.TextInput({"maxlength": 200}),  # the service's limit (its message)
    )
    load = forms.BooleanField(
        required=False,
        initial=True,
        label="Drive a load of the console's own during the recording (vLLM's benchmark client, these settings)",
    )
    input_len = whole_number_field(1, 1_000_000, label="Input tokens", initial=128)
    output_len = whole_number_field(1, 1_000_000, label="Output tokens", initial=64)
    max_concurrency = whole_number_field(1, 4096, label="Max concurrency", initial=4)
    request_rate = forms.FloatField(
        required=False,
        label="Request rate (req/s)",
        help_text="instead of a concurrency cap; blank: none.",
        widget=forms.NumberInput({"min": 0, "step": "any"}),
        error_messages={"invalid": "Enter a number above 0 and up to 100000."},
    )
    num_prompts = whole_number_field(1, 100_000, label="Number of prompts")

    def __init__(self, *args, endpoint=None, **kwargs):
        kwargs.setdefault("auto_id", "profile-%s")
        super().__init__(*args, **kwargs)
        duration = self.fields["duration_s"]
        duration.initial = settings.PROFILE_DEFAULT_SECONDS
        duration.widget.attrs["max"] = settings.PROFILE_MAX_SECONDS
        duration.help_text = f"at most {settings.PROFILE_MAX_SECONDS}."
        duration.error_messages["invalid"] = f"Enter a whole number between 1 and {settings.PROFILE_MAX_SECONDS}."
        self.replica_options = [("", "first ready replica")] + (
            [(r.index, f"#{r.index} ({r.state})") for r in endpoint.replica_set.all()] if endpoint is not None else []
        )

    def load_settings(self) -> dict | bool | None:
        """None: no load; else the settings given (True: all the load's defaults). Call after is_valid()."""
        if not self.cleaned_data.get("load"):
            return None
        return {k: self.cleaned_data[k] for k in LOAD_FORM_FIELDS if self.cleaned_data.get(k) is not None} or True


class CompareWithForm(forms.Form):
    """A finished profile's "Compare with": this endpoint's other profiles first, then other endpoints' (GET, read
    by profile_compare with this one's id)."""

    ids = forms.ChoiceField(label="Compare with")

    def __init__(self, *, profile, same=(), elsewhere=()):
        super().__init__(auto_id="profile-compare-%s")

        def when(o) -> str:
            return date_format(timezone.localtime(o.created_at), "Y-m-d H:i")

        groups = []
        if same:
            groups.append((profile.endpoint_name, [(o.pk, f"#{o.pk} {o.setup} ({when(o)})") for o in same]))
        if elsewhere:
            groups.append(
                (
                    "other endpoints",
                    [(o.pk, f"#{o.pk} {o.endpoint_name}: {o.setup} ({when(o)})") for o in elsewhere],
                )
            )
        self.fields["ids"].choices = groups
