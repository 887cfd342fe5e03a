"""The gateway pages' forms: text to the typed values the services take (their rules stay there)."""

from django import forms


class NamesField(forms.Field):
    """Every value of a multi-select (served model or endpoint names), as a list."""

    widget = forms.SelectMultiple

    def to_python(self, value):
        return [str(v) for v in value or []]


class KeyLimitsForm(forms.Form):
    rpm_limit = forms.IntegerField(required=False, label="Requests per minute")
    tpm_limit = forms.IntegerField(required=False, label="Tokens per minute")


class KeyCreateForm(KeyLimitsForm):
    name = forms.CharField(required=False)
    models = NamesField(required=False)
    endpoints = NamesField(required=False)
    expires_days = forms.FloatField(required=False, label="Expiry (days)")


class BlueGreenForm(forms.Form):
    action = forms.ChoiceField(
        choices=[("stage", "stage"), ("switch", "switch"), ("rollback", "rollback"), ("canary", "canary")],
        error_messages={"invalid_choice": "Unknown action.", "required": "Unknown action."},
    )
    staged = forms.IntegerField(required=False)
    percent = forms.IntegerField(required=False, label="Canary share (%)")  # the service bounds it


class RolloutForm(forms.Form):
    """Text to values; the bounds and the plan's rules are the service's (set_rollout)."""

    p99_ms = forms.IntegerField(required=False, label="P99 latency (ms)")
    error_pct = forms.FloatField(required=False, label="Error rate (%)")
    ttft_p99_ms = forms.IntegerField(required=False, label="TTFT P99 (ms)")
    window_seconds = forms.IntegerField(required=False, label="Window (s)")
    steps = forms.CharField(required=False, label="Steps (%)")
    auto = forms.BooleanField(required=False, label="Automatic")


def form_error_text(form: forms.Form) -> str:
    """One line for a flash message, each error after its field's label."""
    return " ".join(
        f"{form.fields[field].label or field}: {message}" if field in form.fields else str(message)
        for field, messages in form.errors.items()
        for message in messages
    )
