"""Where profiles keep their trace files, and the disk caps (PROFILE_MAX_BYTES per profile,
PROFILE_TOTAL_MAX_BYTES for all of them)."""
import shutil
from pathlib import Path

from django.conf import settings


def profiles_root() -> Path:
    return Path(settings.ENDPOINT_PROFILE_ROOT) / "profiles"


def profile_dir(profile_id: int) -> Path:
    return profiles_root() / str(int(profile_id))


def tree_bytes(path: Path) -> int:
    """Bytes of the regular files under path (links are not followed: they count as nothing)."""
    if not path.exists():
        return 0
    if path.is_file() and not path.is_symlink():
        return path.stat().st_size
    return sum(p.lstat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def used_bytes() -> int:
    """What every kept profile (and any staging left by a job that died) takes on disk."""
    return tree_bytes(profiles_root())


def remove_profile_files(profile_id: int) -> None:
    shutil.rmtree(profile_dir(profile_id), ignore_errors=True)
