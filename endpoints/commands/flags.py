"""The allow-list of extra vLLM flags and the rules that check and render their values."""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from endpoints.commands.checks import _MAX_INT, CommandSpecError, _as_bool, _as_float, _as_int, _check_host


@dataclass(frozen=True)
class _Rule:
    """Validates one vLLM flag's value and renders it as argv pieces."""

    description: str
    render: Callable[[str, Any], list[str]]
    emits_negation: bool = False

    def __call__(self, flag: str, value: Any) -> list[str]:
        return self.render(flag, value)


def _int_rule(lo: int, hi: int, choices: tuple[int, ...] | None = None) -> _Rule:
    def render(flag, value):
        n = _as_int(value, flag, lo, hi)
        if choices is not None and n not in choices:
            raise CommandSpecError(f"{flag} must be one of {', '.join(map(str, choices))}, got {n}")
        return [flag, str(n)]

    desc = f"one of {', '.join(map(str, choices))}" if choices else f"integer {lo}..{hi}"
    return _Rule(desc, render)


def _float_rule(lo: float, hi: float) -> _Rule:
    def render(flag, value):
        return [flag, repr(_as_float(value, flag, lo, hi))]

    return _Rule(f"number {lo}..{hi}", render)


def _choice_rule(*choices: str) -> _Rule:
    def render(flag, value):
        if not isinstance(value, str) or value not in choices:
            raise CommandSpecError(f"{flag} must be one of {', '.join(choices)}, got {value!r}")
        return [flag, value]

    return _Rule(f"one of {', '.join(choices)}", render)


def _name_rule() -> _Rule:
    """A registered component name (parser names etc.), never a path or module."""

    def render(flag, value):
        if not isinstance(value, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}", value):
            raise CommandSpecError(f"{flag} must be a plain name (letters, digits, '_' and '-'), got {value!r}")
        return [flag, value]

    return _Rule("a plain name (letters, digits, _ and -)", render)


def _host_rule() -> _Rule:
    def render(flag, value):
        return [flag, _check_host(value, flag)]

    return _Rule("an IP address or a host name", render)


def _bool_rule(negatable: bool) -> _Rule:
    """true -> ``--flag``; false -> ``--no-flag`` when vLLM has it, otherwise nothing."""

    def render(flag, value):
        if _as_bool(value, flag):
            return [flag]
        return ["--no-" + flag[2:]] if negatable else []

    return _Rule("true or false", render, emits_negation=negatable)


