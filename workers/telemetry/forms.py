"""The alerts page's forms: a new rule, and each rule's own row. Text to the values the services take; their rules
(a known metric, a finite threshold, the duration's bounds) stay in the services, whose messages name the field."""

from django import forms

from console.form_layout import OpenChoiceField
from workers.telemetry import selectors
from workers.telemetry.models import AlertRule
from workers.telemetry.services import ALERT_SEVERITIES


def _threshold() -> forms.CharField:
    return forms.CharField(
        required=False, empty_value=None, label="Threshold", widget=forms.TextInput({"inputmode": "decimal"})
    )


def _duration() -> forms.CharField:
    return forms.CharField(
        required=False,
        empty_value=None,
        label="For (seconds)",
        help_text="how long the condition holds before the alert fires.",
        widget=forms.NumberInput({"min": 0}),
    )


class AlertRuleForm(forms.Form):
    name = forms.CharField(required=False, label="Name", widget=forms.TextInput({"maxlength": 100}))
    kind = OpenChoiceField(
        required=False,
        label="Kind",
        choices=[c for c in AlertRule.Kind.choices if c[0] != AlertRule.Kind.BUDGET],  # raised by the gateway
        initial="metric",
    )
    metric = OpenChoiceField(required=False, label="Metric", help_text="for “metric” rules.")
    op = OpenChoiceField(required=False, label="Operator", choices=AlertRule.Op.choices)
    threshold = _threshold()
    duration_s = _duration()
    severity = OpenChoiceField(
        required=False, label="Severity", choices=[(s, s) for s in ALERT_SEVERITIES], initial="warning"
    )
    enabled = forms.BooleanField(required=False, initial=True, label="Enabled")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["metric"].choices = [("", "—")] + [(m, m) for m in sorted(selectors.METRIC_UNITS)]
        self.fields["threshold"].initial = "0"
        self.fields["duration_s"].initial = "60"


class AlertRuleUpdateForm(forms.Form):
    """One row of the rules table (its own ids; the names stay op, threshold, duration_s, enabled)."""

    op = OpenChoiceField(required=False, label="Operator", choices=AlertRule.Op.choices)
    threshold = _threshold()
    duration_s = _duration()
    enabled = forms.BooleanField(required=False, label="Enabled")

    def __init__(self, *args, rule: AlertRule | None = None, **kwargs):
        if rule is not None:
            kwargs.setdefault("auto_id", f"id_rule{rule.pk}_%s")
            kwargs.setdefault(
                "initial",
                {"op": rule.op, "threshold": rule.threshold, "duration_s": rule.duration_s, "enabled": rule.enabled},
            )
        super().__init__(*args, **kwargs)
        self.fields["duration_s"].help_text = ""
