"""The compiled dispatch plan (runtime/core/dispatch_plan.py) against its numpy reference, the engine's code until
session 8: the same counts, order, inverse, expert ids and packed device inputs, for any routing."""
from __future__ import annotations

from typing import Optional

import numpy as np
import pytest
import torch

from runtime.core.dispatch_plan import (DispatchPlan, _weights32, pack_weights, plan_dispatch,
                                        unpack_group_inputs)


def pack_group_inputs(row_of_pos: Optional[np.ndarray], inv: Optional[np.ndarray], weights) -> np.ndarray:
    """A merge group's device inputs in numpy: [row_of_pos = order // k, inv] when there is an order, then the
    weights as pack_weights packs them (the layout plan_dispatch's `packed` must have)."""
    if row_of_pos is None:
        return pack_weights(weights)
    return np.concatenate([row_of_pos, inv.reshape(-1), pack_weights(weights)])


def plan_from_order(order: Optional[np.ndarray], weights) -> DispatchPlan:
    """A plan for a given dispatch order (None: identity), in numpy: how tests hand the merge an arbitrary order.
    No counts (empty) and no expert ids (zeros): the merge reads neither."""
    w = _weights32(weights)
    R, k = w.shape
    n = R * k
    inv = None
    if order is not None:
        order = np.asarray(order, dtype=np.int64)
        inv = np.empty(n, dtype=np.int64)
        inv[order] = np.arange(n, dtype=np.int64)
        inv = inv.reshape(R, k)
    packed = pack_group_inputs(None if order is None else order // k, inv, w)
    return DispatchPlan(np.zeros(0, dtype=np.int64), order, inv, np.zeros(n, dtype=np.int64), packed)


def plan_reference(ids: np.ndarray, weights, owner: np.ndarray, world: int) -> DispatchPlan:
    """`plan_dispatch` in numpy calls (what the engine ran before the compiled version): the reference the tests
    compare with."""
    flat = np.asarray(ids, dtype=np.int64).reshape(-1)
    counts = np.bincount(owner[flat], minlength=world)
    order = np.argsort(owner[flat], kind="stable") if np.count_nonzero(counts) > 1 else None
    plan = plan_from_order(order, weights)
    plan.counts, plan.experts = counts, flat if order is None else flat[order]
    return plan


def _owner(E: int, world: int, rng) -> np.ndarray:
    return rng.integers(0, world, size=E).astype(np.int64)


@pytest.mark.parametrize("R,k,E,world", [(1, 1, 4, 1), (7, 4, 32, 2), (192, 4, 32, 2), (33, 3, 8, 8), (5, 2, 128, 4),
                                         (64, 8, 128, 3)])
def test_plan_equals_the_numpy_reference(R, k, E, world):
    rng = np.random.default_rng(R * 1000 + k * 10 + world)
    for trial in range(5):
        owner = _owner(E, world, rng) if trial else np.zeros(E, dtype=np.int64)  # trial 0: one destination
        ids = rng.integers(0, E, size=(R, k)).astype(np.int64)
        w = rng.random((R, k), dtype=np.float32)
        got, ref = plan_dispatch(ids, w, owner, world), plan_reference(ids, w, owner, world)
        assert np.array_equal(got.counts, ref.counts) and np.array_equal(got.experts, ref.experts)
        assert (got.order is None) == (ref.order is None)
        if ref.order is not None:
            assert np.array_equal(got.order, ref.order) and np.array_equal(got.inv, ref.inv)
            assert np.array_equal(got.row_of_pos, ref.order // k)
        assert np.array_equal(got.packed, ref.packed)  # bit for bit, the weights' padding half included
        gather, row_index, weights = unpack_group_inputs(torch.from_numpy(got.packed), R, k, got.order is not None)
        assert torch.equal(weights, torch.from_numpy(w))


def test_plan_takes_the_weights_as_a_tensor_and_ids_of_another_width():
    rng = np.random.default_rng(1)
    owner = np.array([0, 1, 1, 0], dtype=np.int64)
    ids = rng.integers(0, 4, size=(6, 2)).astype(np.int32)
    w = torch.rand(6, 2, dtype=torch.float64)
    got, ref = plan_dispatch(ids, w, owner, 2), plan_reference(ids, w, owner, 2)
    assert np.array_equal(got.packed, ref.packed) and np.array_equal(got.experts, ref.experts)


@pytest.mark.parametrize("bad", [-1, 4])
def test_plan_names_an_expert_without_owner(bad):
    ids = np.array([[0, 1], [2, bad]], dtype=np.int64)
    with pytest.raises(ValueError, match=rf"row 1 slot 1: expert id {bad} has no owner rank \(valid ids 0..3"):
        plan_dispatch(ids, np.ones((2, 2), dtype=np.float32), np.array([0, 1, 1, 0], dtype=np.int64), 2)
