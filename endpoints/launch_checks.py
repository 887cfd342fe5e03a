"""A launch spec's engine options against the command builder's rules and each node's own vLLM: extra flags and
variables (the allow-lists, then the node's parser and envs.py names), the typed engine configs (the node's
config classes, as its agent reported their schemas; vllm-ascend's additional config against the keys its
ascend_config.py reads) and the speculative draft (an artifact of the registry). Every refusal names the field."""

import json
from collections.abc import Sequence
from functools import cache
from pathlib import Path

from django.core.exceptions import ValidationError

from endpoints.commands import (
    DP_PLACEMENT_FLAGS,
    ENGINE_CONFIG_FLAGS,
    CommandSpecError,
    engine_config_json,
    env_unknown_to,
    flags_unknown_to,
    platforms_for_format,
    validate_env,
    validate_extra_args,
)
from endpoints.commands.engine_configs import check_engine_config
from endpoints.endpoint_spec import EndpointSpec
from endpoints.lora import lora_option_flags
from models_registry.models import Artifact
from workers.models import Node

ASCEND_CONFIG_FILE = Path(__file__).parent / "commands" / "data" / "ascend_additional_config.json"
#: vllm-ascend's additional-config keys that name a path to read or write: the console's folders only.
ASCEND_PATH_KEYS = {
    "dump_config_path",
    "dump_config",
    "ascend_log_path",
    "eplb_config.expert_map_path",
    "eplb_config.expert_map_record_path",
    "hamming_sparse.sparse_json_location",
}
_JSON_TYPES = {"bool": bool, "int": int, "float": (int, float), "str": str, "list": list, "object": dict}
#: Draft models load like any model: Hugging Face layouts.
DRAFT_FORMATS = {Artifact.Format.HF, Artifact.Format.COMPRESSED_TENSORS, Artifact.Format.MODELSLIM}


def named(names: list[str], one: str, many: str) -> str:
    return f"{', '.join(names)} {one if len(names) == 1 else many}"


@cache
def ascend_config_keys() -> dict:
    """{"source": ..., "keys": {key: {"type", "nested"?, "line", ...}}}: what vllm_ascend/ascend_config.py reads at
    the pinned vllm-ascend (endpoints/commands/data/README.md says how the file was made)."""
    return json.loads(ASCEND_CONFIG_FILE.read_text())


def _check_ascend_keys(value: dict, known: dict, prefix: str = "ascend") -> None:
    for key, item in value.items():
        path = f"{prefix}.{key}"
        if path.removeprefix("ascend.") in ASCEND_PATH_KEYS:
            raise ValidationError({"ascend": f"{path} names a path: the console does not pass paths to the engine."})
        rule = known.get(key)
        if rule is None:
            source = ascend_config_keys()["source"]
            raise ValidationError({"ascend": f"{path} is not a key {source} reads; it would do nothing."})
        expected = _JSON_TYPES.get(rule.get("type"))
        if expected is not None and item is not None:
            if isinstance(item, bool) and rule.get("type") in ("int", "float"):
                expected = ()  # JSON true is not a number
            if not isinstance(item, expected):
                raise ValidationError({"ascend": f"{path} must be {rule['type']}, got {json.dumps(item)[:60]}."})
        if rule.get("choices") and item not in rule["choices"]:
            raise ValidationError({"ascend": f"{path} must be one of {rule['choices']}, got {item!r}."})
        if isinstance(item, dict) and rule.get("nested"):
            _check_ascend_keys(item, rule["nested"], path)


def _draft_artifact(raw, platform: str) -> Artifact:
    try:
        draft = Artifact.objects.alive().get(pk=int(raw))
    except (Artifact.DoesNotExist, TypeError, ValueError):
        raise ValidationError({"speculative": f"speculative.draft_artifact: no artifact {raw!r}."}) from None
    if draft.status != Artifact.Status.READY:
        raise ValidationError({"speculative": f"speculative.draft_artifact: #{draft.pk} is {draft.status}, not ready."})
    if draft.format not in DRAFT_FORMATS or platform not in platforms_for_format(draft.format):
        raise ValidationError(
            {
                "speculative": f"speculative.draft_artifact: #{draft.pk} is {draft.get_format_display()}, which vLLM "
                f"cannot load as a draft on {platform} nodes."
            }
        )
    return draft


