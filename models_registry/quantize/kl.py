"""KL-divergence (entropy) calibration of a symmetric int8 activation scale.

Neither library offers it for our targets: llm-compressor's observers are min-max, MSE and
memoryless min-max, and msModelSlim's act_method is 1 (min-max), 2 (histogram) or 3 (automatic).
So this observer is ours (the TensorRT "entropy calibration" recipe): a 2048-bin histogram of |x|,
and for every candidate clipping threshold the bins beyond it are folded into the last kept bin
(P), P is merged into 128 quantisation levels and spread back (Q), and the threshold whose
KL(P‖Q) is smallest wins.  Its range is then fed to the library: plugged into msModelSlim's
calibrator as its activation observer (msmodelslim_run.py), or set as llm-compressor's input_scale.
"""

from __future__ import annotations

import numpy as np

BINS = 2048
LEVELS = 128  # |x| side of a symmetric int8 grid


class KLObserver:
    """Accumulates a histogram of |x| over batches; the range grows by re-binning."""

    def __init__(self, bins: int = BINS, levels: int = LEVELS):
        self.bins = bins
        self.levels = levels
        self.hist = np.zeros(bins, dtype=np.float64)
        self.max = 0.0
        self.nonfinite = 0

    def observe(self, x) -> None:
        a = np.abs(np.asarray(x, dtype=np.float64).ravel())
        finite = np.isfinite(a)
        self.nonfinite += int((~finite).sum())
        a = a[finite]
        if a.size == 0:
            return
        new_max = float(a.max())
        if new_max > self.max:
            if self.max > 0 and self.hist.sum() > 0:  # re-bin what we have onto the wider range
                old_edges = np.linspace(0, self.max, self.bins + 1)
                centres = (old_edges[:-1] + old_edges[1:]) / 2
                self.hist = np.histogram(centres, bins=self.bins, range=(0, new_max), weights=self.hist)[0]
            self.max = new_max
        if self.max == 0:
            self.hist[0] += a.size
            return
        self.hist += np.histogram(a, bins=self.bins, range=(0, self.max))[0]

    def threshold(self) -> float:
        if self.max == 0:
            return 0.0
        index = kl_threshold_bin(self.hist, self.levels)
        return (index + 0.5) * self.max / self.bins if index < self.bins else self.max

    def scale(self, qmax: int = 127) -> float:
        t = self.threshold()
        return t / qmax if t > 0 else 1.0 / qmax


def _kl(p: np.ndarray, q: np.ndarray) -> float:
    p = p / p.sum()
    q = q / q.sum()
    mask = p > 0
    if np.any(q[mask] == 0):
        return float("inf")
    return float(np.sum(p[mask] * np.log(p[mask] / q[mask])))


def quantized_distribution(hist: np.ndarray, i: int, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """(P, Q) for clipping at bin i (i >= levels): P = hist[:i] with the tail folded into bin i-1;
    Q = hist[:i] merged into `levels` chunks [floor(j·i/levels), floor((j+1)·i/levels)), each
    chunk's mass spread evenly over its non-empty bins (empty bins stay empty)."""
    h = hist[:i].astype(np.float64)
    p = h.copy()
    p[i - 1] += hist[i:].sum()
    bounds = (np.arange(levels + 1) * i) // levels
    nonzero = (h != 0).astype(np.float64)
    sums = np.add.reduceat(h, bounds[:-1])
    counts = np.add.reduceat(nonzero, bounds[:-1])
    per_bin = np.divide(sums, counts, out=np.zeros_like(sums), where=counts > 0)
    q = np.repeat(per_bin, np.diff(bounds)) * nonzero
    return p, q


def kl_threshold_bin(hist: np.ndarray, levels: int = LEVELS) -> int:
    """The number of bins to keep (levels..len(hist)) that minimises KL(P‖Q)."""
    hist = np.asarray(hist, dtype=np.float64)
    n = len(hist)
    if n <= levels:
        return n
    best_i, best = n, float("inf")
    for i in range(levels, n + 1):
        p, q = quantized_distribution(hist, i, levels)
        if p.sum() == 0 or q.sum() == 0:
            continue
        kl = _kl(p, q)
        if kl < best:
            best, best_i = kl, i
    return best_i
