"""The evaluation list's forms: start an evaluation, upload a task. Text to the values the services take; their
rules (the tasks offered, the templates checked on every document) stay in the services, whose messages name the
field and are shown beside it."""

from django import forms
from django.core.exceptions import ValidationError

from console.form_layout import OpenChoiceField
from console.teams import visible
from endpoints.models import Endpoint
from evaluations.models import UploadedTask
from evaluations.services import checked_limit
from models_registry.models import Artifact


class TasksField(forms.MultipleChoiceField):
    """The tasks ticked; the service says which it does not know (the choices only draw the select)."""

    def valid_value(self, value) -> bool:
        return True


class EvaluationForm(forms.Form):
    endpoint = forms.ModelChoiceField(
        queryset=Endpoint.objects.all(),
        required=False,
        label="Endpoint",
        help_text="a running endpoint, scored through the gateway.",
        error_messages={"invalid_choice": "Choose an existing endpoint."},
    )
    artifact = forms.ModelChoiceField(
        queryset=Artifact.objects.alive(),
        required=False,
        label="or an artifact",
        help_text="launched for the evaluation, stopped after it.",
        error_messages={"invalid_choice": "Choose an existing artifact."},
    )
    tasks = TasksField(required=False, label="Tasks", help_text="one or more (Ctrl or Shift to choose several).")
    limit = forms.CharField(
        required=False,
        label="Documents per task",
        help_text="blank: every document.",
        widget=forms.NumberInput({"min": 1}),
    )
    label = forms.CharField(required=False, label="Label", widget=forms.TextInput({"maxlength": 200}))

    def __init__(self, *args, task_names=(), user, **kwargs):
        kwargs.setdefault("auto_id", "ev-%s")
        super().__init__(*args, **kwargs)
        self.fields["tasks"].choices = [(t, t) for t in task_names]
        # The user's teams' alone: another team's id is refused as one that does not exist (console.teams).
        endpoints = visible(Endpoint.objects.all(), user)
        artifacts = visible(Artifact.objects.alive(), user)
        self.fields["endpoint"].queryset = endpoints
        self.fields["artifact"].queryset = artifacts
        self.endpoint_options = [("", "(none: an artifact)")] + [
            (e.pk, e.name) for e in endpoints.filter(desired_state=Endpoint.Desired.RUNNING).order_by("name")
        ]
        self.artifact_options = [("", "(none)")] + [
            (a.pk, str(a)) for a in artifacts.select_related("model").order_by("model__name", "pk")
        ]

    def clean_limit(self):
        try:
            return checked_limit(self.cleaned_data["limit"] or None)
        except ValidationError as exc:
            raise ValidationError(exc.messages) from None


class TaskUploadForm(forms.Form):
    # Blank name or file: the service's own messages (the mark on the label still says they are needed).
    name = forms.CharField(
        required=False,
        label="Name",
        help_text="lower-case letters, digits and underscores, starting with a letter.",
        widget=forms.TextInput({"maxlength": 64}),
    )
    output_type = OpenChoiceField(
        required=False,
        label="Kind",
        choices=[
            (UploadedTask.OutputType.MULTIPLE_CHOICE, "multiple choice"),
            (UploadedTask.OutputType.GENERATE_UNTIL, "generation"),
        ],
    )
    file = forms.FileField(
        required=False,
        label="JSONL file",
        help_text="one document an object.",
        widget=forms.FileInput({"accept": ".jsonl,.json,application/json"}),
    )
    doc_to_text = forms.CharField(
        required=False, strip=False, label="doc_to_text", help_text="the prompt, e.g. Question: {{question}}\\nAnswer:"
    )
    doc_to_target = forms.CharField(required=False, strip=False, label="doc_to_target", help_text="e.g. {{answer}}")
    doc_to_choice = forms.CharField(
        required=False, strip=False, label="doc_to_choice", help_text="multiple choice: e.g. {{choices}}"
    )
    until = forms.CharField(required=False, strip=False, label="Stop strings", help_text="generation; | between them.")
    description = forms.CharField(required=False, label="Description", widget=forms.TextInput({"maxlength": 300}))

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("auto_id", "tu-%s")
        super().__init__(*args, **kwargs)


class CompareWithForm(forms.Form):
    """A finished evaluation's "Compare with" (GET, read by evaluation_compare after this one's id)."""

    ids = forms.ChoiceField(label="Compare with")

    def __init__(self, *, others=()):
        super().__init__(auto_id="compare-%s")
        self.fields["ids"].choices = [(o.pk, f"#{o.pk} {o.title}") for o in others]
