"""The launch form: the page's text turned into the typed values endpoint_create takes. The
rules (ranges, devices against TP × PP × replicas, capacity, platforms) are the service's."""

import json
import re

from django import forms
from django.core.exceptions import ValidationError
from pydantic import ValidationError as SpecError

from endpoints.endpoint_spec import TIME_OF_DAY_MESSAGE, EndpointSpec, time_of_day

EXTRA_ARGS_OBJECT = 'Extra vLLM args: a JSON object like {"--enable-prefix-caching": true}.'
AUTOSCALE_OBJECT = 'Autoscaling: a JSON object like {"min_replicas": 1, "max_replicas": 4}, or blank (off).'
ENV_OBJECT = 'Environment: a JSON object like {"VLLM_LOGGING_LEVEL": "INFO"}.'
CONFIG_OBJECT = 'A JSON object like {"cudagraph_mode": "FULL_DECODE_ONLY"}, or blank.'


def _parsed_json(text: str):
    return json.loads(text) if text else {}


def _json_object(text: str, message: str, *, blank=None):
    """The text as a JSON object; blank gives `blank`."""
    text = (text or "").strip()
    if not text:
        return blank
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValidationError(str(exc)) from None
    if not isinstance(parsed, dict):
        raise ValidationError(message)
    return parsed


class EndpointLaunchForm(forms.Form):
    # Blank numbers stay None: the service fills the defaults (they depend on the model and node).
    name = forms.CharField(required=False)
    artifact = forms.IntegerField(required=False, error_messages={"invalid": "Choose an existing artifact."})
    node = forms.CharField(required=False)
    devices = forms.CharField(required=False)
    replicas = forms.IntegerField(required=False)
    tensor_parallel_size = forms.IntegerField(required=False)
    pipeline_parallel_size = forms.IntegerField(required=False)
    max_model_len = forms.IntegerField(required=False)
    max_num_seqs = forms.IntegerField(required=False)
    gpu_memory_utilization = forms.FloatField(required=False, error_messages={"invalid": "Between 0.1 and 0.99."})
    dtype = forms.CharField(required=False)
    enforce_eager = forms.BooleanField(required=False)
    profiling = forms.BooleanField(required=False)
    share_devices = forms.BooleanField(required=False)
    served_model_name = forms.CharField(required=False)
    extra_args = forms.CharField(required=False)
    env = forms.CharField(required=False)
    restart_every_hours = forms.IntegerField(required=False)
    restart_daily_at = forms.CharField(required=False)
    capacity_override = forms.CharField(required=False)
    distributed = forms.CharField(required=False)  # the service names the choices
    worker_nodes = forms.CharField(required=False)
    data_parallel_size = forms.IntegerField(required=False)
    routing = forms.CharField(required=False)  # the service names the choices
    autoscale = forms.CharField(required=False)  # JSON; the service (endpoints.autoscale) checks it
    recipe = forms.CharField(required=False)
    trust_remote_code = forms.BooleanField(required=False)
    # The engine configs: JSON objects (vLLM's config classes of the node check their keys).
    speculative = forms.CharField(required=False)
    compilation = forms.CharField(required=False)
    ascend = forms.CharField(required=False)
    hf_overrides = forms.CharField(required=False)
    kv_transfer = forms.CharField(required=False)
    async_scheduling = forms.ChoiceField(required=False, choices=[("", "vLLM's default"), ("on", "on"), ("off", "off")])
    distributed_executor_backend = forms.CharField(required=False)

    def _config(self, name):
        return _json_object(self.cleaned_data[name], CONFIG_OBJECT)

    def clean_speculative(self):
        return self._config("speculative")

    def clean_compilation(self):
        return self._config("compilation")

    def clean_ascend(self):
        return self._config("ascend")

    def clean_hf_overrides(self):
        return self._config("hf_overrides")

    def clean_kv_transfer(self):
        return self._config("kv_transfer")

    def clean_async_scheduling(self):
        return {"on": True, "off": False}.get(self.cleaned_data["async_scheduling"])

    def spec(self) -> EndpointSpec:
        """The launch spec of what was typed: a blank field is not given (a recipe's value, or the default, stands)."""
        given = {k: v for k, v in self.cleaned_data.items() if v not in (None, "", [], {}, False)}
        try:
            return EndpointSpec(**given)
        except SpecError as exc:
            raise ValidationError({".".join(map(str, e["loc"])) or "general": e["msg"] for e in exc.errors()}) from None

    def clean_autoscale(self):
        return _json_object(self.cleaned_data["autoscale"], AUTOSCALE_OBJECT)

    def clean_node(self):
        return self.cleaned_data["node"] or None

    def clean_worker_nodes(self):
        return [name for name in re.split(r"[,\s]+", self.cleaned_data["worker_nodes"]) if name]

    def clean_devices(self):
        try:
            return [int(d) for d in re.split(r"[,\s]+", self.cleaned_data["devices"]) if d]
        except ValueError:
            raise ValidationError("Devices are numbers, e.g. 0,1.") from None

    def clean_extra_args(self):
        try:
            parsed = _parsed_json(self.cleaned_data["extra_args"])
        except json.JSONDecodeError as exc:
            raise ValidationError(str(exc)) from None
        if not isinstance(parsed, dict):
            raise ValidationError(EXTRA_ARGS_OBJECT)
        return parsed

    def clean_env(self):
        try:
            parsed = _parsed_json(self.cleaned_data["env"])
        except json.JSONDecodeError as exc:
            raise ValidationError(str(exc)) from None
        if not isinstance(parsed, dict):
            raise ValidationError(ENV_OBJECT)
        return parsed

    def clean_restart_daily_at(self):
        try:
            return time_of_day(self.cleaned_data["restart_daily_at"])
        except ValidationError:
            raise ValidationError(TIME_OF_DAY_MESSAGE) from None
