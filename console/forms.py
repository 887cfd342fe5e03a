"""The console's own pages' forms (audit filters, users): the page's text to the values the services take; the
rules stay in the services (their messages name the field, shown beside it)."""

from django import forms

from console.form_layout import FilterForm, OpenChoiceField
from console.roles import ROLES


class AuditFilterForm(FilterForm):
    actor = forms.CharField(required=False, label="User", max_length=150)
    action = OpenChoiceField(required=False, label="Action")
    object_type = OpenChoiceField(required=False, label="Object")
    since = forms.DateField(
        required=False,
        label="Since",
        widget=forms.DateInput(attrs={"type": "date"}),
        error_messages={"invalid": "Enter a date as YYYY-MM-DD."},
    )

    def __init__(self, data=None, *, actions=(), object_types=()):
        super().__init__(data)
        self.fields["action"].choices = [("", "any action")] + [(a, a) for a in actions]
        self.fields["object_type"].choices = [("", "any object")] + [(o, o) for o in object_types]


class UserCreateForm(forms.Form):
    username = forms.CharField(
        label="Username",
        max_length=150,
        widget=forms.TextInput({"autocomplete": "off"}),
        error_messages={"required": "Enter a username."},
    )
    role = forms.ChoiceField(
        choices=[(r, r) for r in ROLES],
        label="Role",
        error_messages={k: f"Choose a role: {', '.join(ROLES)}." for k in ("required", "invalid_choice")},
        help_text="Viewer reads; Operator launches and changes; Admin also manages users and keys.",
    )
    password = forms.CharField(
        required=False,
        label="Password",
        strip=False,
        help_text="blank: one is generated and shown once.",
        widget=forms.PasswordInput({"autocomplete": "new-password"}),
    )


class UserUpdateForm(forms.Form):
    """One row of the users table: its role and whether it may log in. The select sends "true" or "false"; anything
    else is refused, never read as "inactive"."""

    role = forms.ChoiceField(
        choices=[(r, r) for r in ROLES],
        required=False,
        label="Role",
        error_messages={"invalid_choice": f"Choose a role: {', '.join(ROLES)}."},
    )
    active = forms.TypedChoiceField(
        choices=[("true", "active"), ("false", "inactive")],
        coerce=lambda v: v == "true",
        empty_value=None,
        required=False,
        label="Account",
        error_messages={"invalid_choice": "active must be true or false, not %(value)s."},
    )
