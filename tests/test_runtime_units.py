"""Unit tests of the engine's small parts: admission/home policy, mu-queue batching, in-process transport
ordering, the wire forms, host staging, the decision shortcut (the merge table's: tests/test_runtime_merge.py)."""
from __future__ import annotations

import heapq

import numpy as np
import pytest
import torch

from runtime.core.clock import VirtualClock
from runtime.core.merge import TAG_SHIFT
from runtime.core.queues import AttnBlock, AttnItem, ExpertItem, MuQueue
from runtime.core.requests import Request
from runtime.drivers.admission import Admission
from runtime.transport.inproc import InprocHub


def req(i, prompt_len, max_new=1):
    return Request(i, f"r{i}", [5] * prompt_len, max_new)


def test_most_free_kv_home_and_ties_to_lowest_rank():
    a = Admission(4, [10, 10, 10])
    for i in range(3):
        a.submit(req(i, 8))  # 2 blocks each
    placed = a.admit([10, 10, 10])
    assert [h for _, h in placed] == [0, 1, 2]
    a.submit(req(3, 8))
    assert [h for _, h in a.admit([4, 9, 6])] == [1]


def test_round_robin_skips_full_ranks():
    a = Admission(4, [10, 10, 10], policy="round_robin")
    for i in range(4):
        a.submit(req(i, 8))
    assert [h for _, h in a.admit([10, 1, 10])] == [0, 2, 0, 2]


def test_head_of_line_waits_and_nothing_is_lost():
    a = Admission(4, [10, 10])
    a.submit(req(0, 40))  # 10 blocks
    a.submit(req(1, 4))
    free = [9, 9]
    assert a.admit(free) == [] and a.waiting == 2  # the small one does not overtake
    free = [10, 9]
    placed = a.admit(free)
    assert [(r.rid, h) for r, h in placed] == [(0, 0), (1, 1)] and free == [0, 8]


def test_impossible_request_is_refused_at_submit():
    a = Admission(4, [10, 10])
    with pytest.raises(ValueError, match="needs 11 KV blocks"):
        a.submit(req(0, 44))


def test_attention_blocks_split_at_the_cap_and_wait_as_a_whole():
    """A block of one-row segments (decode tokens) is one queue item: the cap splits it between rows
    (the rest keeps its place and its hidden-row offset), and an ineligible block keeps its place."""
    h = torch.arange(10.0)[:, None]
    q = MuQueue(0, "attn", 1, cap=8)
    q.push(AttnBlock(list(range(10)), [5] * 10, None, h, 0.0, 10))
    q.push(AttnItem(99, 3, 1, None, h, 0.1, 0))
    got = q.take()
    assert [type(it) for it in got] == [AttnBlock] and got[0].n == 8 and got[0].rids == list(range(8))
    rest = list(q)
    assert isinstance(rest[0], AttnBlock) and rest[0].rids == [8, 9] and rest[0].hrow == 8 and q.rows == 3
    assert [it.segments for it in rest] == [2, 1]
    # eligibility: the engine checks a block's rows once; here the block waits, the segment behind it runs
    got = q.take(lambda it: isinstance(it, AttnItem))
    assert [it.rid for it in got] == [99] and [it.rids for it in q] == [[8, 9]]


def test_queue_take_respects_cap_fifo_and_eligibility():
    q = MuQueue(0, "attn", 0, cap=8)
    items = [AttnItem(1, 0, 5, [1] * 5, None, 0.0), AttnItem(1, 5, 5, [1] * 5, None, 0.1),
             AttnItem(2, 0, 3, [1] * 3, None, 0.2), AttnItem(3, 0, 4, [1] * 4, None, 0.3)]
    for it in items:
        q.push(it)
    assert q.depth == 17
    # request 1's second chunk may not run before its first: skipped, keeps its place
    got = q.take(lambda it: not (it.rid == 1 and it.pos0 == 5))
    assert [(it.rid, it.pos0) for it in got] == [(1, 0), (2, 0)]
    assert [(it.rid, it.pos0) for it in q] == [(1, 5), (3, 0)] and q.rows == 9
    big = MuQueue(0, "attn", 0, cap=2)
    big.push(AttnItem(4, 0, 5, [1] * 5, None, 0.0))
    assert len(big.take()) == 1  # an oversize item still runs alone, it never sticks


