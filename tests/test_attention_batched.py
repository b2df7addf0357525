"""Batched decode attention (PagedKVStore.write_rows/gather + attend_decode_batch) against the
per-segment path, which stays the reference: same outputs within 1e-5 relative (fp32) over families
with sliding windows, sinks, GQA and MLA, for batches of sequences of different lengths whose
contexts cross page boundaries."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from graph_ir.spec import load_spec
from lab.reference import PerSegmentKV
from models import attention as attn
from models.weights import random_weights
from runtime.core.kv_cache import BlockAllocator, PagedKVStore

SPECS = Path(__file__).resolve().parents[1] / "models" / "specs"
FAMILIES = ["tiny-gpt-oss", "tiny-deepseek-v2", "tiny-qwen3-moe", "tiny-mixtral"]
BLOCK = 4  # small pages: every batch crosses page boundaries


PerSegment = PerSegmentKV  # the per-segment reference path
def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _stores(num_layers: int, lengths: list[int], steps: int, rng: random.Random):
    """Two stores with identical page tables; pages of the batch's sequences are interleaved with
    other sequences' (some released) so tables are not contiguous and page 0 is someone else's."""
    stores = [PagedKVStore(num_layers, BlockAllocator(512, BLOCK)) for _ in range(2)]
    order = list(range(len(lengths)))
    rng.shuffle(order)
    for kv in stores:
        kv.reserve(1000, 3)
        for i in order:
            kv.reserve(i, lengths[i] + steps)
            kv.reserve(2000 + i, rng.choice([1, 5]) if i % 2 else 0)
        kv.release(1000)
    return stores


def _count_gathers(monkeypatch) -> list:
    """PagedKVStore.gather counted: one entry per batched gather (the batched path's mark)."""
    gathers = []
    real_gather = PagedKVStore.gather
    monkeypatch.setattr(PagedKVStore, "gather", lambda self, *a: gathers.append(1) or real_gather(self, *a))
    return gathers


def _prefill(spec, lw, layer: int, lengths: list[int], gen, kv_batched, kv_ref) -> None:
    """Every sequence's prompt at `layer` (multi-row segments: the per-segment path on both stores)."""
    x = torch.randn(sum(lengths), spec.hidden_size, generator=gen)
    pos = torch.cat([torch.arange(n) for n in lengths])
    segs, row = [], 0
    for i, n in enumerate(lengths):
        segs.append((i, row, n))
        row += n
    for kv in (kv_batched, PerSegment(kv_ref)):
        attn.attention(spec, lw, layer, x, pos, segs, kv)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_batched_decode_matches_per_segment(family, seed, monkeypatch):
    spec = load_spec(SPECS / f"{family}.yaml")
    w = random_weights(spec, seed=seed)
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    B = rng.choice([1, 3, 7, 12])
    # Context lengths: short ones, ones ending exactly at a page boundary, and ones longer than
    # the GPT-OSS window (8) so the sliding mask matters.
    lengths = [rng.choice([1, 2, BLOCK - 1, BLOCK, 2 * BLOCK, rng.randint(1, 40)]) for _ in range(B)]
    lengths[-1] = rng.randint(10, 40)
    steps = 3  # decode steps: the batched writes are read back by the next steps
    kv_batched, kv_ref = _stores(spec.num_layers, lengths, steps, rng)
    gathers = _count_gathers(monkeypatch)

    for layer in range(spec.num_layers):
        lw = w.layers[layer]
        _prefill(spec, lw, layer, lengths, gen, kv_batched, kv_ref)
        for s in range(steps):
            x = torch.randn(B, spec.hidden_size, generator=gen)
            pos = torch.tensor([n + s for n in lengths])
            segs = [(i, i, 1) for i in range(B)]
            n_gathers = len(gathers)
            got = attn.attention(spec, lw, layer, x, pos, segs, kv_batched)
            assert len(gathers) == n_gathers + 1, "the batched path was not taken"
            want = attn.attention(spec, lw, layer, x, pos, segs, PerSegment(kv_ref))
            assert _rel(got, want) <= 1e-5, (family, layer, s, _rel(got, want))
        # The batched writes landed where the per-segment ones did.
        for i, n in enumerate(lengths):
            for a, b in zip(kv_batched.read(layer, i, n + steps), kv_ref.read(layer, i, n + steps)):
                assert torch.equal(a, b)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("seed", [0, 1])
def test_mixed_batch_takes_its_decode_rows_batched_and_matches_per_segment(family, seed, monkeypatch):
    """A batch of decode rows beside a new prompt's chunk (a request arriving during decode): its one-row segments go
    through one batched write + gather + attention, the chunk through the per-segment path, in the batch's row order
    (the chunk sits between decode rows); outputs and written K/V equal the all-per-segment path's."""
    spec = load_spec(SPECS / f"{family}.yaml")
    w = random_weights(spec, seed=seed)
    rng = random.Random(10 + seed)
    gen = torch.Generator().manual_seed(seed)
    B = rng.choice([3, 6, 9])
    lengths = [rng.randint(1, 30) for _ in range(B)]
    chunk = rng.randint(2, 12)  # sequence B: a prompt's first chunk
    kv_batched, kv_ref = _stores(spec.num_layers, lengths + [chunk], 1, rng)
    gathers = _count_gathers(monkeypatch)
    for layer in range(spec.num_layers):
        lw = w.layers[layer]
        _prefill(spec, lw, layer, lengths, gen, kv_batched, kv_ref)
        # the mixed batch: decode rows of sequences 0..k-1, the chunk, the other decode rows
        k = B // 2
        segs = [(i, i, 1) for i in range(k)] + [(B, k, chunk)] + [(i, chunk + i, 1) for i in range(k, B)]
        pos = torch.tensor([lengths[i] for i in range(k)] + list(range(chunk)) + [lengths[i] for i in range(k, B)])
        x = torch.randn(B + chunk, spec.hidden_size, generator=gen)
        n_gathers = len(gathers)
        got = attn.attention(spec, lw, layer, x, pos, segs, kv_batched)
        assert len(gathers) == n_gathers + 1, "the decode rows were not batched"
        want = attn.attention(spec, lw, layer, x, pos, segs, PerSegment(kv_ref))
        assert _rel(got, want) <= 1e-5, (family, layer, _rel(got, want))
        for i, n in enumerate(lengths + [chunk - 1]):
            for a, b in zip(kv_batched.read(layer, i, n + 1), kv_ref.read(layer, i, n + 1)):
                assert torch.equal(a, b)


def test_one_row_segments_split_from_the_rest():
    one, rest = attn.split_one_row([(1, 0, 1), (2, 1, 5), (3, 6, 1), (2, 7, 1), (4, 8, 1)])
    assert one == [(1, 0), (3, 6), (4, 8)] and rest == [(2, 1, 5), (2, 7, 1)]  # sequence 2 twice: both stay in order


@pytest.mark.parametrize("window,sinks", [(None, False), (5, False), (None, True), (5, True)])
def test_attend_decode_batch_matches_attend(window, sinks):
    """The kernel alone on padded K/V, GQA 6/2; the mask and sinks must matter in this setup."""
    g = torch.Generator().manual_seed(7)
    B, nh, nkv, dk, dv, L = 5, 6, 2, 8, 4, 19
    lengths = torch.tensor([1, 4, 9, 16, 19])
    q = torch.randn(B, nh, dk, generator=g)
    k = torch.randn(B, L, nkv, dk, generator=g)
    v = torch.randn(B, L, nkv, dv, generator=g)
    s = torch.randn(nh, generator=g) if sinks else None
    got = attn.attend_decode_batch(q, k, v, lengths, 0.3, window, s)
    for i, n in enumerate(lengths.tolist()):
        want = attn.attend(q[i:i + 1], k[i, :n], v[i, :n], torch.tensor([n - 1]), 0.3, window, s)[0]
        assert _rel(got[i], want) <= 1e-5
    # Sensitivity: dropping the window (or the padding mask) changes the answer of this batch.
    if window is not None:
        assert _rel(attn.attend_decode_batch(q, k, v, lengths, 0.3, None, s), got) > 1e-3
    full = torch.full_like(lengths, L)
    assert _rel(attn.attend_decode_batch(q, k, v, full, 0.3, window, s)[:-1], got[:-1]) > 1e-3


def test_batched_api_checks_capacity():
    kv = PagedKVStore(1, BlockAllocator(8, BLOCK))
    kv.reserve(5, 6)  # 2 pages: 8 slots
    kv.reserve(6, 2)
    k = torch.zeros(2, 1, 3)
    kv.write_rows(0, [5, 6], torch.tensor([7, 3]), k, k)
    with pytest.raises(IndexError, match="sequence 6"):
        kv.write_rows(0, [5, 6], torch.tensor([0, 4]), k, k)
    with pytest.raises(IndexError, match="sequence 5"):
        kv.gather(0, [6, 5], [2, 9])
    with pytest.raises(IndexError, match="sequence 5"):
        kv.write(0, 5, torch.tensor([8]), k[:1], k[:1])
    K, V = kv.gather(0, [5, 6], [8, 1])
    assert K.shape == (2, 8, 1, 3) and V.shape == (2, 8, 1, 3)


def test_wrappers_that_delegate_by_getattr_keep_the_per_segment_path():
    """runtime/decode_only.RandomPrefixKV fills prefixes inside write(): a delegating wrapper must
    not be bypassed by the batched write."""
    from lab.decode_only import RandomPrefixKV

    kv = PagedKVStore(1, BlockAllocator(8, BLOCK))
    assert attn._batched_store(kv)
    assert not attn._batched_store(RandomPrefixKV(kv))


@pytest.mark.parametrize("host", [True, False])
def test_host_positions_keep_the_device_positions_unread(host):
    """With the positions as the host knows them (`host_positions`: the CUDA executor's list), a prefill batch, a
    decode batch and a mixed one never read the device positions back (on CUDA each read waits for the device: two per
    prompt chunk per layer before session 17); the outputs and the K/V equal those of a call without them, which reads
    the positions back once per batch (so the check has teeth)."""
    from torch.overrides import TorchFunctionMode
    spec = load_spec(SPECS / "tiny-gpt-oss.yaml")
    w = random_weights(spec, seed=3)
    lw = w.layers[0]
    gen = torch.Generator().manual_seed(3)
    lengths = [5, 9, 3]
    kv_a, kv_b = _stores(spec.num_layers, lengths, 2, random.Random(3))
    watched: list = []

    class Reads(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func in (torch.Tensor.cpu, torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__int__) and \
                    args and any(args[0] is p or args[0]._base is p for p in watched):
                raise AssertionError(f"the device positions were read back ({func.__name__})")
            return func(*args, **(kwargs or {}))

    def run(x, pos, segs):
        want = attn.attention(spec, lw, 0, x, pos, segs, kv_b)
        host_pos = pos.tolist() if host else None
        watched[:] = [pos]
        try:
            with Reads():
                got = attn.attention(spec, lw, 0, x, pos, segs, kv_a, host_pos)
        finally:
            watched.clear()
        assert torch.equal(got, want)

    pos = torch.cat([torch.arange(n) for n in lengths])
    starts = [0, 5, 14]
    if not host:  # the read-back is what the check catches
        with pytest.raises(AssertionError, match="read back"):
            run(torch.randn(17, spec.hidden_size, generator=gen), pos, [(i, s, n) for i, (s, n) in
                                                                        enumerate(zip(starts, lengths))])
        return
    run(torch.randn(17, spec.hidden_size, generator=gen), pos, [(i, s, n) for i, (s, n) in enumerate(zip(starts, lengths))])
    run(torch.randn(3, spec.hidden_size, generator=gen), torch.tensor(lengths), [(i, i, 1) for i in range(3)])
    # mixed: two decode rows beside sequence 2's next two positions as one chunk
    run(torch.randn(4, spec.hidden_size, generator=gen), torch.tensor([6, 10, 4, 5]), [(0, 0, 1), (1, 1, 1), (2, 2, 2)])
    for i, n in enumerate(lengths):
        for a, b in zip(kv_a.read(0, i, n + 2 + (i == 2)), kv_b.read(0, i, n + 2 + (i == 2))):
            assert torch.equal(a, b)
