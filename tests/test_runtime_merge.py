"""Unit tests of the merge table (runtime/core/merge.py): a token's k parts (or a device-routed token's holders'
rows) land at their dispatch positions, in any order and any message cut, and combine in slot order."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from runtime.core.dispatch_plan import unpack_group_inputs
from runtime.core.merge import TAG_SHIFT, MergeTable
from test_dispatch_plan import pack_group_inputs, plan_from_order


def _group(table, n_per_seg, H, layer=1):
    S = len(n_per_seg)
    n = np.asarray(n_per_seg, dtype=np.int64)
    R = int(n.sum())
    return table.open(layer, [7 + s for s in range(S)], [10] * S, np.full(S, 10, dtype=np.int64), n,
                      torch.zeros(R, H), None, torch.ones(R, table.top_k))


def _slots(g, rows=None):
    """The group's expert rows as [n, k, H] in slot order, through the combine's inputs."""
    y, row_index = MergeTable.combine_inputs(g, None if rows is None else np.asarray(rows))
    return y if row_index is None else y[row_index]


def test_merge_stacks_parts_in_slot_order_whatever_the_arrival_order():
    k, n, H = 3, 2, 4
    table = MergeTable(k)
    g = _group(table, [n], H)
    base = g.gid << TAG_SHIFT
    parts = {(r, j): torch.full((H,), 10.0 * r + j) for r in range(n) for j in range(k)}
    order = list(parts)
    random.Random(0).shuffle(order)
    # arrivals in messages of 1, 2 and 3 rows, rows in shuffled (row, slot) order
    done = []
    for a, b in ((0, 1), (1, 3), (3, 6)):
        chunk = order[a:b]
        done.append(table.add(np.array([base + r * k + j for r, j in chunk]), torch.stack([parts[c] for c in chunk])))
    assert done[0] == [] and done[1] == [] and len(done[2]) == 1 and len(table) == 0
    grp, segs = done[2][0]
    assert segs.tolist() == [0]
    y = _slots(grp)
    assert y.shape == (n, k, H) and [[float(y[r, j, 0]) for j in range(k)] for r in range(n)] == [[0, 1, 2], [10, 11, 12]]
    with pytest.raises(KeyError):
        table.add(np.array([base]), parts[(0, 0)][None])


def test_merge_segments_complete_independently_and_across_groups():
    k, H = 2, 3
    table = MergeTable(k)
    g0 = _group(table, [1, 2], H)  # segment 0: row 0; segment 1: rows 1-2
    g1 = _group(table, [1], H)
    b0, b1 = g0.gid << TAG_SHIFT, g1.gid << TAG_SHIFT
    assert len(table) == 3
    # one message: all of g0's segment 1, g1's only segment, half of g0's segment 0
    tags = np.array([b0 + 2, b1 + 0, b0 + 3, b0 + 4, b1 + 1, b0 + 5, b0 + 0])
    done = table.add(tags, torch.arange(len(tags), dtype=torch.float32)[:, None].expand(-1, H))
    assert [(g.gid, s.tolist()) for g, s in done] == [(g0.gid, [1]), (g1.gid, [0])] and len(table) == 1
    assert g0.rows_of(np.array([1])).tolist() == [1, 2]
    assert _slots(g0, [1, 2])[:, :, 0].tolist() == [[0, 2], [3, 5]]
    done = table.add(np.array([b0 + 1]), torch.full((1, H), 9.0))
    assert [(g.gid, s.tolist()) for g, s in done] == [(g0.gid, [0])] and len(table) == 0


def test_merge_by_dispatch_position_lands_messages_in_place():
    """Tags are positions in the dispatch order: a destination's rows come back as one contiguous
    range of the buffer (received in place, or one slice copy), and the combine's row_index reads
    them back in slot order."""
    k, n, H = 2, 3, 2
    table = MergeTable(k)
    N = torch.zeros(n, H)
    # (row, slot) pairs by destination: rank 0 gets f = 0, 3, 4, rank 1 gets f = 1, 2, 5
    order = np.array([0, 3, 4, 1, 2, 5])
    w = torch.ones(n, k)
    g = table.open(1, [7], [10], np.array([10]), np.array([n]), N, None, w, plan_from_order(order, w))
    base = g.gid << TAG_SHIFT
    value = {f: torch.full((H,), 10.0 * (f // k) + f % k) for f in range(n * k)}
    # rank 1's message: positions 3..5, received in place
    tags1 = np.arange(3, 6) + base
    view, ready = table.landing(tags1, (3, H), torch.float32)
    assert ready is None and view.data_ptr() == g.y[3].data_ptr()
    view.copy_(torch.stack([value[int(order[p])] for p in range(3, 6)]))
    assert table.add(tags1, view, landed=True) == []
    # refused: not one run, wrong dtype or row shape, unknown group
    assert table.landing(np.array([0, 2]) + base, (2, H), torch.float32) is None
    assert table.landing(np.arange(0, 3) + base, (3, H), torch.float64) is None
    assert table.landing(np.arange(0, 3) + base, (3, H + 1), torch.float32) is None
    assert table.landing(np.arange(0, 3) + ((g.gid + 1) << TAG_SHIFT), (3, H), torch.float32) is None
    # rank 0's message arrives reversed: no single run, so scattered by index
    tags0 = np.arange(2, -1, -1) + base
    done = table.add(tags0, torch.stack([value[int(order[p])] for p in (2, 1, 0)]))
    assert len(done) == 1 and len(table) == 0
    y = _slots(g)
    assert y[:, :, 0].tolist() == [[0, 1], [10, 11], [20, 21]]


@pytest.mark.parametrize("R,k,with_order", [(3, 2, True), (5, 3, True), (1, 1, True), (4, 4, False), (3, 3, False)])
def test_merge_group_inputs_pack_into_one_upload(R, k, with_order):
    """A CUDA merge group uploads the dispatch gather, the combine's row_index and the fp32 weights as one
    int64 array: the views unpacked from it equal the arrays packed (odd R*k included: the weights' last
    int64 is half padding)."""
    rng = np.random.default_rng(R * 10 + k)
    order = rng.permutation(R * k).astype(np.int64) if with_order else None
    inv = None
    if with_order:
        inv = np.empty(R * k, dtype=np.int64)
        inv[order] = np.arange(R * k)
        inv = inv.reshape(R, k)
    w = torch.from_numpy(rng.random((R, k), dtype=np.float32))
    host = pack_group_inputs(order // k if with_order else None, inv, w)
    # the weights as numpy (CudaExecutor.route_arrays hands them out so) pack the same (odd R*k: the last
    # int64's padding half is zero)
    assert np.array_equal(host, pack_group_inputs(order // k if with_order else None, inv, w.numpy().copy()))
    packed = torch.cat([torch.full((3,), -1, dtype=torch.int64), torch.from_numpy(host)])[3:]  # a storage offset
    gather, row_index, weights = unpack_group_inputs(packed, R, k, with_order)
    assert weights.dtype == torch.float32 and torch.equal(weights, w)
    if with_order:
        assert gather.tolist() == (order // k).tolist() and row_index.tolist() == inv.tolist()
    else:
        assert gather is None and row_index is None


def test_merge_store_slices_runs_and_scatters_the_rest():
    """_store copies runs of consecutive positions as slices, whatever their number of messages rows."""
    from runtime.core.merge import _store
    buf = torch.zeros(8, 1)
    y = torch.arange(5.0)[:, None]
    _store(buf, np.array([5, 6, 0, 1, 2]), y, None)  # two runs
    assert buf[:, 0].tolist() == [2, 3, 4, 0, 0, 0, 1, 0]
    buf.zero_()
    _store(buf, np.array([3, 4]), y, np.array([4, 0]))  # one run of positions, message rows not consecutive
    assert buf[:, 0].tolist() == [0, 0, 0, 4, 0, 0, 0, 0]
    buf.zero_()
    _store(buf, np.array([7, 5, 3, 1, 0, 2]), torch.arange(6.0)[:, None], None)  # six runs: one scatter
    assert buf[:, 0].tolist() == [4, 3, 5, 2, 0, 1, 0, 0]


def test_merge_whole_groups_hands_back_every_segment_with_the_last_part():
    """whole_groups (the engine's mode under the wave hold): a segment whose parts are all in waits for
    the rest of its group; the group's last part completes every segment at once."""
    k, H = 2, 3
    table = MergeTable(k, whole_groups=True)
    g = _group(table, [1, 2], H)  # segment 0: row 0; segment 1: rows 1-2
    b = g.gid << TAG_SHIFT
    assert table.add(np.array([b + 0, b + 1]), torch.zeros(2, H)) == []  # segment 0 complete: held
    assert len(table) == 2 and table.open_rows(1) == 3
    done = table.add(np.array([b + 2, b + 3, b + 4, b + 5]), torch.ones(4, H))
    assert [(x.gid, s.tolist()) for x, s in done] == [(g.gid, [0, 1])] and len(table) == 0
    assert table.open_rows(1) == 0


def test_merge_rejects_duplicates():
    table = MergeTable(2)
    g = _group(table, [1], 2)
    base = g.gid << TAG_SHIFT
    table.add(np.array([base + 1]), torch.zeros(1, 2))
    with pytest.raises(ValueError, match="duplicate"):
        table.add(np.array([base + 1]), torch.zeros(1, 2))
    g2 = _group(table, [2], 2)
    with pytest.raises(ValueError, match="duplicate"):  # twice within one message
        table.add(np.array([(g2.gid << TAG_SHIFT) + 3] * 2), torch.zeros(2, 2))


@pytest.mark.parametrize("whole", [False, True])
def test_merge_add_run_form_equals_array_form(whole):
    """MergeTable.add of the wire's run form (first, count) bookkeeps with slices: the same completed segments,
    buffer and open rows as the array form, message by message; a duplicate run is named like an array's."""
    k, H = 2, 3
    rng = np.random.default_rng(5)
    for trial in range(20):
        n_per_seg = rng.integers(1, 4, size=rng.integers(1, 6)).tolist()
        R = sum(n_per_seg)
        cuts = np.sort(rng.choice(np.arange(1, R * k), size=min(3, R * k - 1), replace=False)).tolist()
        runs = list(zip([0] + cuts, cuts + [R * k]))
        rng.shuffle(runs)
        tables = [MergeTable(k, whole_groups=whole) for _ in range(2)]
        groups = [_group(t, n_per_seg, H) for t in tables]
        for a, b in runs:
            y = torch.arange((b - a) * H, dtype=torch.float32).view(b - a, H) + 100 * a
            base = groups[0].gid << TAG_SHIFT
            via_array = tables[0].add(np.arange(a, b) + base, y)
            via_run = tables[1].add((base + a, b - a), y)
            assert [(g.gid, d.tolist()) for g, d in via_array] == [(g.gid, d.tolist()) for g, d in via_run]
            assert tables[0].open_rows(1) == tables[1].open_rows(1) and len(tables[0]) == len(tables[1])
        assert torch.equal(groups[0].y, groups[1].y) and len(tables[1]) == 0
    t = MergeTable(k, whole_groups=whole)
    g = _group(t, [2, 2], H)
    base = g.gid << TAG_SHIFT
    t.add((base, 3), torch.zeros(3, H))
    with pytest.raises(ValueError, match="duplicate expert output"):
        t.add((base + 2, 2), torch.zeros(2, H))


def test_holder_group_lands_each_holders_rows_in_its_range_and_combines_in_holder_order():
    """A device-routed group (holders > 0): each holder returns one row per token, at positions j*R + row; the
    rows land in place (one contiguous range per holder), segments complete once every holder's row is in, whatever
    the order and the message cuts (runs or tag arrays, other groups in the same message), and the combine's inputs
    add the holders' rows in holder order with weight 1."""
    from models.layers import moe_combine
    k, H = 4, 3
    table = MergeTable(k)
    n = np.array([1, 2])  # two segments, 3 rows
    h_res = torch.randn(3, H)
    g = table.open(1, [7, 8], [10, 10], np.array([10, 10]), n, h_res, None, None, holders=2)
    assert g.k == 2 and g.y.shape == (6, H) and g.weights.tolist() == [[1.0, 1.0]] * 3
    other = _group(table, [1], H)  # a positional group sharing a message with g
    base = g.gid << TAG_SHIFT
    p0, p1 = torch.randn(3, H), torch.randn(3, H)  # holder 0's and holder 1's rows
    target, _ = table.landing((base + 3, 3), (3, H), torch.float32)  # holder 1's range: received in place
    target.copy_(p1)
    assert table.add((base + 3, 3), p1, landed=True) == []
    done = table.add(np.array([base + 1, (other.gid << TAG_SHIFT) + 0]), torch.cat([p0[1:2], torch.zeros(1, H)]))
    assert done == []  # segment 1 still misses holder 0's row 2, segment 0 its row 0; `other` misses slots
    done = table.add(np.array([base + 2, base + 0]), torch.stack([p0[2], p0[0]]))
    assert [(d.gid, s.tolist()) for d, s in done] == [(g.gid, [0, 1])] and table.open_rows(1) == 1
    y, row_index = MergeTable.combine_inputs(g)
    assert row_index.tolist() == [[0, 3], [1, 4], [2, 5]]
    want = moe_combine(h_res, None, torch.stack([p0, p1], dim=1), torch.ones(3, 2))
    assert torch.equal(moe_combine(h_res, None, y[row_index], g.weights), want)
    with pytest.raises(KeyError):
        table.add((base, 1), p0[:1])  # the group is gone


def test_a_closed_groups_y_buffer_is_reused_by_the_next_open_of_its_shape():
    """A group that left the table gives its y back: the next open of the same shape gets that buffer (a decode
    wave's groups have one shape at every layer of a step), another shape a new one; at most _SPARE_SHAPES shapes
    are kept, the least recently used dropped first. A reused buffer is filled afresh: the second group's combine
    reads its own parts only."""
    from runtime.core import merge as merge_mod
    k, H = 2, 3
    table = MergeTable(k, whole_groups=True)

    def open_holders(R):
        return table.open(1, list(range(R)), [5] * R, [5] * R, np.ones(R, dtype=np.int64), torch.zeros(R, H), None,
                          None, holders=2)

    def finish(g, value):
        base = g.gid << TAG_SHIFT
        part = torch.full((g.rows * 2, H), value)
        return table.add((base, g.rows * 2), part)

    g1 = open_holders(2)
    assert finish(g1, 1.0)[0][0] is g1
    g2 = open_holders(2)
    assert g2.y.data_ptr() == g1.y.data_ptr()  # reused
    g3 = open_holders(2)  # the spare is taken: a new buffer
    assert g3.y.data_ptr() != g2.y.data_ptr()
    finish(g2, 2.0)
    y, row_index = MergeTable.combine_inputs(g2)
    assert torch.equal(y[row_index], torch.full((2, 2, H), 2.0))
    for R in (3, 4, 5, 6, 7):  # five more shapes: the oldest kept one (R=2) is dropped
        finish(open_holders(R), 0.0)
    assert len(table._spare) == merge_mod._SPARE_SHAPES
    assert open_holders(2).y.data_ptr() not in (g1.y.data_ptr(), g3.y.data_ptr())


def test_a_decode_group_shares_read_only_per_segment_arrays_and_completes_like_one_given_ones():
    """open(n=None): one row per segment (a decode wave). Its n, start and seg_of_row are one read-only pair of arrays
    per size, shared by every such group; the group completes and combines as one opened with an explicit n of ones."""
    H = 3
    table = MergeTable(2, whole_groups=True)
    h_res = torch.randn(4, H)

    def opened(n):
        return table.open(1, [7, 8, 9, 10], [5] * 4, [5] * 4, n, h_res, None, None, holders=2)

    a, b, c = opened(None), opened(None), opened(np.ones(4, dtype=np.int64))
    assert a.n is b.n and a.start is b.start and a.seg_of_row is a.start
    assert a.n.tolist() == c.n.tolist() and a.start.tolist() == c.start.tolist() == c.seg_of_row.tolist()
    with pytest.raises(ValueError):
        a.n[0] = 2
    part = torch.randn(8, H)
    done = [table.add((g.gid << TAG_SHIFT, 8), part) for g in (a, c)]
    assert [d[0][1].tolist() for d in done] == [[0, 1, 2, 3]] * 2
    assert torch.equal(MergeTable.combine_inputs(a)[0], MergeTable.combine_inputs(c)[0])
    assert table.open_rows(1) == 4  # b is still open


@pytest.mark.parametrize("dtype,part_dtype", [(torch.float32, torch.float32), (torch.float64, torch.float32),
                                              (torch.bfloat16, torch.bfloat16)])
def test_a_parts_copy_lands_the_same_through_numpy_or_torch(dtype, part_dtype):
    """A part's rows are copied into a host buffer through numpy (y_host) when buffer and part share a dtype numpy
    has, else with torch's copy_ (bfloat16, or a part to cast): the same values land either way."""
    k, H = 2, 3
    table = MergeTable(k)
    g = table.open(1, [7], [10], [10], np.array([2]), torch.zeros(2, H, dtype=dtype), None, torch.ones(2, k))
    assert (g.y_host is not None) == (dtype != torch.bfloat16)
    parts = [torch.arange(n * H, dtype=part_dtype).view(n, H) + 10 * p0 for p0, n in ((0, 1), (1, 2), (3, 1))]
    for (p0, n), y in zip(((0, 1), (1, 2), (3, 1)), parts):
        done = table.add(((g.gid << TAG_SHIFT) + p0, n), y)
    assert [d.tolist() for _, d in done] == [[0]] and len(table) == 0
    assert torch.equal(g.y, torch.cat(parts).to(dtype))
