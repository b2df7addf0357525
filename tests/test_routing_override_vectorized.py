"""ZipfRouting's batch-vectorised path: per-key determinism, distinct experts, Zipf skew, old choices.

The router runs once per attention batch on every system's hot path, so it is numpy passes over the
whole [T, E] batch. These tests pin what the rewrite must keep: a token's routing is a function of
(seed, request, position, layer) only, its k experts are distinct, draws follow the Zipf popularity
(exact Plackett-Luce inclusion probabilities, not just "the hot one is hot"), and the choices are the
ones the per-row formula made before the rewrite (golden values and a scalar reference).
"""
from __future__ import annotations

import hashlib
import itertools

import numpy as np
import pytest
import torch

from lab.routing_override import RoutingRecorder, RoutingTrace, ZipfRouting

M64 = (1 << 64) - 1


def _sm(z: int) -> int:
    """SplitMix64 finalizer on a Python int (the reference for the vectorised one)."""
    z = (z + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def _reference(z: ZipfRouting, layer: int, req, pos: int, step: int):
    """One token, scalar: the routing formula as documented, independent of the batched code."""
    key = int.from_bytes(hashlib.blake2b(repr(req).encode(), digest_size=8).digest(), "little")
    base = _sm(_sm(_sm(key ^ (z.seed & M64)) ^ (pos & M64)) ^ layer)
    h = np.array([_sm(base ^ e) >> 11 for e in range(z.num_experts)], dtype=np.float64)
    u = (h + 0.5) / float(1 << 53)
    logp = np.log(z.popularity(layer, step))                  # differs from the table by a constant
    logp_table = z._log_popularity(layer, np.array([step]))[0]
    assert np.allclose(logp - logp.max(), logp_table - logp_table.max())
    score = logp_table - np.log(-np.log(u))
    idx = np.argsort(-score, kind="stable")[: z.top_k]
    w = np.exp(score[idx] - score[idx].max())
    return idx, (w / w.sum()).astype(np.float32)


def _batch(n: int, rng: np.random.Generator):
    reqs = [f"req-{i}" if i % 2 else int(i) for i in rng.integers(0, 40, n)]   # str and int request ids
    return reqs, [int(p) for p in rng.integers(0, 3000, n)]


@pytest.mark.parametrize("drift_every", [0, 50])
@pytest.mark.parametrize("E,k", [(32, 4), (128, 4), (8, 8)])
def test_same_key_same_route_alone_or_in_a_batch_of_300(E, k, drift_every):
    rng = np.random.default_rng(E * 100 + k + drift_every)
    reqs, pos = _batch(300, rng)
    z = ZipfRouting(E, k, s=1.2, drift_every=drift_every, drift_stride=3, seed=4)
    ids, w = z(7, None, reqs, pos)
    assert ids.shape == w.shape == (300, k) and ids.dtype == torch.int64 and w.dtype == torch.float32
    assert ids.is_contiguous() and w.is_contiguous()
    fresh = ZipfRouting(E, k, s=1.2, drift_every=drift_every, drift_stride=3, seed=4)   # empty caches
    for i in range(300):
        for router in (z, fresh):
            one_ids, one_w = router(7, None, [reqs[i]], [pos[i]])
            assert torch.equal(one_ids[0], ids[i]) and torch.equal(one_w[0], w[i]), i
    # Any order, any sub-batch, and a batch mixed with other layers' calls in between: same rows.
    perm = rng.permutation(300)
    z(3, None, reqs[:17], pos[:17])
    p_ids, p_w = z(7, None, [reqs[j] for j in perm], [pos[j] for j in perm])
    assert torch.equal(p_ids, ids[perm]) and torch.equal(p_w, w[perm])
    # Each coordinate of the key matters.
    other = [ZipfRouting(E, k, s=1.2, drift_every=drift_every, drift_stride=3, seed=5)(7, None, reqs, pos)[0],
             z(8, None, reqs, pos)[0], z(7, None, reqs, [p + 1 for p in pos])[0],
             z(7, None, [f"x{r}" for r in reqs], pos)[0]]
    for o in other:
        assert (o != ids).any(dim=1).float().mean() > 0.3


def test_matches_the_scalar_formula_and_the_choices_made_before_vectorising():
    rng = np.random.default_rng(0)
    for E, k, drift in [(32, 4, 64), (16, 3, 0), (8, 8, 5)]:
        z = ZipfRouting(E, k, s=1.1, drift_every=drift, drift_stride=2, seed=9)
        reqs, pos = _batch(60, rng)
        steps = [int(s) for s in rng.integers(0, 400, 60)]
        for use_steps in (False, True):
            ids, w = z(2, None, reqs, pos, steps if use_steps else None)
            for i in range(60):
                r_ids, r_w = _reference(z, 2, reqs[i], pos[i], steps[i] if use_steps else pos[i])
                assert ids[i].tolist() == r_ids.tolist()
                assert np.allclose(w[i].numpy(), r_w, rtol=1e-6, atol=0)
    # Golden values from the implementation before vectorising (HEAD 63b834e): benchmark routing
    # stays what earlier runs and recorded traces saw.
    z = ZipfRouting(32, 4, s=1.2, drift_every=64, seed=0)
    ids, w = z(5, None, ["r0", 7, "req-3", 7], [0, 100, 4095, 101])
    assert ids.tolist() == [[4, 23, 5, 6], [9, 0, 25, 4], [10, 29, 11, 19], [17, 25, 23, 13]]
    assert np.allclose(w.numpy(), [[0.40012684, 0.25878677, 0.20564377, 0.13544260],
                                   [0.51807147, 0.21011053, 0.16057341, 0.11124462],
                                   [0.39853999, 0.35599110, 0.21025737, 0.03521152],
                                   [0.55903399, 0.16296628, 0.15048596, 0.12751380]], rtol=1e-5)
    assert ZipfRouting(128, 4, s=1.0, seed=11)(0, None, [0, 1], [5, 5])[0].tolist() == [[42, 14, 49, 12],
                                                                                     [100, 63, 12, 60]]


@pytest.mark.parametrize("E,k", [(32, 4), (128, 8), (8, 8), (5, 1)])
def test_experts_are_distinct_and_weights_a_descending_softmax(E, k):
    rng = np.random.default_rng(E + k)
    reqs, pos = _batch(2000, rng)
    for s in (0.0, 1.2, 4.0):                     # s=4: one expert takes almost every first draw
        ids, w = ZipfRouting(E, k, s=s, drift_every=300, seed=1)(0, None, reqs, pos)
        a = ids.numpy()
        assert a.min() >= 0 and a.max() < E
        srt = np.sort(a, axis=1)
        assert (np.diff(srt, axis=1) > 0).all()                       # k distinct experts per token
        assert torch.allclose(w.sum(1), torch.ones(2000)) and (w > 0).all()
        assert (w[:, :-1] >= w[:, 1:]).all()                          # best-scored expert first


def _inclusion(p: np.ndarray, k: int) -> np.ndarray:
    """P(expert e is among k draws without replacement, each draw proportional to p): exact."""
    incl = np.zeros(len(p))
    for tup in itertools.permutations(range(len(p)), k):
        pr, left = 1.0, 1.0
        for e in tup:
            pr *= p[e] / left
            left -= p[e]
        incl[list(tup)] += pr
    return incl


def test_draws_follow_the_zipf_skew_and_its_drift():
    E, k, N = 12, 3, 30000
    z = ZipfRouting(E, k, s=1.2, drift_every=1000, drift_stride=5, seed=2)
    rng = np.random.default_rng(3)
    reqs = [f"q{i}" for i in range(N)]
    for step0 in (0, 1000):                       # two drift periods: the hot expert moves
        pos = [int(p) for p in rng.integers(step0, step0 + 1000, N)]
        ids, _ = z(4, None, reqs, pos)
        p = z.popularity(4, step0)
        want = _inclusion(p, k)
        got = np.bincount(ids.numpy().ravel(), minlength=E) / N     # share of tokens that picked e
        assert abs(want.sum() - k) < 1e-9
        assert np.abs(got - want).max() < 0.015, (step0, got.round(3), want.round(3))
        hot = int(p.argmax())
        assert abs(got[hot] / k - want[hot] / k) < 0.005              # the hot expert's share of draws
        assert want[hot] > 2.5 * k / E                                 # ... which is far from uniform
        first = np.bincount(ids[:, 0].numpy(), minlength=E) / N      # the first pick is a plain Zipf draw
        assert np.abs(first - p).max() < 0.015
        if step0 == 0:
            hot0 = hot
    assert hot != hot0


def test_record_then_replay_of_vectorised_routing(tmp_path):
    z = ZipfRouting(32, 4, s=1.2, drift_every=10, seed=3)
    rec = RoutingRecorder(z)
    rng = np.random.default_rng(5)
    reqs, pos = _batch(200, rng)
    for layer in range(3):
        rec(layer, None, reqs, pos)
    for suffix in (".jsonl", ".npz"):
        trace = RoutingTrace.load(rec.save(tmp_path / f"t{suffix}"))
        for layer in range(3):
            got, want = trace(layer, None, reqs[::-1], pos[::-1]), z(layer, None, reqs[::-1], pos[::-1])
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
