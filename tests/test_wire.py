"""The metadata wire (runtime/transport/wire.py) as an attacker and a buggy peer would try it.

Unit level: every frame that is not signed with the run's secret is refused before anything in it is read
(WireError(authenticated=False): the transport drops and counts it), a signed frame that breaks the format or a
message schema is a peer's error (authenticated=True), and hypothesis fuzzes the decoder with random and mutated
frames: nothing else ever escapes it. Process level: while two rank processes serve a real workload, a hostile
local process reads their endpoints from the rendezvous store (as anyone on the host can) and floods them with a
pickle payload that would create a file if unpickled, garbage, truncations, old-format (pickled) abort and goodbye
notices, frames signed with another key, replays and an over-size frame: the run finishes with the reference
tokens, the payload never runs, and the ranks counted what they dropped.
"""
from __future__ import annotations

import os
import pickle
import threading
import time
from datetime import timedelta

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.transport.wire import (ABORT, BYE, DATA, HEARTBEAT, TAG_BYTES, Codec, WireError, check_meta)

SECRET = bytes(range(32))


def pair(max_frame_bytes: int = 1 << 20):
    """(sender codec of rank 1, receiver codec of rank 0) of one run of 2 ranks."""
    return Codec(SECRET, 1, 2, max_frame_bytes), Codec(SECRET, 0, 2, max_frame_bytes)


EXAMPLES = [
    (DATA, {"t": "x", "layer": 3, "home": 1, "rows": (128, 7), "e": b"\x00\x01\x02\x03\x04\x05\x06", "more": 2.5,
            "d": 1}, (7, 64), "bfloat16"),
    (DATA, {"t": "y", "layer": 0, "rows": np.array([5, 9, 2], dtype=np.int64)}, (3, 64), "float32"),
    (DATA, {"t": "r", "layer": 1, "home": 0, "rows": (4096, 16), "more": 3}, (16, 80), "float32"),
    (DATA, {"t": "adm", "w": 0, "req": {"rid": 3, "name": "a", "prompt": np.arange(5, dtype=np.int64),
                                        "max_new_tokens": 4, "ignore_eos": False, "arrival": 0.0, "home": 1,
                                        "params": None}}, None, None),
    (DATA, {"t": "fin", "w": 0, "rid": 3, "output": (1, 2, 3), "reason": "length", "t_admit": 0.5, "t_finish": 0.9,
            "token_times": (0.6, 0.7, 0.8), "tokens": 3}, None, None),
    (HEARTBEAT, {"p": 17, "w": 5, "k": 40, "q": 3}, None, None),
    (ABORT, {"reason": "boom", "culprit": 1}, None, None),
    (BYE, None, None, None),
]


@pytest.mark.parametrize("kind,meta,shape,dtype", EXAMPLES)
def test_every_message_kind_round_trips(kind, meta, shape, dtype):
    tx, rx = pair()
    f = rx.decode(tx.encode(kind, 0 if kind == DATA else -1, meta, shape, dtype))
    assert (f.kind, f.src, f.shape, f.dtype) == (kind, 1, shape, dtype)
    if meta is None:
        assert f.meta is None
        return
    assert f.meta.keys() == meta.keys()
    for k, v in meta.items():
        if isinstance(v, np.ndarray):
            assert np.array_equal(f.meta[k], v) and f.meta[k].dtype == v.dtype
        elif k != "req":
            assert f.meta[k] == v and type(f.meta[k]) is type(v)  # run-form tags stay tuples


def test_a_request_crosses_as_plain_values():
    from models.sampling import SamplingParams
    from runtime.core.requests import Request
    from runtime.drivers.admission import request_from_wire, request_to_wire
    req = Request(7, "q-7", [3, 1, 4, 1, 5], 9, params=SamplingParams(temperature=0.7, top_p=0.9, seed=11),
                  ignore_eos=True, arrival=0.25, home=1)
    tx, rx = pair()
    meta = rx.decode(tx.encode(DATA, 0, {"t": "adm", "w": 0, "req": request_to_wire(req)})).meta
    back = request_from_wire(meta["req"])
    assert (back.rid, back.name, back.prompt, back.max_new_tokens, back.params, back.ignore_eos, back.arrival,
            back.home) == (7, "q-7", [3, 1, 4, 1, 5], 9, req.params, True, 0.25, 1)
    bad = dict(meta["req"], params={"temperature": -1.0, "top_p": 1.0, "top_k": 0, "seed": 0})
    with pytest.raises(ValueError):
        request_from_wire(bad)