#: vLLM flag -> validator. Every flag (and every ``--no-`` form) here is checked against
#: the installed vLLM's own argument parser in tests/endpoints/test_commands.py, and at launch
#: against the parser of each node's own vLLM (flags_unknown_to). Flags that build_command
#: sets from LaunchSpec fields (--model, --port, --tensor-parallel-size, --dtype, ...) are
#: not here on purpose: set them through the spec. Left out deliberately: anything taking a
#: path or a module (--chat-template, --tool-parser-plugin, --download-dir, --tokenizer,
#: --logits-processors, --worker-cls, --middleware...), JSON blobs (--additional-config,
#: --compilation-config, --hf-overrides, --limit-mm-per-prompt...), and security-relevant
#: server settings (--api-key, --allowed-origins, --ssl-*, --enable-lora...).
EXTRA_ARG_RULES: dict[str, _Rule] = {
    "--block-size": _int_rule(1, 1024, choices=(8, 16, 32, 64, 128)),
    "--max-num-batched-tokens": _int_rule(1, 16_777_216),
    "--enable-prefix-caching": _bool_rule(negatable=True),
    "--enable-chunked-prefill": _bool_rule(negatable=True),
    "--kv-cache-dtype": _choice_rule("auto", "fp8", "fp8_e4m3", "fp8_e5m2"),
    "--seed": _int_rule(0, _MAX_INT),
    "--tokenizer-mode": _choice_rule("auto", "hf", "mistral"),
    "--generation-config": _choice_rule("auto", "vllm"),
    "--enable-log-requests": _bool_rule(negatable=True),
    "--disable-log-stats": _bool_rule(negatable=False),
    "--max-logprobs": _int_rule(-1, 1_000_000),
    "--cpu-offload-gb": _float_rule(0, 4096),
    "--enable-expert-parallel": _bool_rule(negatable=True),
    "--disable-sliding-window": _bool_rule(negatable=True),
    "--disable-custom-all-reduce": _bool_rule(negatable=True),
    "--async-scheduling": _bool_rule(negatable=True),
    "--scheduling-policy": _choice_rule("fcfs", "priority"),
    "--long-prefill-token-threshold": _int_rule(0, 16_777_216),
    "--load-format": _choice_rule("auto", "pt", "safetensors", "sharded_state"),
    "--enable-auto-tool-choice": _bool_rule(negatable=True),
    "--tool-call-parser": _name_rule(),
    "--reasoning-parser": _name_rule(),
    "--uvicorn-log-level": _choice_rule("critical", "error", "warning", "info", "debug"),
    "--disable-uvicorn-access-log": _bool_rule(negatable=True),
    "--max-log-len": _int_rule(0, 1_000_000),
    # vLLM's data parallelism (vllm-ascend's multi-node DP: docs/source/tutorials/models/DeepSeek-R1.md at
    # v0.23.0, "Multi-Node Data Parallel Deployment"). A multi-node endpoint gets the last four from the
    # console, per node (LaunchSpec.distributed with backend "dp"); a spec may not set them beside it.
    "--data-parallel-size": _int_rule(1, 1024),
    "--data-parallel-size-local": _int_rule(1, 1024),
    "--data-parallel-address": _host_rule(),
    "--data-parallel-rpc-port": _int_rule(1024, 65535),
    "--data-parallel-start-rank": _int_rule(0, 1023),
    "--headless": _bool_rule(negatable=False),  # store_true in vllm/entrypoints/launchers/cli_args.py
}
#: Flags that are not on the allow-list because a spec field sets them: the refusal names the field.
SET_BY_SPEC = {
    "--profiler-config": "vLLM's profiler is set by the endpoint's profiling option (its directory is the console's)",
}
#: The data-parallel flags that place one node in a multi-node group: set by LaunchSpec.distributed.
DP_PLACEMENT_FLAGS = (
    "--data-parallel-size",
    "--data-parallel-size-local",
    "--data-parallel-address",
    "--data-parallel-rpc-port",
    "--data-parallel-start-rank",
    "--headless",
)


def _normalise_flag(key: Any) -> str:
    if not isinstance(key, str) or not key.strip():
        raise CommandSpecError(f"extra argument names must be non-empty strings, got {key!r}")
    flag = key.strip()
    if not flag.startswith("--"):
        flag = "--" + flag.lstrip("-")
    return "--" + flag[2:].replace("_", "-")


def validate_extra_args(d: Mapping[str, Any] | None) -> list[str]:
    """Validate ``{flag: value}`` against :data:`EXTRA_ARG_RULES`; return argv pieces.

    Keys may be written ``--block-size``, ``block-size`` or ``block_size``. A value of
    ``None`` means "not set". Boolean flags take true/false (false renders ``--no-<flag>``
    where vLLM has that form). Raises :class:`CommandSpecError` naming the flag.
    """
    if not d:
        return []
    if not isinstance(d, Mapping):
        raise CommandSpecError("extra_args must be a mapping of vLLM flag to value")
    argv: list[str] = []
    seen: dict[str, Any] = {}
    for key, value in d.items():
        flag = _normalise_flag(key)
        if flag in seen:
            raise CommandSpecError(f"{flag} is given twice (as {seen[flag]!r} and {key!r})")
        seen[flag] = key
        rule = EXTRA_ARG_RULES.get(flag)
        if flag in SET_BY_SPEC:
            raise CommandSpecError(f"{flag} is not an allowed vLLM flag: {SET_BY_SPEC[flag]}")
        if rule is None:
            raise CommandSpecError(f"{flag} is not an allowed vLLM flag; allowed: {', '.join(sorted(EXTRA_ARG_RULES))}")
        if value is None:
            continue
        argv += rule(flag, value)
    return argv


def flags_unknown_to(argv: Sequence[str], options: Collection[str]) -> list[str]:
    """The flags of ``argv`` (validate_extra_args' output) that a vLLM parser, given by its option
    strings, does not have. Each rendered form is checked: ``false`` renders ``--no-<flag>``, which
    an older vLLM may lack while it has ``--<flag>``."""
    known = set(options)
    return [a for a in argv if a.startswith("--") and a not in known]
