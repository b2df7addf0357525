"""ZmqDistTransport between real processes over real sockets (gloo on CPU).

Each test is one `launch_local` of 2-4 ranks (spawning costs ~1 s per rank on 2 cores, so every launch
checks as much as it can). The rank functions below run inside the children; they regenerate every
expected payload from (seed, src, dst, i) and compare exactly, so loss, duplication, reordering per
peer or corruption all show up as errors returned to the test.
"""
from __future__ import annotations

import os
import random
import signal
import time

import pytest
import torch

from runtime.drivers.launch import launch_local

HERE = os.path.dirname(os.path.abspath(__file__))
CHILD_ENV = {"PYTHONPATH": HERE}  # so the ranks can import this module's rank functions


# ------------------------------------------------------------------------------ rank functions
def _payload(src: int, dst: int, i: int, seed: int):
    """The i-th message src -> dst: a tensor of random shape/dtype (sometimes non-contiguous) or None."""
    g = random.Random(f"{seed}/{src}/{dst}/{i}")
    if g.random() < 0.2:
        return None
    # rows mostly from a few buckets (as batch sizes are in the runtime), so receive buffers get reused
    rows, cols = g.choice([1, 8, 40, g.randint(1, 48)]), g.choice([1, 7, 64, 184])
    dtype = g.choice([torch.float32, torch.bfloat16, torch.int64])
    t = (torch.randn(rows, cols, generator=torch.Generator().manual_seed(g.getrandbits(31))) * 100).to(dtype)
    if g.random() < 0.2:
        t = t.t()  # non-contiguous: the transport must send a contiguous copy
    return t


def _checksum(t) -> float | None:
    return None if t is None else float(t.double().sum())


