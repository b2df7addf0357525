"""ZipfRouting's per-batch [T, E] work compiled with numba: hashed Gumbel noise, top-k, softmax.

The synthetic router runs once per attention batch on every system's hot path. As numpy passes over
the batch (~20 array calls plus k argmax passes, each paying numpy's per-call overhead) it was 6-8% of a
streaming rank's loop on the H200 host (py-spy, benchmarks/NOTES.md §16, run 30); one compiled loop over
tokens and experts does the same arithmetic with no temporaries. Every operation is the one the numpy
version did, in the same order, so the draws are the same:
    h = sm(base[t] ^ e) >> 11,  u = (h + 0.5) / 2^53,  score = logp[row(t), e] - log(-log(u)),
top-k by k passes that take the first maximum (ties to the lower expert id) and mask it with -inf, and
weights = exp(chosen - chosen[0]) / their sum (sm = SplitMix64, wrapping mod 2^64).
"""
from __future__ import annotations

import numba
import numpy as np

_ADD, _MUL1, _MUL2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31, _S11 = np.uint64(30), np.uint64(27), np.uint64(31), np.uint64(11)


@numba.njit(cache=True)
def zipf_topk(base: np.ndarray, table: np.ndarray, rows: np.ndarray, k: int, ids: np.ndarray, w: np.ndarray) -> None:
    """ids[t], w[t] (int64 [T, k], float64 [T, k]) for token keys base[t] (uint64) with log-popularity
    row table[rows[t]] ([R, E] float64)."""
    T = base.shape[0]
    E = table.shape[1]
    score = np.empty(E)
    chosen = np.empty(k)
    inv53 = 1.0 / 9007199254740992.0  # 2^-53: exact
    for t in range(T):
        b = base[t]
        lp = table[rows[t]]
        for e in range(E):
            z = (b ^ np.uint64(e)) + _ADD
            z = (z ^ (z >> _S30)) * _MUL1
            z = (z ^ (z >> _S27)) * _MUL2
            z = z ^ (z >> _S31)
            u = (np.float64(z >> _S11) + 0.5) * inv53
            score[e] = lp[e] - np.log(-np.log(u))
        for j in range(k):
            best = 0
            for e in range(1, E):
                if score[e] > score[best]:
                    best = e
            ids[t, j] = best
            chosen[j] = score[best]
            score[best] = -np.inf
        total = 0.0
        for j in range(k):
            v = np.exp(chosen[j] - chosen[0])
            w[t, j] = v
            total += v
        for j in range(k):
            w[t, j] /= total


_warm = False


def warm_up() -> None:
    """Load (or compile) the kernel now rather than inside the first timed attention batch (numba does
    it at the first call: ~0.2 s from its on-disk cache, seconds when compiling). ZipfRouting calls it
    when it is built, before any run's clock starts."""
    global _warm
    if not _warm:
        zipf_topk(np.zeros(1, dtype=np.uint64), np.zeros((1, 1)), np.zeros(1, dtype=np.int64), 1,
                  np.empty((1, 1), dtype=np.int64), np.empty((1, 1)))
        _warm = True
