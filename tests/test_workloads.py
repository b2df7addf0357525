"""Workload generators: length tables, arrivals, routing overrides. All seeded, all deterministic."""
import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from graph_ir.errors import UserError
from lab.arrivals import ClosedLoopArrivals, PoissonArrivals, sample_requests
from lab.lengths import FixedLengths, clip_to_context, length_distribution, percentile_table
from lab.routing_override import RoutingRecorder, RoutingTrace, ZipfRouting

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


@pytest.mark.parametrize("name", ["sharegpt", "gsm8k"])
def test_embedded_tables_equal_the_shared_csv(name):
    path = DATA / f"{name}_length_percentiles.csv"
    if not path.exists():
        pytest.skip("shared data not present on this machine")
    rows = list(csv.DictReader(path.open()))
    prompt, output = percentile_table(name)
    assert [float(r["input_tokens"]) for r in rows] == list(prompt)
    assert [float(r["output_tokens"]) for r in rows] == list(output)


def test_sampled_lengths_follow_the_published_medians():
    # Published: ShareGPT input median 23, output median 272; GSM8K input 54, output 92.
    sg = length_distribution("sharegpt", max_context=4096).sample(20000, seed=0)
    assert abs(np.median([x.prompt for x in sg]) - 23) <= 2
    assert abs(np.median([x.output for x in sg]) - 272) <= 10
    gs = length_distribution("gsm8k").sample(20000, seed=0)
    assert abs(np.median([x.prompt for x in gs]) - 54) <= 2
    assert abs(np.median([x.output for x in gs]) - 92) <= 3
    assert max(x.output for x in gs) <= 361


def test_lengths_are_seeded_prefix_stable_and_clipped():
    d = length_distribution("sharegpt", max_context=512)
    a, b = d.sample(300, seed=7), d.sample(500, seed=7)
    assert a == b[:300]
    assert a != d.sample(300, seed=8)
    assert all(x.prompt >= 1 and x.output >= 1 and x.prompt + x.output <= 512 for x in b)
    assert clip_to_context(5000, 10, 2048).prompt == 2047 and clip_to_context(5000, 10, 2048).output == 1
    assert length_distribution("fixed:16:32").sample(3, 0) == FixedLengths(16, 32).sample(3, 1)


@pytest.mark.parametrize("bad", ["nope", "fixed:0:3", "fixed:a:b", "fixed:1"])
def test_bad_length_names_are_user_errors(bad):
    with pytest.raises(UserError):
        length_distribution(bad)


def test_requests_are_seeded_and_avoid_reserved_ids():
    d = length_distribution("gsm8k")
    a = sample_requests(d, 20, vocab_size=50, seed=3, reserved_ids=[0, 49])
    assert a == sample_requests(d, 20, vocab_size=50, seed=3, reserved_ids=[0, 49])
    assert a != sample_requests(d, 20, vocab_size=50, seed=4, reserved_ids=[0, 49])
    assert len({r.id for r in a}) == 20
    assert all(0 < t < 49 for r in a for t in r.prompt_token_ids)
    json.dumps([r.to_json() for r in a])


def test_poisson_arrivals_rate_and_release():
    reqs = sample_requests(FixedLengths(4, 4), 4000, vocab_size=100, seed=0)
    arr = PoissonArrivals(reqs, rate=50.0, seed=1)
    first = arr.release(0.0)
    assert len(first) == 1 and first[0].arrival_time == 0.0
    got = first + arr.release(1e9)
    times = np.array([r.arrival_time for r in got])
    assert np.all(np.diff(times) >= 0) and arr.done() and arr.next_arrival() is None
    assert abs(np.mean(np.diff(times)) - 1 / 50) < 0.002
    again = PoissonArrivals(reqs, rate=50.0, seed=1).release(1e9)
    assert [r.arrival_time for r in again] == list(times)