def test_decode_rows_go_before_the_prompt_work_queued_earlier():
    """Attention and expert queues take their decode lane first (MuQueue's docstring): a decode block queued behind
    two prompt chunks runs in the next batch, and a chunk that then overflows the cap waits for the batch after; an
    expert block of a batch that held decode rows goes before the prompt-only blocks queued before it. Within each
    lane FIFO; the oldest item of either lane is the queue's oldest (the policies' wait)."""
    q = MuQueue(0, "attn", 0, cap=8)
    q.push(AttnItem(1, 0, 8, [1] * 8, None, 0.0))
    q.push(AttnItem(2, 0, 8, [1] * 8, None, 0.1))
    q.push(AttnBlock([3, 4], [9, 9], [5, 5], None, 0.2, 2))
    q.push(AttnItem(5, 4, 1, [1], None, 0.3))  # a one-row segment: a decode row's lane
    assert q.oldest_enqueue() == 0.0 and q.decode_enqueue() == 0.2 and q.has_eligible_decode()
    got = q.take()
    assert [type(it) for it in got] == [AttnBlock, AttnItem] and got[1].rid == 5 and q.rows == 16
    assert not q.has_eligible_decode() and q.decode_enqueue() is None
    assert [it.rid for it in q.take()] == [1] and [it.rid for it in q.take()] == [2] and len(q) == 0
    e = MuQueue(1, "expert", 0, cap=4, token_weight=1 / 2)
    e.push(_block(3, 0.0, 0))
    e.push(_block(3, 0.1, 3))
    urgent = _block(2, 0.2, 6)
    urgent.decode = True
    e.push(urgent)
    got = e.take()
    assert [it.n for it in got] == [2, 2] and np.concatenate([it.tag for it in got]).tolist() == [6, 7, 0, 1]
    assert got[0].decode and not got[1].decode and [it.n for it in e] == [1, 3]


def _block(n, t, first=0):
    return ExpertItem(0, 0, torch.arange(first, first + n, dtype=torch.float32)[:, None],
                      np.arange(first, first + n, dtype=np.int64), np.arange(first, first + n) % 3, t, n)


def test_expert_queue_depth_counts_tokens():
    q = MuQueue(1, "expert", 0, cap=4, token_weight=1 / 2)
    for j in range(3):
        q.push(_block(2, 0.0, 2 * j))
    assert q.depth == 3.0 and sum(it.n for it in q.take()) == 4 and q.depth == 1.0


def test_expert_queue_takes_whole_blocks_and_splits_only_the_last():
    q = MuQueue(1, "expert", 0, cap=5, token_weight=1 / 4)
    q.push(_block(3, 0.0, 0))
    q.push(_block(4, 0.1, 3))
    q.push(_block(2, 0.2, 7))
    got = q.take()
    assert [it.n for it in got] == [3, 2] and q.rows == 4
    assert np.concatenate([it.tag for it in got]).tolist() == [0, 1, 2, 3, 4]
    assert torch.cat([it.x for it in got])[:, 0].tolist() == [0, 1, 2, 3, 4]
    # the rest of the split block stays in front with its enqueue time: FIFO by row is unchanged
    assert q.oldest_enqueue() == 0.1 and [it.n for it in q] == [2, 2]
    got = q.take()
    assert np.concatenate([it.tag for it in got]).tolist() == [5, 6, 7, 8] and len(q) == 0
    big = MuQueue(1, "expert", 0, cap=2)
    big.push(_block(5, 0.0))
    assert [it.n for it in big.take()] == [2] and big.rows == 3


