"""The synthetic Zipf router inside the attention graph (lab/zipf_torch.py,
CudaExecutor.use_keyed_router) against the host router it replaces: the same bits for every token,
in the bucketed decode body and in the eager path, and the same tokens and routing in a served run."""
from __future__ import annotations

import random
from functools import partial

import numpy as np
import pytest
import torch

from graph_ir.spec import load_spec
from lowering.plan import compile_plan
from models.weights import random_weights
from runtime.drivers.cluster import RunOptions, run_workload
from runtime.executors.cuda_executor import CudaExecutor
from lab.routing_override import KeyedRoutingExecutor, RoutedBy, ZipfRouting, routed
from lab.zipf_torch import splitmix64
from runtime.core.requests import Request

torch.set_num_threads(1)


def test_splitmix64_on_int64_bits_equals_the_uint64_one():
    from lab.routing_override import _splitmix64_inplace
    z = np.random.default_rng(0).integers(0, 2**63, 1000, dtype=np.int64).view(np.uint64) * np.uint64(3)
    want = _splitmix64_inplace(z.copy()).view(np.int64)
    got = splitmix64(torch.from_numpy(z.view(np.int64).copy())).numpy()
    assert (got == want).all()


@pytest.mark.parametrize("E,k,drift_every", [(32, 4, 0), (128, 4, 50), (8, 8, 0), (128, 8, 7)])
def test_route_torch_equals_the_host_router_bit_for_bit(E, k, drift_every):
    z = ZipfRouting(E, k, s=1.2, drift_every=drift_every, drift_stride=3, seed=4)
    rng = np.random.default_rng(E + k + drift_every)
    reqs = [f"r{i}" if i % 2 else int(i) for i in rng.integers(0, 300, 2000)]   # str and int request ids
    pos = [int(p) for p in rng.integers(0, 5000, 2000)]
    for layer in (0, 5):
        ids, w = z(layer, None, reqs, pos)
        ids2, w2 = z.route_torch(layer, torch.tensor([z.request_base(r) for r in reqs]), torch.tensor(pos))
        assert ids2.dtype == torch.int64 and w2.dtype == torch.float32
        assert torch.equal(ids, ids2) and torch.equal(w, w2)


_TRITON_CHECK = """
import numpy as np, torch
from lab.routing_override import ZipfRouting
from lab.zipf_torch import zipf_route
for E, k, drift in [(32, 4, 0), (128, 4, 50), (8, 8, 0), (128, 8, 7), (5, 2, 3)]:
    z = ZipfRouting(E, k, s=1.2, drift_every=drift, drift_stride=3, seed=4)
    rng = np.random.default_rng(E + k + drift)
    reqs = [f"r{i}" if i % 2 else int(i) for i in rng.integers(0, 300, 300)]
    pos = [int(p) for p in rng.integers(0, 5000, 300)]
    base = torch.tensor([z.request_base(r) for r in reqs])
    for layer in (0, 1, 5):   # 1: a value Triton specializes as a constant on the GPU
        ids, w = z(layer, None, reqs, pos)                      # the host router
        ids2, w2 = z.route_torch(layer, base, torch.tensor(pos))  # DATAFLOW_KERNELS=triton: the kernel
        assert torch.equal(ids, ids2) and torch.equal(w, w2), (E, k, drift, layer)
        neg = torch.tensor(rng.integers(-40, 40, 300))          # padded rows carry position -1
        t = torch.from_numpy(z._table(layer))
        a, b = zipf_route(base, neg, layer, t, k, drift_every=drift, drift_stride=3), z.route_torch(layer, base, neg)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), (E, k, drift, layer, "negative positions")
print("ok")
"""


def test_the_triton_router_kernel_draws_the_same_bits():
    """lab/zipf_triton.py in Triton's CPU interpreter (a subprocess: Triton fixes the
    mode at import) against the host router and its torch twin, incl. negative (padded) positions."""
    pytest.importorskip("triton")
    import os
    import subprocess
    import sys
    env = dict(os.environ, TRITON_INTERPRET="1", DATAFLOW_KERNELS="triton")
    r = subprocess.run([sys.executable, "-c", _TRITON_CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


def _requests(spec, n=8, seed=3):
    g = random.Random(seed)
    # one-token prompts take the bucketed decode body from step 0; longer ones the eager path first
    return [Request(i, f"r{i}", [g.randrange(3, spec.vocab_size) for _ in range(g.choice([1, 1, 4, 9]))], 5,
                    ignore_eos=True, arrival=0.0) for i in range(n)]


def _served(where: str, monkeypatch):
    """Tokens and every routing decision the engines saw (layer, ids, weights), in call order: the router in the
    attention graph (`RoutedBy`, as every bench runs it) or on the host (KeyedRoutingExecutor around the executor)."""
    spec = load_spec("models/specs/tiny-gpt-oss.yaml")
    w = random_weights(spec)
    plan = compile_plan(spec, 2)
    seen = []
    # Whoever answers the engine (route_arrays, numpy arrays or tensors): the executor itself (graph), or the wrapper
    # that calls the router (host).
    answers, method = (CudaExecutor if where == "graph" else KeyedRoutingExecutor), "route_arrays"
    real = getattr(answers, method)

    def spy(self, layer, x):
        ids, wts = real(self, layer, x)
        seen.append((layer, torch.as_tensor(ids).clone(), torch.as_tensor(wts).clone()))
        return ids, wts
    monkeypatch.setattr(answers, method, spy)
    router = ZipfRouting(spec.experts.num_experts, spec.experts.top_k, s=1.2)
    wrapper = RoutedBy(router) if where == "graph" else partial(KeyedRoutingExecutor, router=router)
    res = run_workload(plan, _requests(spec), RunOptions(policy="defrag", executor="cuda", kv_blocks=64,
                                                         clock="virtual", executor_wrapper=wrapper),
                       weights=w)
    return {r.rid: list(r.output) for r in res.requests}, seen


def test_served_run_routes_and_generates_the_same_in_graph_as_on_host(monkeypatch):
    toks_g, seen_g = _served("graph", monkeypatch)
    monkeypatch.undo()
    toks_h, seen_h = _served("host", monkeypatch)
    assert toks_g == toks_h and all(len(t) == 5 for t in toks_g.values())
    assert len(seen_g) == len(seen_h) > 0
    for (lg, ig, wg), (lh, ih, wh) in zip(seen_g, seen_h):
        assert lg == lh and torch.equal(ig, ih) and torch.equal(wg, wh)


def test_routed_picks_the_graph_only_where_both_sides_can():
    spec = load_spec("models/specs/tiny-gpt-oss.yaml")
    ex = CudaExecutor(spec, random_weights(spec), device="cpu")
    z = ZipfRouting(spec.experts.num_experts, spec.experts.top_k, s=1.0)
    assert routed(ex, z) is ex and ex.keyed_router is z  # in the graph
    other = CudaExecutor(spec, random_weights(spec), device="cpu")
    assert isinstance(routed(other, lambda *a: None), KeyedRoutingExecutor)  # no route_torch: host
    assert other.keyed_router is None
