"""Confine model paths to the configured MODEL_ROOTS, with one clear message per failure."""
import os
from pathlib import Path

from django.conf import settings
from django.core.exceptions import ValidationError


PATH_MAX = 4096  # Linux's limit for a whole path


def _inside(path: Path, roots) -> bool:
    return any(path == root or root in path.parents for root in roots)


def validate_model_path(raw: str) -> Path:
    """Return the resolved path if it may be registered, else raise ValidationError."""
    roots = [Path(r) for r in settings.MODEL_ROOTS]
    roots_text = ", ".join(str(r) for r in roots)
    raw = (raw or "").strip()
    if not raw:
        raise ValidationError("Enter the path of a model directory or GGUF file on the server.", code="required")
    if "\x00" in raw:
        raise ValidationError("The path contains a NUL character.", code="invalid")
    if len(raw) > PATH_MAX:
        raise ValidationError(f"The path is {len(raw)} characters long: at most {PATH_MAX}.", code="too_long")
    candidate = Path(raw).expanduser()
    if not candidate.is_absolute():
        raise ValidationError(f"Give an absolute path (inside {roots_text}).", code="relative")
    if ".." in candidate.parts:
        raise ValidationError("Paths containing '..' are not accepted: give the direct path.", code="traversal")
    lexical = Path(os.path.normpath(candidate))
    if not _inside(lexical, roots):
        raise ValidationError(f"{lexical} is outside the allowed model roots ({roots_text}).", code="outside_roots")
    if not lexical.exists() and not lexical.is_symlink():
        raise ValidationError(f"{lexical} does not exist.", code="missing")
    resolved = lexical.resolve()
    if not resolved.exists():
        raise ValidationError(f"{lexical} is a broken symbolic link.", code="missing")
    if not _inside(resolved, roots):
        raise ValidationError(
            f"{lexical} is a symbolic link that leads outside the allowed model roots (to {resolved}).",
            code="symlink_escape",
        )
    if not os.access(resolved, os.R_OK) or (resolved.is_dir() and not os.access(resolved, os.X_OK)):
        raise ValidationError(f"{resolved} is not readable by the console (permission denied).", code="unreadable")
    if resolved.is_dir():
        # A symbolic link anywhere below the model directory (sub/etc -> /etc) could still point anywhere:
        # walk the whole tree without following links, and check every link's target and every entry.
        for folder, dirs, files in os.walk(resolved, followlinks=False):
            for name in dirs + files:
                entry = Path(folder) / name
                target = entry.resolve()
                if not _inside(target, roots):
                    raise ValidationError(
                        f"{entry.relative_to(resolved)} in {resolved} is a symbolic link that leads outside the "
                        "allowed model roots.", code="symlink_escape")
                if not os.access(target, os.R_OK):
                    raise ValidationError(f"{entry} is not readable by the console (permission denied).",
                                          code="unreadable")
    return resolved
