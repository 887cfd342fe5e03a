"""Typed readers for settings from the environment.

Every setting of the console comes through these helpers, so that one place says
how a value is parsed. A secret may come from NAME or from the file named by
NAME_FILE (Docker/Kubernetes secrets), never from the code.
"""

import os
import secrets
from collections.abc import Mapping
from pathlib import Path

from django.core.exceptions import ImproperlyConfigured


def env_str(name: str, default: str = "") -> str:
    """The text as given (an empty value is kept, not replaced by the default)."""
    return os.environ.get(name, default)


def env_secret(name: str, default: str = "") -> str:
    """The contents of the file NAME_FILE names (stripped; unreadable: an error at start), else NAME."""
    path = os.environ.get(f"{name}_FILE")
    if path:
        try:
            return Path(path).read_text().strip()
        except OSError as exc:
            raise ImproperlyConfigured(f"{name}_FILE={path} cannot be read: {exc}") from exc
    return os.environ.get(name, default)


def env_bool(name: str, default: bool = False) -> bool:
    """1/true/yes/on or 0/false/no/off, any case; unset or empty: the default; anything else: an error at start."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    value = raw.strip().lower()
    if value in {"1", "true", "yes", "on"}:
        return True
    if value in {"0", "false", "no", "off"}:
        return False
    raise ImproperlyConfigured(f"{name}={raw!r} is not a boolean (use true/false)")


def env_int(name: str, default: int) -> int:
    """An integer; unset or empty: the default; anything else: an error at start."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError as exc:
        raise ImproperlyConfigured(f"{name}={raw!r} is not an integer") from exc


def env_float(name: str, default: float) -> float:
    """A number; unset or empty: the default; anything else: an error at start."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError as exc:
        raise ImproperlyConfigured(f"{name}={raw!r} is not a number") from exc


def env_list(name: str, default: list[str] | None = None, sep: str = ",") -> list[str]:
    """Comma-separated items, each stripped, empty ones dropped; unset or blank: the default."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return list(default or [])
    return [item.strip() for item in raw.split(sep) if item.strip()]


def env_pairs(name: str) -> dict[str, str]:
    """NAME=VALUE pairs separated by commas, e.g. "GLOO_SOCKET_IFNAME=eth0,HCCL_IF_IP=10.0.0.5"."""
    pairs = {}
    for item in env_list(name):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ImproperlyConfigured(f"{name}: {item!r} is not NAME=VALUE")
        pairs[key.strip()] = value.strip()
    return pairs


def env_path(name: str, default: Path) -> Path:
    """A path, `~` expanded and made absolute (symlinks resolved); unset or empty: the default."""
    raw = os.environ.get(name)
    return Path(raw).expanduser().resolve() if raw else Path(default).resolve()


def private_data_dir(path: Path) -> Path:
    """Create the data directory 0700, and tighten one an older version left readable by others
    (with its SQLite files), so that no other user of the host reads the database or keys."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    for item in (path, *path.glob("*.sqlite3*")):
        try:
            if item.stat().st_uid == os.getuid() and item.stat().st_mode & 0o077:
                item.chmod(0o700 if item.is_dir() else 0o600)
        except OSError:  # not ours to change (a shared mount): the umask still covers new files
            pass
    return path


def secret_from_file(path: Path) -> str:
    """The random secret kept in `path`, made 0600 on the first call. Written aside then linked
    into place: processes starting at once all read the one complete key that won."""
    if not path.exists():
        spare = path.with_name(f".{path.name}.{os.getpid()}")
        fd = os.open(spare, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as file:
            file.write(secrets.token_urlsafe(50) + "\n")
        try:
            os.link(spare, path)
        except FileExistsError:
            pass
        finally:
            spare.unlink()
    secret = path.read_text().strip()
    if not secret:
        raise ImproperlyConfigured(f"{path} is empty: delete it (a new key is made) or set SECRET_KEY")
    return secret


# What every child process (engine replicas, the benchmark client, engine probes, serve
# checks) inherits from its parent's environment: the host's locale, paths and
# the accelerator stack (CANN's set_env.sh, CUDA), nothing else. Everything the console adds
# (devices, engine settings, the user's allow-listed variables) comes from build_command. The
# console's own secrets and settings (SECRET_KEY, DATABASE_URL, REDIS_URL, METRICS_TOKEN, ...)
# are on no list, so they never reach a replica.
INHERITED_ENV = frozenset(
    {
        "PATH",
        "HOME",
        "USER",
        "LOGNAME",
        "SHELL",
        "LANG",
        "LANGUAGE",
        "TZ",
        "TMPDIR",
        "XDG_CACHE_HOME",
        "LD_LIBRARY_PATH",
        "PYTHONPATH",  # CANN's and CUDA's libraries and Python packages
        "TOOLCHAIN_HOME",  # CANN
        "HF_HOME",
        "HF_HUB_CACHE",
        "HF_HUB_OFFLINE",
        "TRANSFORMERS_OFFLINE",
        "TOKENIZERS_PARALLELISM",
    }
)
INHERITED_ENV_PREFIXES = ("LC_", "ASCEND_", "ATB_", "HCCL_", "CUDA_", "NVIDIA_", "VLLM_", "OMP_")
#: The console's own settings (console/settings.py) whose names a prefix above would let through. They are not
#: vLLM's: vLLM 0.32 warns of every VLLM_* name it does not know, and refuses to start on one under
#: --fail-on-environ-validation (vllm/platforms/interface.py ``validate_environ``).
CONSOLE_SETTINGS_NOT_INHERITED = frozenset({"VLLM_CPU_KVCACHE_GIB", "VLLM_ASCEND_VERSION"})
#: What the console adds to these keeps the host's entries (CANN's Python packages on PYTHONPATH).
SEARCH_PATHS = frozenset({"PYTHONPATH"})
#: Allow-lists a host may set, comma-separated: vLLM loads every plugin it finds while VLLM_PLUGINS is unset
#: and only those named once it is set, an empty value naming none (vLLM 0.32: vllm/envs.py:1172-1176,
#: vllm/plugins/__init__.py:40-65 ``load_plugins_by_group``). What the console adds joins a host's list, and is
#: left out where the host has none, so that it never narrows what the host lets load.
ALLOW_LISTS = frozenset({"VLLM_PLUGINS"})


def child_environment(added: Mapping[str, str], *, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a child process: the allow-listed part of `base` (this process's
    environment by default) with `added` laid over it, except a search path (:data:`SEARCH_PATHS`), which
    goes before the inherited one instead of replacing it, and an allow-list (:data:`ALLOW_LISTS`), which
    joins the inherited one and is dropped where nothing is inherited."""
    base = os.environ if base is None else base
    env = {
        k: v
        for k, v in base.items()
        if (k in INHERITED_ENV or k.startswith(INHERITED_ENV_PREFIXES)) and k not in CONSOLE_SETTINGS_NOT_INHERITED
    }
    for key, value in added.items():
        if key in ALLOW_LISTS:
            if key in env:
                env[key] = f"{env[key]},{value}" if env[key] else value
        else:
            env[key] = f"{value}{os.pathsep}{env[key]}" if key in SEARCH_PATHS and env.get(key) else value
    return env
