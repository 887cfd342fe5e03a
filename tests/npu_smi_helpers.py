"""What the npu-smi tests share: the captured outputs in tests/fixtures/npu-smi and the fake npu-smi."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "npu-smi"
FAKE_DIR = ROOT / "tests" / "fake_npu_smi"


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text(encoding="utf-8")