def test_closed_loop_keeps_concurrency():
    reqs = sample_requests(FixedLengths(4, 4), 5, vocab_size=100, seed=0)
    arr = ClosedLoopArrivals(reqs, concurrency=2)
    assert [r.id for r in arr.release(0.0)] == [reqs[0].id, reqs[1].id]
    assert arr.release(1.0) == [] and arr.next_arrival() is None
    arr.finished(2.0)
    nxt = arr.release(2.0)
    assert [r.id for r in nxt] == [reqs[2].id] and nxt[0].arrival_time == 2.0
    arr.finished(3.0), arr.finished(3.0)
    assert len(arr.release(3.0)) == 2 and arr.done()


def test_zipf_routing_contract_and_batch_independence():
    z = ZipfRouting(num_experts=16, top_k=4, s=1.2, seed=5)
    ids, w = z(3, None, ["a", "b", "c"], [10, 11, 12])
    assert ids.dtype == torch.int64 and w.dtype == torch.float32 and ids.shape == w.shape == (3, 4)
    assert all(len(set(row.tolist())) == 4 for row in ids)
    assert torch.allclose(w.sum(1), torch.ones(3))
    # A token's routing does not depend on which other tokens share its batch, nor on the instance.
    ids1, w1 = ZipfRouting(16, 4, s=1.2, seed=5)(3, None, ["b"], [11])
    assert torch.equal(ids1[0], ids[1]) and torch.equal(w1[0], w[1])
    ids2, _ = ZipfRouting(16, 4, s=1.2, seed=6)(3, None, ["a", "b", "c"], [10, 11, 12])
    assert not torch.equal(ids, ids2)


def test_zipf_skew_and_drift():
    z = ZipfRouting(num_experts=8, top_k=1, s=1.5, drift_every=100, seed=0)
    ids, _ = z(0, None, [f"r{i}" for i in range(4000)], [0] * 4000)
    counts = np.bincount(ids[:, 0].numpy(), minlength=8) / 4000
    p = z.popularity(0, step=0)
    assert np.abs(counts - p).max() < 0.03          # top-1 draws follow the Zipf popularity
    hot0, hot1 = int(p.argmax()), int(z.popularity(0, step=100).argmax())
    assert hot0 != hot1                               # the hot expert moved after one drift period
    assert z.popularity(0, 99).argmax() == hot0
    assert int(z.popularity(1, 0).argmax()) != hot0 or int(z.popularity(2, 0).argmax()) != hot0
    uniform = ZipfRouting(8, 1, s=0.0).popularity(0)
    assert np.allclose(uniform, 1 / 8)


@pytest.mark.parametrize("suffix", [".jsonl", ".npz"])
def test_record_then_replay_is_exact(tmp_path, suffix):
    rec = RoutingRecorder(ZipfRouting(num_experts=8, top_k=2, s=1.0, seed=1))
    keys = [(f"q{i % 3}", i) for i in range(9)]
    for layer in range(2):
        rec(layer, None, [k[0] for k in keys], [k[1] for k in keys])
    trace = RoutingTrace.load(rec.save(tmp_path / f"trace{suffix}"))
    assert len(trace) == 18 and trace.top_k == 2
    for layer in range(2):
        want = rec.router(layer, None, [k[0] for k in reversed(keys)], [k[1] for k in reversed(keys)])
        got = trace(layer, None, [k[0] for k in reversed(keys)], [k[1] for k in reversed(keys)])
        assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
    with pytest.raises(UserError, match="no entry"):
        trace(0, None, ["unknown"], [0])
    fb = RoutingTrace.load(tmp_path / f"trace{suffix}", fallback=ZipfRouting(8, 2, seed=9))
    ids, _ = fb(0, None, ["q0", "unknown"], [0, 0])
    assert ids.shape == (2, 2)


def test_bad_trace_file_is_a_user_error(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text('{"request": "a"}\n')
    with pytest.raises(UserError, match="t.jsonl:1"):
        RoutingTrace.load(p)
