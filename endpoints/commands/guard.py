"""The replica key guard (endpoints/replica_guard/llm_console_replica_guard.py): vLLM's ``--api-key``
covers ``/v1``-like paths only, so every replica's server also loads the console's middleware, which
wants the key on every path but reads of ``/health`` and ``/metrics`` and the tokenizer's ``/tokenize`` and
``/detokenize`` (that module says why)."""

from __future__ import annotations

from pathlib import Path

from endpoints.commands.checks import CommandSpecError

#: What ``--middleware`` names: importable from the server's working directory, which holds a copy of it.
GUARD_MIDDLEWARE = "llm_console_replica_guard.ReplicaKeyGuard"
#: The host directory holding that module alone (nothing else of the console becomes importable there).
GUARD_DIR = str(Path(__file__).resolve().parent.parent / "replica_guard")
#: The module's file, which each server finds in its own working directory (endpoints.launch.make_work_dir).
GUARD_MODULE_FILE = GUARD_MIDDLEWARE.partition(".")[0] + ".py"


def guarded_argv(argv: list[str]) -> list[str]:
    """The API server's argv with the guard loaded (a server argv of build_command, nothing else)."""
    if "--middleware" in argv:
        raise CommandSpecError("the argv names a --middleware already: only the console's guard is loaded")
    return [*argv, "--middleware", GUARD_MIDDLEWARE]