def test_inproc_fifo_per_link_under_random_delays():
    clock = VirtualClock()
    hub = InprocHub(3, clock, delay=lambda s, d, m, n, rng: rng.uniform(0, 1e-3), seed=3)
    t = hub.transports()
    for i in range(50):
        t[0].send(2, {"i": i}, torch.tensor([i]))
        t[1].send(2, {"i": i}, None)
    got = {0: [], 1: []}
    while hub.in_flight():
        clock.advance_to(hub.next_delivery())
        for a in t[2].poll():
            got[a.src].append(a.meta["i"])
    assert got[0] == list(range(50)) and got[1] == list(range(50))
    assert t[0].pending() == 0


def test_inproc_hub_hands_whole_messages_to_a_driver_that_takes_delivery():
    """With `mail` set (the virtual-clock driver's), every message goes onto that one heap whole, (delivery, seq, dst,
    src, meta, tensor), in per-link FIFO order under random delays, and nothing into the inboxes; in flight until the
    driver hands it over."""
    clock = VirtualClock()
    hub = InprocHub(3, clock, delay=lambda s, d, m, n, rng: rng.uniform(0, 1e-3), seed=3)
    hub.mail = []
    t = hub.transports()
    for i in range(50):
        t[0].send(2, {"i": i}, torch.tensor([i]))
        t[1].send(2, {"i": i}, None)
    assert hub.in_flight() == 100 and not any(hub._inbox) and len(hub.mail) == 100
    got = {0: [], 1: []}
    while hub.mail:
        when, _, dst, src, meta, tensor = heapq.heappop(hub.mail)
        assert dst == 2 and (tensor is None) == (src == 1) and when >= clock.now()
        clock.advance_to(when)
        got[src].append(meta["i"])
    assert got[0] == list(range(50)) and got[1] == list(range(50))


def test_expert_wire_forms_round_trip():
    """Tags travel as (first, count) when they are one run and as the array otherwise; expert ids as bytes of
    the narrowest unsigned type for the model's expert count; decode_tags takes the plain array too."""
    from runtime.core.expert_wire import decode_ids, decode_tags, encode_ids, encode_tags, id_dtype
    base = 7 << TAG_SHIFT
    run = np.arange(base + 3, base + 403, dtype=np.int64)
    assert encode_tags(run) == (base + 3, 400) and decode_tags(encode_tags(run)).tolist() == run.tolist()
    for gappy in (np.array([base, base + 2, base + 1]), np.array([base + 1, base]), np.array([base, base + 2])):
        assert encode_tags(gappy) is gappy and decode_tags(gappy).tolist() == gappy.tolist()
    assert decode_tags(encode_tags(run[:1])).tolist() == [base + 3]
    assert [id_dtype(n) for n in (32, 256, 257, 65536, 65537)] == [np.uint8, np.uint8, np.uint16, np.uint16, np.uint32]
    for n in (32, 384, 70000):
        ids = np.random.default_rng(n).integers(0, n, 500)
        wire = encode_ids(ids, id_dtype(n))
        assert isinstance(wire, bytes) and len(wire) == 500 * id_dtype(n).itemsize
        back = decode_ids(wire, id_dtype(n))
        assert back.dtype == np.int64 and back.tolist() == ids.tolist()


def test_staging_ring_skips_held_slots():
    """A device -> host result held for a later read (asynchronous sampling) keeps its pinned slot out of the
    ring's rotation until released; a ring whose every slot is held says so instead of overwriting one."""
    from runtime.executors.host_staging import HostStaging, PendingHost
    ring = HostStaging(torch.device("cpu"), slots=4, nbytes=64)
    held = PendingHost(torch.zeros(1), None, ring, 1)
    held.hold()
    assert [ring._next() for _ in range(6)] == [0, 2, 3, 0, 2, 3]
    held.release()
    assert [ring._next() for _ in range(4)] == [0, 1, 2, 3]
    for i in range(4):
        PendingHost(torch.zeros(1), None, ring, i).hold()
    with pytest.raises(RuntimeError, match="all 4 pinned staging slots are held"):
        ring._next()


