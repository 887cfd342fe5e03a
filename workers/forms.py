"""Node settings forms: the page's text as the strings the service checks (its messages name the field)."""

from django import forms


class NodeEngineRuntimeForm(forms.Form):
    engine_runtime = forms.CharField(required=False)
    engine_image_variant = forms.CharField(required=False)
