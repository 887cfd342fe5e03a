"""Helpers shared by the tests (fixtures live in tests/conftest.py)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
FIXTURES = TESTS / "fixtures"
FAKE_NPU_SMI = TESTS / "fake_npu_smi"
