"""ZipfRouting hashes the keys of a batch of a few tokens in Python ints (lab/routing_override.py `_small_keys`, the
simulator's one-row batches) and of larger ones in numpy passes: both give the same experts and weights, bit for bit,
with and without drift, with explicit steps, and for seeds and positions that use all 64 bits."""
from __future__ import annotations

import numpy as np
import pytest

import lab.routing_override as ro
from lab.routing_override import ZipfRouting, _splitmix64, _splitmix64_inplace


def test_scalar_splitmix_equals_the_array_one():
    rng = np.random.default_rng(0)
    z = np.concatenate([rng.integers(0, 2 ** 63, 64, dtype=np.uint64) * np.uint64(2) + np.uint64(1),
                        np.array([0, 2 ** 64 - 1, 2 ** 63], dtype=np.uint64)])
    want = _splitmix64_inplace(z.copy())
    assert [_splitmix64(int(v)) for v in z.tolist()] == want.tolist()


@pytest.mark.parametrize("drift_every, seed", [(0, 0), (0, 2 ** 64 - 5), (7, 3), (300, 11)])
def test_small_batches_route_as_the_numpy_passes(monkeypatch, drift_every, seed):
    rng = np.random.default_rng(seed % 1000)
    for T in (1, 2, 5, ro._PY_TOKENS):
        reqs = [f"r{i}" for i in rng.integers(0, 40, T)]
        pos = rng.integers(0, 1 << 40, T).tolist()
        steps = rng.integers(0, 5000, T).tolist()
        small = ZipfRouting(128, 4, s=1.1, drift_every=drift_every, drift_stride=3, seed=seed)
        numpy_passes = ZipfRouting(128, 4, s=1.1, drift_every=drift_every, drift_stride=3, seed=seed)
        for layer in (0, 35):
            for st in (None, steps):
                ids, w = small(layer, None, reqs, pos, st)
                with monkeypatch.context() as m:
                    m.setattr(ro, "_PY_TOKENS", 0)
                    ids_ref, w_ref = numpy_passes(layer, None, reqs, pos, st)
                assert ids.tolist() == ids_ref.tolist()
                assert w.numpy().view(np.int32).tolist() == w_ref.numpy().view(np.int32).tolist()