def _exchange(env, seed: int, n: int, chaos_seed, inflight_limit: int, device: str = "cpu", spin=None,
              engine_receives: bool = False) -> dict:
    """Every rank sends n messages to every rank (itself included) in random bursts while polling."""
    from lab.chaos import ChaosDelays
    from runtime.transport.zmq_dist import ZmqDistTransport
    rank, world = env.rank, env.world_size
    chaos = ChaosDelays(chaos_seed, max_delay_s=0.003, probability=0.5) if chaos_seed is not None else None
    rng = random.Random(f"{seed}/driver/{rank}")
    got: dict[int, list[int]] = {s: [] for s in range(world)}
    errors: list[str] = []
    landed: dict[tuple[int, int], torch.Tensor] = {}  # (src, i) -> the buffer recv_into handed out
    with ZmqDistTransport(rank, world, device, inflight_limit=inflight_limit, chaos=chaos, spin=spin,
                          engine_receives=engine_receives) as tr:
        def into(src, meta, shape, dtype):
            """Every third tensor message is received in place: into rows 1.. of a larger buffer."""
            if meta["i"] % 3:
                return None
            big = torch.full((shape[0] + 2,) + tuple(shape[1:]), 7, dtype=dtype, device=device)
            ready = None
            if big.is_cuda:
                ready = torch.cuda.Event()
                ready.record(torch.cuda.current_stream(big.device))
            landed[(src, meta["i"])] = big
            return big[1:1 + shape[0]], ready
        tr.recv_into = into

        def absorb(arrivals):
            for a in arrivals:
                i = a.meta["i"]
                want = _payload(a.src, rank, i, seed)
                if i != len(got[a.src]):
                    errors.append(f"from {a.src}: got #{i}, expected #{len(got[a.src])}")
                got[a.src].append(i)
                t = a.tensor.cpu() if a.tensor is not None else None  # the checksum as the sender computed it
                if a.meta["dst"] != rank or a.meta["sum"] != _checksum(t):
                    errors.append(f"from {a.src} #{i}: wrong dst or checksum")
                if (want is None) != (t is None) or (want is not None and not (
                        t.dtype == want.dtype and torch.equal(t, want))):
                    errors.append(f"from {a.src} #{i}: payload differs")
                big = landed.pop((a.src, i), None)
                if big is not None and (a.tensor.data_ptr() != big[1].data_ptr() or big[0].ne(7).any()
                                        or big[-1].ne(7).any()):
                    errors.append(f"from {a.src} #{i}: not received in place, or outside its slice")

        order = [(d, i) for i in range(n) for d in range(world)]
        sent = 0
        while sent < len(order):
            burst = rng.randint(1, 12)
            for d, i in order[sent:sent + burst]:
                t = _payload(rank, d, i, seed)
                tr.send(d, {"i": i, "dst": d, "sum": _checksum(t)}, t.to(device) if t is not None else None)
            sent += burst
            if rng.random() < 0.5:  # receives posted ahead of the poll (a busy rank's loop does it after a launch)
                tr.post_receives()
            absorb(tr.poll())
        deadline = time.monotonic() + 60
        while any(len(got[s]) < n for s in range(world)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {rank} still missing messages: { {s: n - len(v) for s, v in got.items()} }")
            absorb(tr.poll(timeout=0.01))
        return {"counts": {s: len(v) for s, v in got.items()}, "errors": errors[:10], "stats": dict(tr.stats)}


def _slow_link(env) -> dict:
    """Rank 0's link to rank 2 is slow (every send completes 0-100 ms late); rank 1 must not notice."""
    from lab.chaos import ChaosDelays
    from runtime.transport.zmq_dist import ZmqDistTransport
    rank = env.rank
    chaos = ChaosDelays(7, max_delay_s=0.1, probability=1.0, peers={2}, directions=("send",)) if rank == 0 else None
    with ZmqDistTransport(rank, env.world_size, "cpu", inflight_limit=2, chaos=chaos) as tr:
        if rank == 0:
            x = torch.arange(1000, dtype=torch.float32)
            t0 = time.monotonic()
            for i in range(20):
                tr.send(2, {"i": i}, x)
                tr.send(1, {"i": i}, x)
            done: dict[int, float] = {}
            pending_when_1_done = None
            deadline = t0 + 30
            while len(done) < 2 and time.monotonic() < deadline:
                for a in tr.poll(timeout=0.01):
                    done[a.src] = time.monotonic() - t0
                    if a.src == 1:
                        pending_when_1_done = tr.pending()
            return {"done": done, "pending_when_1_done": pending_when_1_done}
        n = 0
        deadline = time.monotonic() + 30
        while n < 20 and time.monotonic() < deadline:
            n += len(tr.poll(timeout=0.01))
        tr.send(0, {"done": n}, None)
        return {"received": n}


def _rank_post_receives(env) -> dict:
    """Rank 0 sends one tensor; rank 1 (engine-thread receives) starts its receive with post_receives() before any
    poll(): the header is read and the receive posted, nothing is delivered until the poll."""
    from runtime.transport.zmq_dist import ZmqDistTransport, init_distributed
    init_distributed(env.rank, env.world_size, "gloo")
    with ZmqDistTransport(env.rank, env.world_size, "cpu", engine_receives=True) as tr:
        if env.rank == 0:
            tr.send(1, {"i": 0}, torch.arange(64, dtype=torch.float32))
            got = []
            while not got:
                got = tr.poll(timeout=0.01)
            return {"ack": got[0].meta}
        deadline = time.monotonic() + 20
        while tr._recv_seq[0] == 0 and time.monotonic() < deadline:  # the header is read by post_receives only
            tr.post_receives()
            time.sleep(0.001)
        posted, delivered_before_poll = tr._recv_seq[0], tr.stats["received"]
        got = []
        while not got and time.monotonic() < deadline:
            got = tr.poll(timeout=0.01)
        tr.send(0, {"ok": True}, None)
        return {"posted": posted, "delivered_before_poll": delivered_before_poll,
                "got": got[0].tensor.tolist() if got else None}


def _rank_world3(env, seed: int, n: int) -> dict:
    from runtime.transport.zmq_dist import init_distributed
    init_distributed(env.rank, env.world_size, "gloo")
    return {"chaos": _exchange(env, seed, n, chaos_seed=seed + 1, inflight_limit=4), "slow": _slow_link(env)}


def _rank_exchange(env, seed: int, n: int, inflight_limit: int, engine_receives: bool = False, spin=None) -> dict:
    from runtime.transport.zmq_dist import init_distributed
    init_distributed(env.rank, env.world_size, "gloo")
    return _exchange(env, seed, n, chaos_seed=None, inflight_limit=inflight_limit, spin=spin,
                     engine_receives=engine_receives)


def _rank_cuda_exchange(env, seed: int, n: int, inflight_limit: int) -> dict:
    """_exchange on cuda:LOCAL_RANK over NCCL (ncclSend/ncclRecv through ctypes), then one tensor
    per dtype each way, including dtypes NCCL has no name for (they travel as bytes)."""
    from runtime.transport.zmq_dist import ZmqDistTransport, init_distributed
    torch.cuda.set_device(env.local_rank)
    dev = f"cuda:{env.local_rank}"
    init_distributed(env.rank, env.world_size, "nccl")
    out = _exchange(env, seed, n, chaos_seed=None, inflight_limit=inflight_limit, device=dev)
    dtypes = [torch.bool, torch.int16, torch.uint8, torch.int8, torch.int32, torch.float16, torch.float64,
              torch.bfloat16]
    peer = 1 - env.rank

    def tensor(k: int, sender: int) -> torch.Tensor:  # computed in int64, then cast: same bits on both sides
        return (torch.arange(1000 * (k + 1), device=dev).remainder(97) * (sender + 1)).to(dtypes[k])

    with ZmqDistTransport(env.rank, env.world_size, dev) as tr:
        for k in range(len(dtypes)):
            tr.send(peer, {"k": k}, tensor(k, env.rank))
        got = []
        deadline = time.monotonic() + 60
        while len(got) < len(dtypes) and time.monotonic() < deadline:
            got += tr.poll(timeout=0.01)
        for pos, a in enumerate(got):
            dt = dtypes[a.meta["k"]]
            if a.meta["k"] != pos or a.tensor.dtype != dt or not torch.equal(a.tensor, tensor(a.meta["k"], peer)):
                out["errors"].append(f"dtype round: message {pos} ({a.meta['k']}, {dt}) differs or out of order")
        out["dtype_count"] = len(got)
    out["teardown"] = tr._links.teardown  # how close() ended the NCCL pair communicators
    return out


def _rank_ping(env, delay_us: float, n: int) -> dict:
    """Rank 0 pings rank 1 n times (tensor messages) with the bench's link disturbance on link 0 <-> 1
    always on; returns rank 0's median round trip."""
    from lab.bench import WallLinkDelays
    from lab.interference import from_config
    from runtime.transport.zmq_dist import ZmqDistTransport, init_distributed
    init_distributed(env.rank, env.world_size, "gloo")
    bursts = [{"period_ms": 20, "duty": 1.0, "extra_delay_us": delay_us, "links": [[0, 1], [1, 0]]}]
    chaos = WallLinkDelays(from_config({"bursts": bursts} if delay_us else {}))
    rtts = []
    with ZmqDistTransport(env.rank, env.world_size, "cpu", chaos=chaos) as tr:
        for i in range(n):
            t0 = time.monotonic()
            if env.rank == 0:
                tr.send(1, {"i": i}, torch.ones(8))
            got = []
            while not got:
                got = tr.poll(timeout=0.01)
            if env.rank == 1:
                tr.send(0, {"i": i}, torch.ones(8))
            else:
                rtts.append(time.monotonic() - t0)
    return {"rtt": sorted(rtts)[len(rtts) // 2] if rtts else None}


def _rank_killed(env, victim: int, after: int) -> None:
    """Ranks exchange tensors in lock step until `victim` SIGKILLs itself mid-run."""
    from runtime.transport.zmq_dist import ZmqDistTransport, init_distributed
    init_distributed(env.rank, env.world_size, "gloo")
    with ZmqDistTransport(env.rank, env.world_size, "cpu") as tr:  # default 10 s peer timeout
        tr.describe_wait = lambda peer: f"step {step}'s partial result from rank {peer}"
        step = 0
        while True:
            for d in range(env.world_size):
                if d != env.rank:
                    tr.send(d, {"step": step}, torch.ones(4096))
            got = 0
            while got < env.world_size - 1:
                got += len(tr.poll(timeout=0.01))
            step += 1
            if env.rank == victim and step == after:
                os.kill(os.getpid(), signal.SIGKILL)


# ------------------------------------------------------------------------------ tests
def _check_exchange(result, world: int, n: int) -> None:
    assert result.ok, result.first_error
    for rank, r in enumerate(result.results):
        assert r["errors"] == [], f"rank {rank}: {r['errors']}"
        assert r["counts"] == {s: n for s in range(world)}, f"rank {rank} lost or duplicated messages"


@pytest.mark.parametrize("world,inflight,engine_receives,spin", [(2, 16, False, None), (4, 2, True, None),
                                                                 (2, 4, True, True)])
def test_exchange_fifo_no_loss(world, inflight, engine_receives, spin):
    """Gloo's receptor thread, and engine_receives=True (what CUDA ranks do: headers read and receives posted by the
    engine thread in poll(), no receptor thread) over gloo: the same ordering and delivery guarantees; so does the
    busy-polling idle wait (spin=True; what CUDA ranks do)."""
    n = 60
    res = launch_local(world, "test_transport_dist:_rank_exchange", (world * 11, n, inflight, engine_receives, spin),
                       timeout=80, env=CHILD_ENV)
    _check_exchange(res, world, n)
    # a small in-flight cap forces the per-peer backlogs to be used
    assert all(r["stats"]["local"] == n for r in res.results)
    assert all(r["stats"]["in_place"] > 0 for r in res.results), "recv_into was never used"


def test_post_receives_starts_a_transfer_that_the_next_poll_delivers():
    res = launch_local(2, "test_transport_dist:_rank_post_receives", (), timeout=60, env=CHILD_ENV)
    assert res.ok, res.first_error
    r = res.results[1]
    assert r["posted"] == 1 and r["delivered_before_poll"] == 0
    assert r["got"] == list(range(64)) and res.results[0]["ack"] == {"ok": True}


def test_three_ranks_chaos_delays_and_slow_link():
    n = 60
    res = launch_local(3, "test_transport_dist:_rank_world3", (5, n), timeout=80, env=CHILD_ENV)
    assert res.ok, res.first_error
    # Chaos: random per-message delays on every lane, yet every message arrives intact and in order.
    for rank, r in enumerate(res.results):
        assert r["chaos"]["errors"] == [], f"rank {rank}: {r['chaos']['errors']}"
        assert r["chaos"]["counts"] == {s: n for s in range(3)}
    # Slow link 0 -> 2: rank 1 gets all its messages while most of rank 2's are still queued.
    slow = res.results[0]["slow"]
    assert set(slow["done"]) == {1, 2}, slow
    assert slow["pending_when_1_done"] >= 10, slow
    assert slow["done"][1] * 4 < slow["done"][2], slow
    assert res.results[1]["slow"]["received"] == 20 and res.results[2]["slow"]["received"] == 20


def test_killed_rank_makes_every_other_rank_exit_with_a_clear_message():
    t0 = time.monotonic()
    # grace_s is large so the survivors must exit on their own, not by the launcher's kill.
    res = launch_local(3, "test_transport_dist:_rank_killed", (1, 30), timeout=60, grace_s=40, env=CHILD_ENV)
    elapsed = time.monotonic() - t0
    assert res.exit_codes[1] == -signal.SIGKILL
    assert res.first_failed_rank == 1 and "SIGKILL" in res.first_error
    for rank in (0, 2):
        assert res.exit_codes[rank] == 1, res
        msg = res.errors[rank]
        assert "PeerFailure: rank 1 failed" in msg, msg
        # either its own observation (silence, or a gloo transfer reset by the dead peer) or the abort of
        # the rank that noticed first; both say what was outstanding with rank 1
        waiting = msg.split("this rank was waiting for:")[-1]
        assert "rank 1" in waiting, msg
    assert elapsed < 30, f"survivors took {elapsed:.1f} s"


def test_bench_link_delay_holds_back_delivery_not_just_the_senders_notice():
    """The bench's link bursts (WallLinkDelays) must delay when a message *arrives*: +5 ms on link 0 <-> 1
    adds >= 10 ms to a round trip. (Drawn on the send lane they only delayed the sender's completion
    notice, and no system in the process-mode bench saw the bursts.)"""
    res = launch_local(2, "test_transport_dist:_rank_ping", (5000.0, 12), timeout=60, env=CHILD_ENV)
    assert res.ok, res.first_error
    assert res.results[0]["rtt"] >= 0.010, res.results[0]


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_cuda_exchange_direct_nccl():
    """GPU machines only. Two ranks on cuda:0/1 exchange tensors both ways with ncclSend/ncclRecv called
    through ctypes (nccl_lib.py): values, per-peer order and dtypes, with a small in-flight cap so backlogs
    are used; and every rank must close cleanly (communicators destroyed, no hang)."""
    n = 200
    res = launch_local(2, "test_transport_dist:_rank_cuda_exchange", (17, n, 4), timeout=180, env=CHILD_ENV)
    _check_exchange(res, 2, n)
    for r in res.results:
        assert r["dtype_count"] == 8, r
        assert r["teardown"] == "destroyed", r  # clean close, in time


@pytest.mark.parametrize("spin", [True, False])
def test_engine_wait_notices_event_completion_without_waiting_out_a_slice(spin):
    """poll(timeout) on a CUDA rank (EventLanes, no waiter threads, headers read by the engine thread) must
    re-query lane events while it waits, busy-polling (the CUDA rule) or not. Fake CUDA events and a fake
    header socket on CPU; no processes."""
    import queue

    from runtime.transport import zmq_dist
    from runtime.transport.completion import EventLane, Item

    class FakeEvent:
        def __init__(self, ready_at):
            self.ready_at = ready_at

        def query(self):
            return time.monotonic() >= self.ready_at

    class QuietSocket:  # no header ever comes: a ZeroMQ poll waits out its timeout
        def poll(self, ms):
            time.sleep(ms / 1000)

    tr = zmq_dist.ZmqDistTransport.__new__(zmq_dist.ZmqDistTransport)
    tr._nccl, tr._spin, tr._done, tr._pull = True, spin, queue.SimpleQueue(), QuietSocket()
    tr._receive_headers = lambda: 0
    tr._send_lanes = {1: EventLane("send->1", tr._done)}
    tr._recv_lanes = {1: EventLane("recv<-1", tr._done)}
    tr._lanes = [tr._send_lanes[1], tr._recv_lanes[1]]
    tr._inflight, tr._pending = [0, 0], 0
    tr.stats = {"received": 0}

    def collect(timeout):
        out: list = []
        tr._wait_engine(timeout, out)
        while True:  # what poll() does after the wait
            try:
                tr._complete(tr._done.get_nowait(), out)
            except queue.Empty:
                return out

    # 1. a receive outstanding, its event completes after 3 ms: seen within a few ms of that, in order
    item = Item(False, 1, 0, {"i": 0})
    item.event = FakeEvent(time.monotonic() + 0.003)
    tr._recv_lanes[1].submit(item)
    tr._recv_lanes[1].submit(Item(False, 1, 1, {"i": 1}))  # meta-only behind it
    t0 = time.monotonic()
    assert [a.meta["i"] for a in collect(0.5)] == [0, 1]
    assert time.monotonic() - t0 < 0.05

    # 2. nothing ever arrives: returns after the timeout, not before
    t0 = time.monotonic()
    assert collect(0.02) == [] and 0.015 <= time.monotonic() - t0 < 0.5
