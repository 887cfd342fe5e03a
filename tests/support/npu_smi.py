"""What the npu-smi tests share: the captured outputs in tests/fixtures/npu-smi and the fake npu-smi."""
import re

from tests.support import FAKE_NPU_SMI as FAKE_DIR  # noqa: F401 (the npu-smi tests import it from here)
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