class _Ev:
    """A CUDA event stand-in: complete or not, counting the host's queries."""

    def __init__(self, done: bool) -> None:
        self.done, self.queries = done, 0

    def query(self) -> bool:
        self.queries += 1
        return self.done


def test_staging_ring_reuses_a_slot_without_a_query_once_a_later_mark_on_its_stream_completed(monkeypatch,
                                                                                             use_options):
    """Work on one stream completes in order: once a mark is seen complete (a routing copy waited for, a slot's
    query), every earlier mark on that stream is free without asking the device; a mark on another stream, or
    a later one, is still queried, and a pending one is waited for."""
    import runtime.executors.host_staging as hs
    order = hs.StreamOrder()
    monkeypatch.setattr(hs, "STREAM_ORDER", order)
    ring = hs.HostStaging(torch.device("cpu"), slots=4, nbytes=64)
    a, b = (0, 11), (0, 22)  # two streams of device 0
    evs = [_Ev(True), _Ev(True), _Ev(True), _Ev(True)]
    ring._events = list(evs)
    ring._marks = [(a, 1), (b, 2), (a, 3), (a, 4)]
    hs.PendingHost(torch.zeros(1), _Ev(True), ring, 2, (a, 3)).wait()  # e.g. the routing copy of a batch
    assert order.known_done(a, 1) and order.known_done(a, 3) and not order.known_done(a, 4)
    assert not order.known_done(b, 2)
    assert [ring._next() for _ in range(4)] == [0, 1, 2, 3]
    assert [e.queries for e in evs] == [0, 1, 0, 1]  # slot 1: another stream; slot 3: later than the watermark
    assert order.known_done(b, 2) and order.known_done(a, 4)  # the queries that found them complete raised them
    # a pending copy is still waited for (bounded), and a lost race can only lower the watermark
    ring._events[0], ring._marks[0] = _Ev(False), (a, 9)
    use_options(device_wait_s=0.05)
    with pytest.raises(TimeoutError, match="pinned staging slot 0"):
        ring._next()
    order.seen(a, 2)
    assert order.known_done(a, 4)


def test_device_waits_are_bounded_and_name_what_they_waited_for(use_options):
    """host_staging.wait_event: returns once the event completes (polling), raises TimeoutError naming the
    wait after the device_wait_s option's seconds; an invalid bound is refused naming the field."""
    from graph_ir.errors import UserError
    from runtime.executors.host_staging import wait_event

    class Ev:  # completes after `n` looks (None: never)
        def __init__(self, n):
            self.n = n

        def query(self):
            if self.n is None:
                return False
            self.n -= 1
            return self.n < 0

    assert wait_event(Ev(0), "x") == 0.0 and wait_event(Ev(5), "x") >= 0.0
    with pytest.raises(TimeoutError, match="for the routing copy to complete on the device"):
        wait_event(Ev(None), "the routing copy", timeout_s=0.05)
    use_options(device_wait_s=0.05)
    with pytest.raises(TimeoutError, match="device_wait_s"):
        wait_event(Ev(None), "a copy")
    for bad in (0, "soon"):
        with pytest.raises(UserError, match="device_wait_s"):
            use_options(device_wait_s=bad)


