"""What the npu-smi tests share: the captured outputs in tests/fixtures/npu-smi and the fake npu-smi."""

from tests.support import FAKE_NPU_SMI as FAKE_DIR  # noqa: F401 (the npu-smi tests import it from here)
from tests.support import ROOT

FIXTURES = ROOT / "tests" / "fixtures" / "npu-smi"


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text(encoding="utf-8")