class _Payload:
    """Unpickling this creates a file: the proof that a frame ran code."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


def test_a_pickle_payload_is_refused_unread(tmp_path):
    marker = str(tmp_path / "pwned")
    _, rx = pair()
    old_format = pickle.dumps((DATA, 1, 0, {"t": "x", "x": _Payload(marker)}, None, None))
    for raw in (old_format, pickle.dumps(_Payload(marker))):
        with pytest.raises(WireError) as err:
            rx.decode(raw)
        assert not err.value.authenticated
    assert not os.path.exists(marker)


def test_frames_not_signed_with_the_run_secret_are_strays():
    tx, rx = pair()
    other = Codec(bytes(32), 1, 2)
    good = tx.encode(DATA, 0, {"t": "stop", "w": 0})
    for raw in (b"", b"\x00", good[:-1], good[:10], good + b"x", other.encode(DATA, 0, {"t": "stop", "w": 0}),
                other.encode(ABORT, -1, {"reason": "spoofed", "culprit": 0}), other.encode(BYE, -1),
                bytes([good[0] ^ 1]) + good[1:]):
        with pytest.raises(WireError) as err:
            rx.decode(raw)
        assert not err.value.authenticated, raw


def test_the_frame_size_cap_holds_on_both_sides():
    tx, rx = pair(max_frame_bytes=4096)
    with pytest.raises(ValueError, match="frame cap"):
        tx.encode(DATA, 0, {"t": "blob", "b": b"x" * 5000})
    big = Codec(SECRET, 1, 2, 1 << 20).encode(DATA, 0, {"t": "blob", "b": b"x" * 5000})
    with pytest.raises(WireError) as err:
        rx.decode(big)
    assert not err.value.authenticated and "cap" in str(err.value)


def _signed(body: bytes) -> bytes:
    import hashlib
    return body + hashlib.blake2b(body, key=SECRET, digest_size=TAG_BYTES).digest()


def test_a_signed_frame_that_breaks_the_format_names_its_sender():
    import struct
    _, rx = pair()
    prefix = struct.Struct("<2sBBHq")
    cases = [
        prefix.pack(b"DF", 1, DATA, 1, 0) + msgpack.packb(({"t": "x", "layer": 1}, None, None)),  # lacks keys
        prefix.pack(b"DF", 1, DATA, 1, 0) + msgpack.packb(({"t": "y", "layer": "1", "rows": [1, 2]}, None, None)),
        prefix.pack(b"DF", 1, DATA, 1, 0) + msgpack.packb(({"t": "stop"}, [1 << 40], "float32")),  # shape
        prefix.pack(b"DF", 1, DATA, 1, 0) + msgpack.packb(({"t": "stop", "w": 0}, [4], "object")),  # dtype
        prefix.pack(b"DF", 1, 9, 1, 0) + msgpack.packb((None, None, None)),  # kind
        prefix.pack(b"DF", 1, DATA, 1, 0) + b"\xdd\xff\xff\xff\xff",  # an array of 4G items, 0 given
        prefix.pack(b"DF", 1, DATA, 1, 0) + msgpack.packb(({"t": "x"}, None, None)) + b"trailing",
        prefix.pack(b"DF", 1, HEARTBEAT, 1, -1) + msgpack.packb(({"p": "x", "w": 0}, None, None)),
        prefix.pack(b"DF", 1, ABORT, 1, -1) + msgpack.packb(({"reason": "r" * 5000, "culprit": 0}, None, None)),
    ]
    for body in cases:
        with pytest.raises(WireError) as err:
            rx.decode(_signed(body))
        assert err.value.authenticated and err.value.src == 1, body
    for body in (prefix.pack(b"DF", 2, DATA, 1, 0), prefix.pack(b"DF", 1, DATA, 0, 0),  # version, "from" itself
                 prefix.pack(b"DF", 1, DATA, 5, 0)):  # a rank outside the world
        with pytest.raises(WireError) as err:
            rx.decode(_signed(body + msgpack.packb((None, None, None))))
        assert err.value.authenticated


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=300))
def test_fuzz_random_frames_never_escape_the_decoder(raw):
    _, rx = pair()
    with pytest.raises(WireError) as err:
        rx.decode(raw)
    assert not err.value.authenticated


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(range(len(EXAMPLES))), st.data())
def test_fuzz_mutated_frames_are_refused_or_exact(i, data):
    """A bit flip, a cut or an insertion anywhere in a valid frame: refused as a stray (the tag), never mistaken
    for a different message."""
    kind, meta, shape, dtype = EXAMPLES[i]
    tx, rx = pair()
    raw = bytearray(tx.encode(kind, 0 if kind == DATA else -1, meta, shape, dtype))
    op = data.draw(st.sampled_from(["flip", "cut", "insert"]))
    at = data.draw(st.integers(0, len(raw) - 1))
    if op == "flip":
        raw[at] ^= 1 << data.draw(st.integers(0, 7))
    elif op == "cut":
        del raw[at:at + data.draw(st.integers(1, 8))]
    else:
        raw[at:at] = data.draw(st.binary(min_size=1, max_size=8))
    with pytest.raises(WireError) as err:
        rx.decode(bytes(raw))
    assert not err.value.authenticated


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 3), st.integers(-2, 5), st.binary(max_size=200))
def test_fuzz_signed_bodies_give_a_valid_frame_or_a_peer_error(kind, src, body):
    """As from a peer with the key but a bug: any body behind a valid tag decodes to a frame that meets the schema,
    or raises the peer's WireError; nothing else escapes (no MemoryError, no KeyError deep in the engine)."""
    import struct
    _, rx = pair()
    raw = _signed(struct.pack("<2sBBHq", b"DF", 1, kind, max(src, 0), 0 if kind == DATA else -1) + body)
    try:
        f = rx.decode(raw)
    except WireError as err:
        assert err.authenticated
    else:
        check_meta(f.kind, f.meta)


