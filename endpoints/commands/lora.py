"""LoRA in the vLLM command: ``--enable-lora`` with its limits and the adapters to load at start, and the variable
that opens vLLM's run-time load/unload routes. Operators name adapters of the registry (endpoints.lora); the
console, never an operator's flags or env, puts their paths here (``--enable-lora`` is not a free flag and
VLLM_ALLOW_RUNTIME_LORA_UPDATING is on the operators' deny-list: endpoints/commands/flags.py, environment.py)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from endpoints.commands.checks import CommandSpecError, _check_text, _strict_int

#: vLLM 0.32.0's allowed max_lora_rank values (vllm/config/lora.py MaxLoRARanks).
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
LORA_FLAGS = ("--enable-lora", "--max-loras", "--max-lora-rank", "--max-cpu-loras", "--lora-modules")
#: vLLM serves /v1/load_lora_adapter and /v1/unload_lora_adapter only with this set
#: (vllm/entrypoints/serve/lora/api_router.py); they sit under /v1, behind the replica's key.
RUNTIME_LORA_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
# The registry's adapter names (models_registry.models.NAME_VALIDATOR).
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
_KEYS = {"max_loras", "max_lora_rank", "max_cpu_loras", "modules"}


def lora_rank_for(rank: int) -> int | None:
    """The smallest max_lora_rank vLLM takes that holds `rank`, or None above vLLM's largest."""
    return next((allowed for allowed in LORA_RANKS if allowed >= rank), None)


def lora_args(lora: Mapping[str, Any] | None) -> tuple[list[str], dict[str, str]]:
    """(argv, env) for LaunchSpec.lora: {"max_loras", "max_lora_rank", "max_cpu_loras" (or None), "modules":
    [{"name", "path"}]}; ([], {}) without LoRA. Each module goes to --lora-modules as JSON (vLLM 0.32's
    LoRAParserAction takes name=path or JSON; JSON holds any path, a comma included)."""
    if lora is None:
        return [], {}
    if not isinstance(lora, Mapping):
        raise CommandSpecError("lora must be a mapping")
    if unknown := set(lora) - _KEYS:
        raise CommandSpecError(f"lora has unknown keys: {', '.join(sorted(map(str, unknown)))}")
    max_loras = _strict_int(lora.get("max_loras"), "lora.max_loras", 1, 1024)
    rank = lora.get("max_lora_rank")
    if rank not in LORA_RANKS or isinstance(rank, bool):
        raise CommandSpecError(f"lora.max_lora_rank must be one of {', '.join(map(str, LORA_RANKS))}, got {rank!r}")
    argv = ["--enable-lora", "--max-loras", str(max_loras), "--max-lora-rank", str(rank)]
    if lora.get("max_cpu_loras") is not None:
        cpu = _strict_int(lora["max_cpu_loras"], "lora.max_cpu_loras", 1, 4096)
        if cpu < max_loras:
            raise CommandSpecError(f"lora.max_cpu_loras ({cpu}) must be at least max_loras ({max_loras})")
        argv += ["--max-cpu-loras", str(cpu)]
    modules = lora.get("modules") or []
    if not isinstance(modules, list):
        raise CommandSpecError("lora.modules must be a list of {name, path}")
    items, names = [], set()
    for module in modules:
        if not isinstance(module, Mapping) or set(module) != {"name", "path"}:
            raise CommandSpecError(f"lora.modules: each is {{name, path}}, got {module!r}")
        name = module["name"]
        if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
            raise CommandSpecError(f"lora.modules: {name!r} is not an adapter name (letters, digits, . _ -)")
        if name in names:
            raise CommandSpecError(f"lora.modules: {name} is listed twice")
        names.add(name)
        path = _check_text(module["path"], f"lora.modules[{name}].path")
        if not path.startswith("/"):
            raise CommandSpecError(f"lora.modules[{name}].path must be absolute, got {path!r}")
        items.append(json.dumps({"name": name, "path": path}, separators=(",", ":")))
    if items:
        argv += ["--lora-modules", *items]
    return argv, dict(RUNTIME_LORA_ENV)


def lora_paths_in(argv: list[str]) -> list[str]:
    """The adapter paths of a built argv (for a container's read-only mounts)."""
    if "--lora-modules" not in argv:
        return []
    out = []
    for item in argv[argv.index("--lora-modules") + 1 :]:
        if item.startswith("--"):
            break
        out.append(json.loads(item)["path"])
    return out
