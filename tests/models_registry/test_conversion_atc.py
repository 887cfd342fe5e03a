"""HF → ONNX → OM: ATC (the CANN toolkit's model compiler) run through a stand-in `atc` that records its calls
(no CANN toolkit can be installed here)."""

from __future__ import annotations

import json
import os
import stat
import sys
import textwrap
from pathlib import Path

import pytest

from models_registry.convert import (
    AtcNotFound,
    ConversionError,
    find_atc,
    run_atc,
)
from models_registry.convert import atc as conv_atc

# ------------------------------------------------------------------------------------------
# ATC
# ------------------------------------------------------------------------------------------

FAKE_ATC = textwrap.dedent("""\
    #!{python}
    # Test stand-in for the CANN toolkit's atc: records its argv and environment's names beside itself
    # (it gets an allow-listed environment, so the test talks to it through files), writes PREFIX.om.
    import json, os, sys, time
    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, "argv.json"), "w") as fh:
        json.dump(sys.argv, fh)
    with open(os.path.join(here, "env.json"), "w") as fh:
        json.dump(sorted(os.environ), fh)
    with open("fusion_result.json", "w") as fh:  # as the real one does, in its working directory
        fh.write("{{}}")
    mode_file = os.path.join(here, "mode")
    mode = open(mode_file).read().strip() if os.path.exists(mode_file) else "ok"
    if mode == "sleep":
        time.sleep(30)
    if mode == "fail":
        print("ATC start working now, please wait for a moment.")
        print("E19010: No parser is registered for Op [node_Foo, optype [ai.onnx::18::Foo]].")
        print("ATC run failed, Please check the detail log, Try 'atc --help' for more information")
        sys.exit(1)
    out = next(a.split("=", 1)[1] for a in sys.argv if a.startswith("--output="))
    with open(out + ".om", "wb") as fh:
        fh.write(b"fake om")
    print("ATC start working now, please wait for a moment.")
    print("ATC run success, welcome to the next use.")
""")


@pytest.fixture
def no_cann(monkeypatch, tmp_path):
    """No atc on PATH, in the environment, or in the toolkit's default places."""
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    for var in ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH", "ASCEND_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(conv_atc, "ATC_DEFAULT_PATHS", ())


@pytest.fixture
def fake_atc(no_cann, monkeypatch, tmp_path):
    bin_dir = tmp_path / "cann-bin"
    bin_dir.mkdir()
    atc = bin_dir / "atc"
    atc.write_text(FAKE_ATC.format(python=sys.executable))
    atc.chmod(atc.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    log = bin_dir / "argv.json"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return atc, log


@pytest.fixture
def onnx_file(tmp_path):
    path = tmp_path / "model.onnx"
    path.write_bytes(b"\x08\x07")  # atc is a stand-in: the content does not matter
    return path


def test_run_atc_without_cann(no_cann, onnx_file, tmp_path):
    assert find_atc() is None
    with pytest.raises(AtcNotFound) as info:
        run_atc(onnx_file, tmp_path / "om" / "model", soc_version="Ascend910B4")
    assert str(info.value) == "ATC not found on this node: install the CANN toolkit"
    assert isinstance(info.value, ConversionError)


def test_find_atc_in_toolkit_default_path(no_cann, monkeypatch, tmp_path):
    atc = tmp_path / "Ascend" / "ascend-toolkit" / "latest" / "bin" / "atc"
    atc.parent.mkdir(parents=True)
    atc.write_text("#!/bin/sh\n")
    atc.chmod(0o755)
    monkeypatch.setattr(conv_atc, "ATC_DEFAULT_PATHS", (str(tmp_path / "nowhere" / "atc"), str(atc)))
    assert find_atc() == str(atc)
    monkeypatch.setattr(conv_atc, "ATC_DEFAULT_PATHS", ())
    monkeypatch.setenv("ASCEND_TOOLKIT_HOME", str(atc.parent.parent))
    assert find_atc() == str(atc)


def test_run_atc_argv_is_exact(fake_atc, onnx_file, tmp_path, monkeypatch):
    atc, log = fake_atc
    monkeypatch.setenv("SECRET_KEY", "s3cret")
    monkeypatch.setenv("ASCEND_OPP_PATH", "/usr/local/Ascend/ascend-toolkit/latest/opp")
    prefix = tmp_path / "om" / "tiny_bs1"
    result = run_atc(
        onnx_file,
        prefix,
        soc_version="910B4",
        precision_mode="allow_mix_precision",
        input_shape="input_ids:1,16;attention_mask:1,16",
    )
    expected = [
        str(atc),
        "--framework=5",
        f"--model={onnx_file}",
        f"--output={prefix}",
        "--soc_version=Ascend910B4",
        "--precision_mode=allow_mix_precision",
        "--input_shape=input_ids:1,16;attention_mask:1,16",
    ]
    assert json.loads(log.read_text()) == expected
    child_env = json.loads(log.with_name("env.json").read_text())  # an allow-listed environment: CANN's, not ours
    assert "ASCEND_OPP_PATH" in child_env and "PATH" in child_env and "SECRET_KEY" not in child_env
    assert result["argv"] == expected
    assert result["om_path"] == str(prefix) + ".om"
    assert Path(result["om_path"]).read_bytes() == b"fake om"
    assert (prefix.parent / "fusion_result.json").exists()  # ATC's own files go beside its output (the staging)
    assert result["soc_version"] == "Ascend910B4" and result["precision_mode"] == "allow_mix_precision"
    assert "ATC run success" in result["log_tail"]

    # defaults: force_fp16, no --input_shape; a ".om" suffix on the prefix is dropped
    result = run_atc(onnx_file, tmp_path / "om" / "plain.om", soc_version="Ascend310P3")
    assert json.loads(log.read_text()) == [
        str(atc),
        "--framework=5",
        f"--model={onnx_file}",
        f"--output={tmp_path / 'om' / 'plain'}",
        "--soc_version=Ascend310P3",
        "--precision_mode=force_fp16",
    ]
    assert result["om_path"] == str(tmp_path / "om" / "plain.om")


def test_run_atc_failure_shows_atc_output(fake_atc, onnx_file, tmp_path):
    fake_atc[0].with_name("mode").write_text("fail")
    with pytest.raises(ConversionError, match="(?s)exit code 1.*E19010: No parser is registered"):
        run_atc(onnx_file, tmp_path / "om" / "x", soc_version="Ascend910B4")


def test_run_atc_timeout(fake_atc, onnx_file, tmp_path):
    fake_atc[0].with_name("mode").write_text("sleep")
    with pytest.raises(ConversionError, match="timed out after 1 s"):
        run_atc(onnx_file, tmp_path / "om" / "x", soc_version="Ascend910B4", timeout=1)


def test_run_atc_validates_options(fake_atc, onnx_file, tmp_path):
    atc, log = fake_atc
    for soc in ("Ascend999", "910B4; rm -rf /", ""):
        with pytest.raises(ConversionError, match="Invalid SoC version"):
            run_atc(onnx_file, tmp_path / "x", soc_version=soc)
    with pytest.raises(ConversionError, match="Invalid precision mode"):
        run_atc(onnx_file, tmp_path / "x", soc_version="Ascend910B4", precision_mode="fp8")
    with pytest.raises(ConversionError, match="Invalid input shape"):
        run_atc(onnx_file, tmp_path / "x", soc_version="Ascend910B4", input_shape="input_ids:1,16 --log=debug")
    with pytest.raises(ConversionError, match="does not exist"):
        run_atc(tmp_path / "missing.onnx", tmp_path / "x", soc_version="Ascend910B4")
    assert not log.exists()  # atc never ran