# ---------------------------------------------------------------------------------------------- real processes
def _flood(port: int, marker: str, stop: threading.Event, sent: dict) -> None:
    """A hostile local process's view: the endpoints from the rendezvous store, then every kind of bad frame."""
    import socket

    import torch.distributed as dist
    import zmq
    deadline = time.monotonic() + 60
    while True:  # the store is up (connecting to it before rank 0 listens costs TCPStore's retry backoff)
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                return
            time.sleep(0.01)
    store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=60), wait_for_workers=False)
    keys = [f"dataflow/zmq0/endpoint/{r}" for r in range(2)]
    store.wait(keys, timedelta(seconds=60))
    endpoints = [store.get(k).decode() for k in keys]
    stranger = Codec(os.urandom(32), 1, 2)
    frames = [
        pickle.dumps((DATA, 1, 0, {"t": "x", "x": _Payload(marker)}, None, None)),
        pickle.dumps((ABORT, 1, -1, {"reason": "spoofed abort", "culprit": 1}, None, None)),
        pickle.dumps((BYE, 1, -1, None, None, None)),
        b"", b"garbage" * 9, os.urandom(200),
        stranger.encode(ABORT, -1, {"reason": "spoofed abort", "culprit": 1}),
        stranger.encode(DATA, 5, {"t": "stop", "w": 0}),
    ]
    ctx = zmq.Context()
    socks = []
    for ep in endpoints:
        s = ctx.socket(zmq.PUSH)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(ep)
        socks.append(s)
    def flood_once() -> None:
        for s in socks:
            for f in frames:
                try:  # (a PUSH with no peer left blocks a plain send: the ranks are gone once the run ended)
                    s.send(f, zmq.NOBLOCK)
                    sent["frames"] += 1
                except zmq.Again:
                    pass
    flood_once()  # at once: the ranks are still starting, and count what they drop from now on
    # Over the 64 MiB cap: ZeroMQ drops it (and its connection) unread. Its own context (I/O thread), so pushing it
    # does not hold up the flood's frames.
    big_ctx = zmq.Context()
    big = big_ctx.socket(zmq.PUSH)
    big.setsockopt(zmq.LINGER, 0)
    big.connect(endpoints[0])
    big.send(b"\x00" * ((64 << 20) + 1))
    while not stop.is_set():
        flood_once()
        time.sleep(0.005)
    for s in socks:
        s.close()
    big.close()
    ctx.term()
    big_ctx.term()


def test_a_hostile_local_process_neither_runs_code_nor_stops_the_run(tmp_path, monkeypatch):
    from lowering.plan import compile_plan
    from runtime.drivers import launch
    from runtime.drivers.cluster import RunOptions
    from runtime.drivers.multiproc import run_workloads_multiprocess
    from lab.chaos import ChaosDelays
    from test_runtime import assert_matches_reference, make_requests, model

    port = launch.free_port()
    monkeypatch.setattr(launch, "free_port", lambda host="127.0.0.1": port)
    marker = str(tmp_path / "pwned")
    spec, _, _ = model("tiny-mixtral")
    plan = compile_plan(spec, 2, attn_cap=16, block_size=4)
    reqs = make_requests(spec.vocab_size, 6, seed=5, max_new=24, max_prompt=40, spread=2e-3)
    stop, sent = threading.Event(), {"frames": 0}
    attacker = threading.Thread(target=_flood, args=(port, marker, stop, sent), daemon=True)
    attacker.start()
    try:  # the delays stretch the run so the flood lands while it serves
        res = run_workloads_multiprocess(plan, [(reqs, RunOptions(kv_blocks=128))],
                                         chaos=ChaosDelays(seed=1, max_delay_s=0.004, probability=0.5), timeout=120)[0]
    finally:
        stop.set()
        attacker.join(30)
    assert not os.path.exists(marker)
    assert sent["frames"] > 0 and res.metrics["dropped_frames"] > 0
    assert res.metrics["finished"] == len(reqs)
    assert assert_matches_reference("tiny-mixtral", res.requests) > 15
    assert any(a.startswith("zmq tcp://127.0.0.1:") for a in res.metrics["listening"])
    assert all("127.0.0.1" in a for a in res.metrics["listening"]), res.metrics["listening"]
