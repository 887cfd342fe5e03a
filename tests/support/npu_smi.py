"""What the npu-smi tests share: the captured outputs in tests/fixtures/npu-smi and the fake npu-smi."""

import json
import os
import re
from pathlib import Path

from tests.support import FAKE_NPU_SMI as FAKE_DIR
from tests.support import ROOT

FIXTURES = ROOT / "tests" / "fixtures" / "npu-smi"


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text(encoding="utf-8")


def with_health(text: str, npu: int, health: str) -> str:
    """The sample with NPU `npu`'s Health cell changed, the table's widths kept."""

    def change(match):
        return match.group(1) + health.ljust(len(match.group(2)))

    pattern = re.compile(rf"^(\| {npu}\s+910B4\s+\| )(OK\s+)(?=\|)", re.MULTILINE)
    changed, count = pattern.subn(change, text)
    assert count == 1
    return changed


class FakeNpuSmi:
    """The fake npu-smi linked into a directory of its own (`bin_dir`, to put first on PATH) and set up by
    `fake-npu-smi.json` beside the link: the console gives npu-smi an allow-listed environment, so no
    variable of the test's reaches it (tests/fake_npu_smi/npu-smi reads the file)."""

    KEYS = frozenset({"dir", "default", "map", "hang", "calls"})

    def __init__(self, bin_dir: Path, **settings):
        bin_dir.mkdir(parents=True, exist_ok=True)
        (bin_dir / "npu-smi").symlink_to(FAKE_DIR / "npu-smi")
        self.bin_dir = bin_dir
        self.settings: dict = {}
        self.set(**settings)

    def set(self, **changes) -> None:
        """Change what npu-smi answers from now on (a None value goes back to the stand-in's default)."""
        unknown = set(changes) - self.KEYS
        assert not unknown, f"the fake npu-smi has no setting {sorted(unknown)}"
        self.settings.update({key: str(value) for key, value in changes.items() if value is not None})
        for key in [key for key, value in changes.items() if value is None]:
            self.settings.pop(key, None)
        staged = self.bin_dir / "fake-npu-smi.json.tmp"
        staged.write_text(json.dumps(self.settings), encoding="utf-8")
        os.replace(staged, self.bin_dir / "fake-npu-smi.json")

    def path_first(self, path: str | None = None) -> str:
        """PATH with this stand-in first (`path`: this process's PATH by default)."""
        return f"{self.bin_dir}{os.pathsep}{os.environ.get('PATH', '') if path is None else path}"
