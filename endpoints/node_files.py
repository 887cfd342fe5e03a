"""What a node keeps on disk per endpoint, and its removal once the endpoint is deleted.

A replica's start leaves three things on the node that runs it (and on each node of a multi-node replica):
its working directory (``DATA_DIR/work/endpoints/<name>/``: the key guard's module, CANN's scratch files),
its profiler directory (``ENDPOINT_PROFILE_ROOT/replicas/<name>-<index>``: traces a profile job did not
collect) and its logs (``DATA_DIR/logs/endpoints/<name>/``). Deleting an endpoint removes its rows only: the
console may run on another host, and only the node's agent can reach the node's disk. So every agent's
replica workload sweeps this host's directories now and then (:data:`SWEEP_EVERY_S`):

- the working and profiler directories of an endpoint that no longer exists go at once: nothing in them is
  read by anyone once no replica runs there;
- its logs stay ``ENDPOINT_LOG_RETENTION_DAYS`` after their last write, for a post-mortem of what it served,
  then go; an endpoint created again under the name before then writes on in the same files, as a restart does.

An endpoint's name is its key on disk (unique, ``[a-z0-9][a-z0-9-]*``). Only directories are removed, never a
symbolic link's target (``shutil.rmtree`` refuses a link, and removes a tree without following the links in it).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import time
from pathlib import Path

from django.conf import settings

from endpoints.launch import endpoint_log_root, endpoint_work_root
from endpoints.models import ENDPOINT_NAME_PATTERN, Endpoint
from endpoints.profiling.paths import replica_profile_root

log = logging.getLogger("console.agent")

#: How often an agent sweeps (its first pass sweeps at once): deleted endpoints are rare, a sweep lists three
#: directories and reads one query.
SWEEP_EVERY_S = 600

_NAME_RE = re.compile(ENDPOINT_NAME_PATTERN)
_PROFILE_DIR_RE = re.compile(rf"({ENDPOINT_NAME_PATTERN})-(\d+)")


def _dirs(root: Path) -> list[os.DirEntry]:
    """The real directories (no links) directly in root, or none when root is missing."""
    try:
        with os.scandir(root) as entries:
            return [e for e in entries if e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return []


def _last_write(path: str) -> float:
    """The newest modification time of the directory and the files in it (rotated logs included)."""
    newest = os.stat(path, follow_symlinks=False).st_mtime
    with os.scandir(path) as entries:
        for entry in entries:
            newest = max(newest, entry.stat(follow_symlinks=False).st_mtime)
    return newest


def sweep_deleted_endpoints(*, now: float | None = None) -> list[Path]:
    """Remove this host's directories of endpoints that no longer exist (see the module's docstring);
    returns what was removed. A directory that cannot be removed is logged and tried again next sweep."""
    now = time.time() if now is None else now
    work = {e.name: e.path for e in _dirs(endpoint_work_root()) if _NAME_RE.fullmatch(e.name)}
    logs = {e.name: e.path for e in _dirs(endpoint_log_root()) if _NAME_RE.fullmatch(e.name)}
    profiles = [(m.group(1), e.path) for e in _dirs(replica_profile_root()) if (m := _PROFILE_DIR_RE.fullmatch(e.name))]
    named = set(work) | set(logs) | {name for name, _ in profiles}
    if not named:
        return []
    # Listed first, looked up after: an endpoint created meanwhile is found, so its new directories stay.
    existing = set(Endpoint.objects.filter(name__in=named).values_list("name", flat=True))
    retention_s = settings.ENDPOINT_LOG_RETENTION_DAYS * 86400
    doomed = [path for name, path in work.items() if name not in existing]
    doomed += [path for name, path in profiles if name not in existing]
    for name, path in logs.items():
        if name in existing:
            continue
        try:
            if now - _last_write(path) >= retention_s:
                doomed.append(path)
        except OSError as exc:
            log.warning("sweep: cannot read %s: %s", path, exc)
    removed = []
    for path in doomed:
        try:
            shutil.rmtree(path)
        except OSError as exc:
            log.warning("sweep: cannot remove %s, a deleted endpoint's: %s", path, exc)
            continue
        log.info("sweep: removed %s (its endpoint was deleted)", path)
        removed.append(Path(path))
    return removed
