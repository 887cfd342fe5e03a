"""Confine model paths to the configured MODEL_ROOTS, with one clear message per failure.

Registration checks a path once (validate_model_path); a link planted below it later (sub/etc -> /etc, a
tokenizer.json swapped for a link to a secret) must not be followed out either, so every walk, read and
copy of model or artifact files at job or page time goes through the helpers below: confine, tree_files,
open_confined, copy_confined, artifact_store_dir. A link that stays inside the roots is followed (Hugging
Face caches link snapshots to blobs); one that leads out raises PathRefused naming the path."""

import os
import shutil
import stat
from pathlib import Path
from typing import BinaryIO

from django.conf import settings
from django.core.exceptions import ValidationError

PATH_MAX = 4096  # Linux's limit for a whole path
_COPY_CHUNK = 8 * 1024 * 1024


class PathRefused(ValueError):
    """A model or artifact file the console will not read or write through; ``str()`` names the path."""


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
                        "allowed model roots.",
                        code="symlink_escape",
                    )
                if not os.access(target, os.R_OK):
                    raise ValidationError(
                        f"{entry} is not readable by the console (permission denied).", code="unreadable"
                    )
    return resolved


# --- confinement at job and page time --------------------------------------------------------------


def _configured() -> list:
    if not settings.configured:
        return []
    return [r for r in (*getattr(settings, "MODEL_ROOTS", []), getattr(settings, "ARTIFACT_STORE", None)) if r]


def configured_roots() -> list[Path]:
    """Where models may live: MODEL_ROOTS and the artifact store, as real paths (none without settings,
    e.g. a reader used outside Django)."""
    return [Path(os.path.realpath(r)) for r in _configured()]


def _within(tree) -> list[Path]:
    """The configured roots, plus the real location of the tree being read when that tree is named outside
    them: a directory inspected outside the roots (a CLI check, a test) may still link inside itself, never out
    of it. A tree named inside the roots (every registered model and artifact) gets the roots alone, so a
    folder swapped for a link out after its check is refused, not let in as the tree's own location."""
    roots = configured_roots()
    if tree is None:
        return roots
    named = Path(os.path.abspath(tree))
    if _inside(named, [*roots, *(Path(os.path.abspath(r)) for r in _configured())]):
        return roots
    real = Path(os.path.realpath(tree))
    return roots if _inside(real, roots) else [*roots, real]


def _refuse_outside(path: Path, real: str, within: list[Path]) -> None:
    if not _inside(Path(real), within):
        shown = ", ".join(str(r) for r in within)
        raise PathRefused(f"{path} leads outside the allowed model roots ({shown}) to {real}: refused.")


def confine(path) -> Path:
    """The real location of path if it lies inside the configured roots, else PathRefused."""
    path = Path(path)
    real = os.path.realpath(path)
    _refuse_outside(path, real, configured_roots())
    return Path(real)


def gguf_files_in(folder) -> list[Path]:
    """The .gguf files directly in a folder without config.json, as the registry reads such a folder: one of them
    is that GGUF (inspection.inspect_path, the conversions), more than one is ambiguous. Confined like every walk."""
    folder = Path(folder)
    return [p for p in tree_files(folder) if p.parent == folder and p.suffix.lower() == ".gguf"]


def tree_files(root, *, hidden: bool = True) -> list[Path]:
    """Every regular file under root (root itself when it is a file), sorted, named as under root.

    Walks without following links blindly: each link's target is checked first (PathRefused when it leads
    out), links to folders inside are walked once (a loop ends), broken links are skipped. ``hidden=False``
    leaves out names starting with '.' and what is below them."""
    root = Path(root)
    within = _within(root)
    _refuse_outside(root, os.path.realpath(root), within)  # the tree itself, or a folder above it, swapped for a link
    if not root.is_dir():
        return [root] if root.is_file() else []
    files, seen, folders = [], set(), [root]
    while folders:
        folder = folders.pop()
        real = os.path.realpath(folder)
        if real in seen:
            continue
        seen.add(real)
        with os.scandir(folder) as entries:
            for entry in entries:
                if not hidden and entry.name.startswith("."):
                    continue
                path = Path(entry.path)
                if entry.is_symlink():
                    target = os.path.realpath(path)
                    _refuse_outside(path, target, within)
                    if os.path.isdir(target):
                        folders.append(path)
                    elif os.path.isfile(target):
                        files.append(path)
                elif entry.is_dir(follow_symlinks=False):
                    folders.append(path)
                elif entry.is_file(follow_symlinks=False):
                    files.append(path)
    return sorted(files)


def tree_size(root) -> int:
    return sum(p.stat().st_size for p in tree_files(root))


def check_tree(path) -> Path:
    """Before a library (transformers, safetensors, vLLM) reads a model on its own: the model lies inside
    the configured roots and no link below it leads out. Returns its real path."""
    real = confine(path)
    tree_files(path)
    return real


def open_confined(path, *, tree=None) -> BinaryIO:
    """open(path, "rb"), refused unless the file actually opened is a regular file inside the configured
    roots (or inside ``tree``). The opened file's path is read back from /proc/self/fd, so a file swapped
    for a link between a check and the open is caught too; O_NONBLOCK keeps a planted FIFO from hanging."""
    path = Path(path)
    within = _within(tree)
    _refuse_outside(path, os.path.realpath(path), within)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise PathRefused(f"{path} is not a regular file: refused.")
        proc = f"/proc/self/fd/{fd}"
        _refuse_outside(path, os.readlink(proc) if os.path.exists(proc) else os.path.realpath(path), within)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_confined(path, *, tree=None) -> bytes:
    with open_confined(path, tree=tree) as handle:
        return handle.read()


def copy_confined(src, dst, *, tree=None) -> None:
    """Copy one file (contents, mode and times, like shutil.copy2) read through open_confined; the
    destination is never written through a link (O_NOFOLLOW)."""
    with open_confined(src, tree=tree) as source:
        info = os.fstat(source.fileno())
        fd = os.open(
            dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, stat.S_IMODE(info.st_mode)
        )
        with os.fdopen(fd, "wb") as target:
            shutil.copyfileobj(source, target, _COPY_CHUNK)
    os.utime(dst, ns=(info.st_atime_ns, info.st_mtime_ns), follow_symlinks=False)


def remove_unfinished_output(path) -> bool:
    """Remove a job's output folder that never became ready (committed, then the job was cancelled or died):
    only a real folder inside the artifact store, never through a link. True if it was removed."""
    path = Path(path)
    store = Path(os.path.realpath(settings.ARTIFACT_STORE))
    if path.is_symlink() or not path.is_dir() or not _inside(Path(os.path.realpath(path)), [store]) or path == store:
        return False
    shutil.rmtree(path)
    return True


def artifact_store_dir(*parts: str) -> Path:
    """ARTIFACT_STORE/parts, created, as a real path; PathRefused when a link in it leads out of the store
    (nothing is then written through it)."""
    store = Path(os.path.realpath(settings.ARTIFACT_STORE))
    path = store.joinpath(*parts)
    path.mkdir(parents=True, exist_ok=True)
    real = os.path.realpath(path)
    if not _inside(Path(real), [store]):
        raise PathRefused(f"{path} leads outside the artifact store ({store}) to {real}: nothing is written there.")
    return Path(real)
