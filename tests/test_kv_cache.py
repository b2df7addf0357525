"""Block allocator and paged KV store: pages lowest-first, no leaks, same reads as the dense store."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from lab.reference import DenseKVStore
from runtime.core.kv_cache import BlockAllocator, PagedKVStore


def test_allocator_lowest_first_and_reuse():
    a = BlockAllocator(8, 4)
    assert a.allocate(3) == [0, 1, 2]
    assert a.allocate(2) == [3, 4]
    a.free([1, 0])
    assert a.allocate(3) == [0, 1, 5]
    assert a.free_blocks == 8 - 6


def test_allocator_refuses_without_side_effects():
    a = BlockAllocator(4, 16)
    assert a.allocate(5) is None and a.free_blocks == 4
    got = a.allocate(4)
    assert a.allocate(1) is None
    a.free(got)
    assert a.free_blocks == 4 and a.used_blocks == 0


def test_double_free_is_an_error():
    a = BlockAllocator(4, 16)
    b = a.allocate(1)
    a.free(b)
    with pytest.raises(ValueError, match="freed twice"):
        a.free(b)


def test_million_page_plan_costs_nothing_up_front():
    a = BlockAllocator(1_000_000, 16)
    assert a.free_blocks == 1_000_000 and a.allocate(2) == [0, 1]


@given(st.lists(st.tuples(st.booleans(), st.integers(0, 6)), max_size=60))
@settings(max_examples=60, deadline=None)
def test_allocator_never_leaks(ops):
    a = BlockAllocator(16, 4)
    held: list[list[int]] = []
    for alloc, n in ops:
        if alloc or not held:
            got = a.allocate(n)
            if got is not None:
                held.append(got)
        else:
            a.free(held.pop(n % len(held)))
        in_use = [b for h in held for b in h]
        assert len(in_use) == len(set(in_use)) == a.used_blocks
        assert a.free_blocks + a.used_blocks == 16
    for h in held:
        a.free(h)
    assert a.used_blocks == 0 and a.free_blocks == 16


def test_paged_store_reads_what_the_dense_store_reads():
    torch.manual_seed(0)
    paged = PagedKVStore(2, BlockAllocator(64, 4))
    dense = DenseKVStore()
    for seq, total in ((7, 13), (9, 5), (11, 31)):
        assert paged.reserve(seq, total)
    # interleaved writes of segments of different sequences and layers, as batches would do them
    writes = [(0, 7, 0, 5), (0, 9, 0, 5), (1, 7, 0, 5), (0, 11, 0, 16), (0, 7, 5, 8), (1, 11, 0, 16),
              (1, 9, 0, 5), (0, 11, 16, 15), (1, 7, 5, 8), (1, 11, 16, 15)]
    for layer, seq, start, n in writes:
        pos = torch.arange(start, start + n)
        k, v = torch.randn(n, 2, 3), torch.randn(n, 2, 5)
        paged.write(layer, seq, pos, k, v)
        dense.write(layer, seq, pos, k, v)
        for length in (1, start + n):
            pk, pv = paged.read(layer, seq, length)
            dk, dv = dense.read(layer, seq, length)
            assert torch.equal(pk, dk) and torch.equal(pv, dv)


def test_reservation_bounds_positions_and_release_frees_pages():
    store = PagedKVStore(1, BlockAllocator(4, 4))
    assert store.reserve(1, 9)  # 3 pages
    assert not store.reserve(2, 5)  # needs 2, only 1 left: refused, nothing taken
    assert store.allocator.free_blocks == 1
    with pytest.raises(IndexError, match="reserved"):
        store.write(0, 1, torch.tensor([12]), torch.zeros(1, 1, 1), torch.zeros(1, 1, 1))
    store.release(1)
    assert store.allocator.free_blocks == 4 and store.sequences == 0
