"""Why a vLLM server stopped, read from its log.

A failed start ends with the API server's wrapper ("RuntimeError: Engine core initialization failed.
See root cause above"); the cause is an exception line further up, printed by the engine core or a worker
with their prefixes ("(Worker pid=9986) ERROR 12-03 10:06:35 [multiproc_executor.py:953] ValueError: …").
No library parses vLLM's logs, so this is written here; tests/fixtures/vllm_logs/ holds real ones.
"""

import re

# vLLM's per-process prefix and its logger's "LEVEL MM-DD HH:MM:SS [file:line]" (vllm/logger.py format).
_PREFIX = re.compile(r"^\([\w.\-]+ pid=\d+\)\s?")
_LOGGER = re.compile(r"^(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d \[[^\]]*\]\s?")
_EXCEPTION = re.compile(r"^((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt|Warning)\w*)(?:: (.*))?$")
# The wrappers that only point elsewhere.
_WRAPPERS = (
    "See root cause above",
    "See stack trace for root cause",
    "Engine core initialization failed",
    "EngineCore encountered an issue",
    "Engine process failed to start",
)


def exception_lines(log_text: str) -> list[str]:
    """Each exception line of the tracebacks in the log ("ValueError: …"), prefixes removed, in order."""
    found = []
    for raw in log_text.splitlines():
        line = _LOGGER.sub("", _PREFIX.sub("", raw.rstrip()))
        match = _EXCEPTION.match(line)
        if match and (match.group(2) is not None or line == match.group(1)):
            found.append(line)
    return found


def root_cause(log_text: str) -> str | None:
    """The first exception line that is not a wrapper pointing at another; else the last exception line."""
    lines = exception_lines(log_text)
    for line in lines:
        if not any(w in line for w in _WRAPPERS):
            return line
    return lines[-1] if lines else None
