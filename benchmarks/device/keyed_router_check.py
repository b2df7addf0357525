"""Device check of the in-graph Zipf router (runtime/experiments/zipf_torch.py): `python3 benchmarks/device/keyed_router_check.py`.

(1) Bits: the host router (numba, glibc logarithms) against route_torch on the GPU (the device's
    logarithms) for 200,000 random (request, position, layer) keys, with GPT-OSS-20B's (32 experts,
    top-4) and GPT-OSS-120B's (128, top-4) shapes: rows whose expert ids differ, weights that differ,
    the largest weight difference. On the CPU both are bit-equal (tests/test_keyed_router_graph.py).
(2) Served: the tiny model in fp32 on one GPU (CUDA graphs, virtual clock) routed in the graph and on
    the host: requests whose tokens are equal.
Prints one line per result.
"""
from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from runtime.experiments.routing_override import ZipfRouting  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a dry run of this script (bit-equal there)


def bits(E: int, k: int, n: int = 200_000) -> str:
    z = ZipfRouting(E, k, s=1.2, seed=0)
    rng = np.random.default_rng(E)
    reqs = [int(r) for r in rng.integers(0, 4096, n)]
    pos = [int(p) for p in rng.integers(0, 4096, n)]
    bad_ids = bad_w = 0
    dmax = 0.0
    for layer in range(4):
        ids, w = z(layer, None, reqs, pos)
        base = torch.tensor([z.request_base(r) for r in reqs], device=DEV)
        ids2, w2 = z.route_torch(layer, base, torch.tensor(pos, device=DEV))
        ids2, w2 = ids2.cpu(), w2.cpu()
        bad_ids += int((ids != ids2).any(dim=1).sum())
        bad_w += int((w != w2).any(dim=1).sum())
        dmax = max(dmax, float((w - w2).abs().max()))
    return (f"bits E={E} k={k}: {4 * n} tokens, rows with other expert ids {bad_ids}, rows with other weights "
            f"{bad_w}, max |weight difference| {dmax:.3g}")


def served() -> str:
    from graph_ir.spec import load_spec
    from lowering.plan import compile_plan
    from models.weights import random_weights
    from runtime.cluster import RunOptions, run_workload
    from runtime.requests import Request
    spec = load_spec("models/specs/tiny-gpt-oss.yaml")
    w = random_weights(spec)
    plan = compile_plan(spec, 2, DEV)
    out = {}
    for where in ("graph", "host"):
        os.environ["DATAFLOW_KEYED_ROUTER"] = where
        g = random.Random(7)
        reqs = [Request(i, f"r{i}", [g.randrange(3, spec.vocab_size) for _ in range(g.choice([1, 1, 5, 9]))], 12,
                        ignore_eos=True, arrival=0.0) for i in range(24)]
        res = run_workload(plan, reqs, RunOptions(policy="defrag", executor="cuda", kv_blocks=128, clock="virtual",
                                                  router=ZipfRouting(spec.experts.num_experts, spec.experts.top_k,
                                                                     s=1.2)), weights=w)
        out[where] = {r.rid: list(r.output) for r in res.requests}
    os.environ.pop("DATAFLOW_KEYED_ROUTER")
    same = sum(out["graph"][r] == out["host"][r] for r in out["host"])
    return f"served tiny fp32 on {DEV}: requests with equal tokens, Zipf router in the graph vs on the host {same}/{len(out['host'])}"


if __name__ == "__main__":
    for line in (bits(32, 4), bits(128, 4), served()):
        print(line, flush=True)
