"""The gateway pages' forms: text to the typed values the services take (their rules stay there)."""

from django import forms


class NamesField(forms.Field):
    """Every value of a multi-select (served model or endpoint names), as a list."""

    widget = forms.SelectMultiple

    def to_python(self, value):
        return [str(v) for v in value or []]


class KeyLimitsForm(forms.Form):
    # The bounds are the service's (its messages name the field); min only helps the browser's spinner.
    rpm_limit = forms.IntegerField(
        required=False, label="Requests per minute", help_text="blank: no limit.", widget=forms.NumberInput({"min": 1})
    )
    tpm_limit = forms.IntegerField(
        required=False,
        label="Tokens per minute",
        help_text="prompt and completion; blank: no limit.",
        widget=forms.NumberInput({"min": 1}),
    )


class KeyCreateForm(forms.Form):
    # The page's order: who, what it may reach, for how long, how much.
    name = forms.CharField(
        label="Application",
        max_length=100,
        help_text="what will use the key; shown in usage and the audit log.",
        error_messages={"required": "Give the key a name (the application that will use it)."},
    )
    models = NamesField(
        required=False,
        label="Models",
        help_text="served model or LoRA adapter names it may ask for; none chosen: all.",
    )
    endpoints = NamesField(
        required=False, label="Endpoints", help_text="endpoints whose models it may ask for; none chosen: all."
    )
    expires_days = forms.FloatField(
        required=False,
        label="Expires in (days)",
        help_text="blank: never; up to 3650.",
        widget=forms.NumberInput({"min": 0, "max": 3650, "step": "any"}),
    )
    rpm_limit = KeyLimitsForm.base_fields["rpm_limit"]
    tpm_limit = KeyLimitsForm.base_fields["tpm_limit"]
    # Offered only where the user may choose (console.teams.team_options, more than one); the service checks it.
    team = forms.IntegerField(
        required=False,
        label="Team",
        help_text="the team whose endpoints it reaches and whose Admins manage it.",
        widget=forms.Select,
        error_messages={"invalid": "Choose one of your teams."},
    )


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
