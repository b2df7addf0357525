"""Device check of the in-graph Zipf router: `python3 benchmarks/device/keyed_router_check.py`.

(1) Bits: the host router (numba, glibc logarithms) against the device draws for 200,000 random
    (request, position, layer) keys, with GPT-OSS-20B's (32 experts, top-4) and GPT-OSS-120B's (128,
    top-4) shapes, both ways: torch ops (lab/zipf_torch.py) and the one Triton kernel
    (zipf_triton.py, the GPU default): rows whose expert ids differ, weights that differ, the largest
    weight difference, and the kernel's rows that differ from the torch draw. On the CPU all are
    bit-equal (tests/test_keyed_router_graph.py).
(2) Timing: device time of one 192-row draw each way, replayed from a CUDA graph, and of a learned router
    (linear + top-k + softmax, GPT-OSS's shape) on the same rows (`--timing`: only this).
(3) Served: the tiny model in fp32 on one GPU (CUDA graphs, virtual clock) routed in the graph and on
    the host: requests whose tokens are equal.
Prints one line per result.
"""
from __future__ import annotations

import os
import random
import sys
from functools import partial
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lab.routing_override import KeyedRoutingExecutor, RoutedBy, ZipfRouting  # noqa: E402
from lab.zipf_torch import zipf_route  # noqa: E402
from lab.zipf_triton import zipf_route_triton  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a dry run of this script (bit-equal there)


_TABLES: dict = {}


def _draws(z, layer, base, pos, only=None):
    """The device draw both ways (or only one): torch ops (zipf_torch.py) and the one Triton kernel
    (zipf_triton.py)."""
    t = _TABLES.get((id(z), layer))
    if t is None:  # uploaded once, before any capture (a pageable copy cannot be captured)
        t = _TABLES[(id(z), layer)] = torch.from_numpy(z._table(layer)).to(base.device)
    kw = dict(drift_every=z.drift_every, drift_stride=z.drift_stride)
    out = {}
    if only in (None, "torch"):
        out["torch"] = zipf_route(base, pos, layer, t, z.top_k, **kw)
    if only in (None, "triton") and (DEV == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"):
        out["triton"] = zipf_route_triton(base, pos, layer, t, z.top_k, **kw)
    return out


def bits(E: int, k: int, n: int = 200_000) -> list[str]:
    z = ZipfRouting(E, k, s=1.2, seed=0)
    rng = np.random.default_rng(E)
    reqs = [int(r) for r in rng.integers(0, 4096, n)]
    pos = [int(p) for p in rng.integers(0, 4096, n)]
    bad: dict = {}
    for layer in range(4):
        ids, w = z(layer, None, reqs, pos)
        base = torch.tensor([z.request_base(r) for r in reqs], device=DEV)
        draws = _draws(z, layer, base, torch.tensor(pos, device=DEV))
        for name, (ids2, w2) in draws.items():
            ids2, w2 = ids2.cpu(), w2.cpu()
            b = bad.setdefault(name, [0, 0, 0.0, 0])
            b[0] += int((ids != ids2).any(dim=1).sum())
            b[1] += int((w != w2).any(dim=1).sum())
            b[2] = max(b[2], float((w - w2).abs().max()))
            if name == "triton":  # the kernel against the torch draw on the same device (same logarithms?)
                a_ids, a_w = draws["torch"]
                b[3] += int(((a_ids.cpu() != ids2) | (a_w.cpu() != w2)).any(dim=1).sum())
    return [f"bits E={E} k={k} {name} draw on {DEV} vs host: {4 * n} tokens, rows with other expert ids {b[0]}, "
            f"rows with other weights {b[1]}, max |weight difference| {b[2]:.3g}"
            + (f"; rows differing from the torch draw {b[3]}" if name == "triton" else "")
            for name, b in bad.items()]


def timing(E: int, k: int, T: int = 192, reps: int = 500) -> str:
    """Device time of one draw for a T-row attention batch, each way, captured in a CUDA graph as the
    executor runs it (replays timed with events)."""
    if DEV != "cuda":
        return f"timing E={E}: skipped on {DEV}"
    z = ZipfRouting(E, k, s=1.2, seed=0)
    base = torch.randint(-2**62, 2**62, (T,), device=DEV)
    pos = torch.randint(0, 4096, (T,), device=DEV)
    # what a learned router costs on the same rows (GPT-OSS: a linear layer to E logits, top-k, softmax of the k)
    x = torch.randn(T, 2880, device=DEV, dtype=torch.bfloat16)
    w, b = torch.randn(E, 2880, device=DEV, dtype=torch.bfloat16), torch.randn(E, device=DEV, dtype=torch.bfloat16)

    def learned():
        vals, ids = torch.topk(torch.nn.functional.linear(x, w, b), k, dim=-1)
        return ids, torch.softmax(vals.float(), dim=-1)
    res = []
    for name in ("torch", "triton", "learned"):
        def draw():
            return learned() if name == "learned" else _draws(z, 3, base, pos, only=name)[name]
        for _ in range(3):
            draw()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            draw()
        g.replay()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(reps):
            g.replay()
        stop.record()
        torch.cuda.synchronize()
        res.append(f"{name} {start.elapsed_time(stop) * 1000 / reps:.1f} us")
    return f"timing E={E} k={k} T={T}, one draw in a CUDA graph: " + ", ".join(res)


def served() -> str:
    from graph_ir.spec import load_spec
    from lowering.plan import compile_plan
    from models.weights import random_weights
    from runtime.drivers.cluster import RunOptions, run_workload
    from runtime.core.requests import Request
    spec = load_spec("models/specs/tiny-gpt-oss.yaml")
    w = random_weights(spec)
    plan = compile_plan(spec, 2, DEV)
    out = {}
    for where in ("graph", "host"):
        router = ZipfRouting(spec.experts.num_experts, spec.experts.top_k, s=1.2)
        wrapper = RoutedBy(router) if where == "graph" else partial(KeyedRoutingExecutor, router=router)
        g = random.Random(7)
        reqs = [Request(i, f"r{i}", [g.randrange(3, spec.vocab_size) for _ in range(g.choice([1, 1, 5, 9]))], 12,
                        ignore_eos=True, arrival=0.0) for i in range(24)]
        res = run_workload(plan, reqs, RunOptions(policy="defrag", executor="cuda", kv_blocks=128, clock="virtual",
                                                  executor_wrapper=wrapper), weights=w)
        out[where] = {r.rid: list(r.output) for r in res.requests}
    same = sum(out["graph"][r] == out["host"][r] for r in out["host"])
    return f"served tiny fp32 on {DEV}: requests with equal tokens, Zipf router in the graph vs on the host {same}/{len(out['host'])}"


if __name__ == "__main__":
    checks = [lambda: bits(32, 4), lambda: bits(128, 4), lambda: [timing(32, 4)], lambda: [timing(128, 4)],
              lambda: [served()]]
    if sys.argv[1:] == ["--timing"]:  # only the device times
        checks = checks[2:4]
    for check in checks:
        for line in check():  # printed as each check ends: a later failure keeps the earlier lines
            print(line, flush=True)