def test_routed_rows_pack_and_unpack_every_row_dtype():
    """The device-routed wire form: rows, then the int32 ids and the fp32 weights viewed as the row dtype; an odd
    hidden size (the tail's bytes unaligned in a bf16 row) still unpacks, by a copy."""
    from runtime.core.routed_rows import pack, unpack
    ids = torch.tensor([[3.0, 250.0], [0.0, 7.0]])  # float ids, as the CUDA executor's routing buffer holds them
    w = torch.tensor([[0.75, 0.25], [0.1, 0.9]])
    for dtype, H in ((torch.float32, 6), (torch.bfloat16, 6), (torch.bfloat16, 5), (torch.float16, 4)):
        x = torch.randn(2, H).to(dtype)
        t = pack(x, ids, w)
        assert t.dtype == dtype and t.shape == (2, H + 2 * 2 * 4 // dtype.itemsize)
        x2, ids2, w2 = unpack(t, H)
        assert torch.equal(x2, x) and ids2.dtype == torch.int32 and ids2.tolist() == [[3, 250], [0, 7]]
        assert w2.dtype == torch.float32 and torch.equal(w2, w)
    with pytest.raises(ValueError, match="at most 4 bytes"):
        pack(torch.zeros(1, 2, dtype=torch.float64), ids[:1], w[:1])


def test_routed_item_splits_between_tokens_and_a_one_token_item_goes_whole():
    """Cut between tokens; its output tags are per token (one row per token comes back)."""
    from runtime.core.queues import RoutedItem
    from runtime.core.routed_rows import ids_of, pack
    k, H = 3, 2
    it = RoutedItem(1, 0, pack(torch.arange(4.0 * H).view(4, H), torch.arange(4 * k).view(4, k), torch.ones(4, k)),
                    100, 0.0, 4 * k)
    head, rest = it.split(7)  # 7 slots: two whole tokens (6 slots)
    assert (head.n, rest.n, head.tag0, rest.tag0) == (6, 6, 100, 102)
    assert head.payload.shape[0] == 2 and ids_of(rest.payload, k)[0].tolist() == [6, 7, 8]
    assert rest.out_rows == 2 and rest.tag.tolist() == [102, 103]
    q = MuQueue(0, "expert", 0, cap=2, token_weight=1 / k)
    q.push(RoutedItem(0, 0, pack(torch.zeros(1, H), torch.zeros(1, k), torch.ones(1, k)), 0, 0.0, k))
    got = q.take()  # a token's 3 slots cannot be cut to fit 2: it goes whole, nothing is left behind
    assert [i.n for i in got] == [k] and len(q) == 0 and q.rows == 0


def test_next_batch_asks_the_policy_again_only_after_a_push_or_a_completed_batch():
    """A decision that found nothing runnable stays true until a queue is pushed or a batch completes (they alone
    make an item runnable: new items, K/V positions, ended deferrals), so the engine answers None again without the
    views and the policy, and the defragmenting policy's history advances as if it had decided (the same snapshot
    again), so every later score is what it was without the shortcut."""
    from runtime.core.clock import WallClock
    from runtime.core.engine import Engine, EngineConfig, StageInfo
    from runtime.core.requests import Request
    from runtime.core.scheduler import Defrag
    from runtime.executors.sim_executor import SimExecutor
    from runtime.transport.inproc import InprocHub

    class Counting(Defrag):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def choose(self, views, next_of):
            self.calls += 1
            return super().choose(views, next_of)

    stages = [StageInfo(0, "attn", 0, 1, 64), StageInfo(1, "expert", 0, 2, 256), StageInfo(2, "sample", -1, 0, 64)]
    cfg = EngineConfig(rank=0, world_size=1, num_layers=1, top_k=2, stages=stages, expert_rank=[[0] * 4],
                       block_size=16, num_blocks=64)
    clock = WallClock()
    pol, ref = Counting(), Defrag()
    e = Engine(cfg, SimExecutor(4, 2, 32), InprocHub(1, clock).transports()[0], clock, policy=pol)
    empty = e.views()
    for _ in range(3):
        assert e.next_batch() is None
        ref.choose(empty, e.next_of)
    assert pol.calls == 1  # the second and third were answered without it
    assert np.array_equal(pol._ring, ref._ring) and (pol._filled, pol._next_slot) == (ref._filled, ref._next_slot)
    e.admit(Request(0, "r0", [5, 6, 7], 2))  # a push: decide again
    batch = e.next_batch()
    assert pol.calls == 2 and batch is not None and batch.stage.kind == "attn"
    assert e.next_batch() is None and pol.calls == 3  # nothing left: one real decision ...
    assert e.next_batch() is None and pol.calls == 3  # ... then the shortcut
    e._changes[0] += 1  # what complete() does first
    assert e.next_batch() is None and pol.calls == 4
