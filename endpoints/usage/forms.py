from django import forms

from endpoints.gateway.models import Budget


class BudgetForm(forms.Form):
    tokens = forms.IntegerField(
        min_value=1,
        label="Tokens",
        help_text="prompt and completion tokens per period",
        widget=forms.NumberInput({"min": 1}),
    )
    period = forms.ChoiceField(choices=Budget.Period.choices, label="Period", help_text="UTC calendar day or month")
    mode = forms.ChoiceField(
        choices=Budget.Mode.choices,
        label="When spent",
        help_text="hard: 429 until the reset; queue: wait for room; soft: pass, alert at 80 % and 100 %",
    )


class UsageFilterForm(forms.Form):
    team = forms.IntegerField(required=False)
    days = forms.TypedChoiceField(choices=[(1, "1"), (7, "7"), (30, "30")], coerce=int, required=False, empty_value=7)
    stack = forms.ChoiceField(choices=[("key", "key"), ("endpoint", "endpoint")], required=False)