def checked_engine_configs(*, spec: EndpointSpec, nodes: Sequence[Node]) -> tuple[dict, Artifact | None]:
    """(the configs to store, the speculative draft artifact or None). Each config: the command builder's rules
    (a JSON object, no path keys, ascend on Ascend nodes), vllm-ascend's keys for `ascend`, then every node's own
    config class as its agent reported it (Node.engine_cli["configs"]); a node not probed yet is held to the first
    two. The speculative draft is named as draft_artifact, never as a path."""
    platform = nodes[0].platform
    configs = spec.engine_configs()
    draft = None
    if "speculative" in configs:
        speculative = dict(configs["speculative"])
        if "draft_artifact" in speculative:
            draft = _draft_artifact(speculative.pop("draft_artifact"), platform)
        configs["speculative"] = speculative
    for name, value in configs.items():
        try:
            engine_config_json(name, value, platform=platform)
        except CommandSpecError as exc:
            raise ValidationError({name: str(exc)}) from exc
        if name == "ascend":
            _check_ascend_keys(value, ascend_config_keys()["keys"])
            continue
        for node in nodes:
            schema = ((node.engine_cli or {}).get("configs") or {}).get(ENGINE_CONFIG_FLAGS[name])
            if schema is None:
                continue
            try:
                check_engine_config(name, value, schema)
            except CommandSpecError as exc:
                vllm = (node.engine_cli or {}).get("vllm") or "(version unknown)"
                raise ValidationError({name: f"{exc} (vLLM {vllm} on node {node.name})"}) from exc
    return configs, draft


def spec_option_flags(spec: EndpointSpec, configs: dict) -> dict[str, str]:
    """{option string: the spec's field} for what the typed fields add to the command (for the nodes' parsers)."""
    flags = {ENGINE_CONFIG_FLAGS[name]: name for name in configs}
    if spec.async_scheduling is not None:
        flags["--async-scheduling" if spec.async_scheduling else "--no-async-scheduling"] = "async_scheduling"
    if spec.distributed_executor_backend:
        flags["--distributed-executor-backend"] = "distributed_executor_backend"
    if (spec.data_parallel_size or 1) > 1 and not spec.distributed:
        flags["--data-parallel-size"] = "data_parallel_size"
    return flags | lora_option_flags(spec)


def checked_engine_options(
    *, nodes: Sequence[Node], extra_args: dict, env: dict, typed_flags: dict[str, str] | None = None
) -> dict:
    """The command builder's allow-lists, then the vLLM of every node the spec runs on: a flag (of extra_args or of
    the typed fields, `typed_flags`: {flag: field}) or a VLLM_* variable that a node's own parser lacks
    (Node.engine_cli, which its agent reports) is refused, naming the node and its vLLM release. A node whose
    agent has not reported a parser (not probed yet, or the probe failed) is held to the allow-lists alone.
    Returns env with its values as text."""
    try:
        argv = validate_extra_args(extra_args)
    except CommandSpecError as exc:
        raise ValidationError({"extra_args": str(exc)}) from exc
    placed = [flag for flag in DP_PLACEMENT_FLAGS if flag in argv]
    if placed:
        raise ValidationError(
            {
                "extra_args": f"{', '.join(placed)}: data parallelism is set with data_parallel_size (and, across "
                "nodes, distributed 'dp' and worker_nodes); the console gives each node its flags and ranks."
            }
        )
    try:
        env = validate_env(env)
    except CommandSpecError as exc:
        raise ValidationError({"env": str(exc)}) from exc
    errors: dict[str, list[str]] = {}
    for node in nodes:
        cli = node.engine_cli or {}
        if not cli.get("options"):
            continue
        where = f"vLLM {cli.get('vllm') or '(version unknown)'} on node {node.name}"
        if unknown := flags_unknown_to(argv, cli["options"]):
            errors.setdefault("extra_args", []).append(
                f"{named(unknown, 'is not a flag', 'are not flags')} of {where}."
            )
        for flag in flags_unknown_to(list(typed_flags or {}), cli["options"]):
            errors.setdefault(typed_flags[flag], []).append(f"{flag} is not a flag of {where}.")
        if "env" in cli and (unknown := env_unknown_to(env, cli["env"], cli.get("ascend_env"))):
            errors.setdefault("env", []).append(
                f"{named(unknown, 'is not a variable', 'are not variables')} of {where}: it would do nothing."
            )
    if errors:
        raise ValidationError(errors)
    return env
