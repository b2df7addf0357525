"""The defragmenting score of every stage, compiled with numba.

The score is a tight numeric loop run before every batch on every rank: for each runnable stage s,
Q(s) + sum_{j=1..W} delta^j (Q(s_j) + w_H H(s_j)) along the wrapping stage chain. In Python it costs
~40 us per decision for GPT-OSS-120B's 73-stage chain (measured), a fifth of
the paper's whole host budget for an expert batch; compiled it is a few microseconds. The loop does
the same floating-point operations in the same order as the formula, so scores are bit-identical to
the plain Python version the tests write out by hand.
"""
from __future__ import annotations

import functools

import numba
import numpy as np


@numba.njit(cache=True)
def defrag_scores(q: np.ndarray, ring: np.ndarray, filled: int, runnable: np.ndarray, next_of: np.ndarray,
                  delta: float, lookahead: int, history_weight: float, out: np.ndarray) -> None:
    """out[s] = the score of stage s (NaN where not runnable). `ring[:filled]` are the last queue-depth
    snapshots; H is their mean (0 before the first snapshot)."""
    n = q.shape[0]
    h = np.zeros(n)
    if filled > 0:
        for s in range(n):
            acc = 0.0
            for i in range(filled):
                acc += ring[i, s]
            h[s] = acc / filled
    for s in range(n):
        if not runnable[s]:
            out[s] = np.nan
            continue
        score = q[s]
        t = s
        w = 1.0
        for _ in range(lookahead):
            t = next_of[t]
            w *= delta
            score += w * (q[t] + history_weight * h[t])
        out[s] = score


@functools.cache  # once per process
def warm_up() -> None:
    """Load (or compile) the kernel now. numba does it at the first call, ~230 ms per process on the
    CPU machine; a policy calls this when it is built, so that cost lands before a run's clock
    starts instead of inside its first timed batch."""
    defrag_scores(np.zeros(1), np.zeros((1, 1)), 0, np.ones(1, dtype=np.bool_), np.zeros(1, dtype=np.int64),
                  0.5, 1, 1.0, np.empty(1))
