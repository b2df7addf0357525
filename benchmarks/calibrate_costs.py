"""Measure a model's batch costs on this machine's device and write a cost profile for the virtual clock
(`python -m lab simulate --costs FILE`, or a bench config's `cost:` section).

    python benchmarks/calibrate_costs.py --model gpt-oss-120b --ranks 16 --device cuda --out h200-gpt-oss-120b.yaml
    python benchmarks/calibrate_costs.py --model tiny --ranks 4 --device cpu --out cpu-tiny.yaml

What one rank of an N-rank cluster runs, per stage batch, through the product's executor (the CUDA executor with
its graphs on a GPU, the torch executor on the CPU), on the model's layer shapes (cut to `--layers` layers; every
layer of a model has the same shape class) with random weights:
- attn: a decode batch of B rows at `--context` tokens of history, attention plus the router (the engine's
  attention stage);
- expert: N routed rows spread evenly over the experts one rank holds (E / ranks);
- sample: the logits of B rows and their greedy tokens.
Each kind is timed at several batch sizes (the device's time per back-to-back call, CUDA events on a GPU) and fitted
as fixed + per_row x rows by least squares, the cost model's form (runtime/executors/cost_model.py); the points
and the fit's worst relative error are written beside it. Message and collective costs need two devices: they are
copied from `--base` (default lab/costs/h200.yaml) and marked so.
"""
from __future__ import annotations

import argparse
import datetime
import socket
import sys
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from kernels_bench import time_eager  # noqa: E402  (median of rounds of back-to-back calls; CUDA events on a GPU)

ATTN_ROWS = (1, 8, 32, 128, 256)
EXPERT_ROWS = (1, 8, 32, 128, 512)
SAMPLE_ROWS = (1, 8, 32, 128, 256)
ROUNDS = 5  # timed rounds per point, the median kept (a shared host's other work lands in some rounds)
NOT_MEASURED = ("send_cpu_us", "overlap_host", "collective_algo", "collective_fixed_us", "collective_send_cpu_us")


def fit_affine(points: list[tuple[int, float]]) -> tuple[float, float, float]:
    """(fixed_s, per_row_s, worst relative error) of seconds ~ fixed + per_row x rows, both clamped at 0."""
    n = len(points)
    mx = sum(r for r, _ in points) / n
    my = sum(s for _, s in points) / n
    var = sum((r - mx) ** 2 for r, _ in points)
    slope = max(0.0, sum((r - mx) * (s - my) for r, s in points) / var) if var else 0.0
    fixed = max(0.0, my - slope * mx)
    worst = max(abs(fixed + slope * r - s) / s for r, s in points)
    return fixed, slope, worst


def build(args):
    from graph_ir.spec import cut_layers, load_spec
    from models.weights import random_weights
    spec = load_spec(ROOT / "models/specs" / f"{args.model}.yaml")
    spec = cut_layers(spec, min(args.layers, spec.num_layers))
    dev = torch.device(args.device)
    E = spec.experts.num_experts
    held = list(range(max(1, E // args.ranks)))          # what one rank of `ranks` holds (contiguous placement)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    w = random_weights(spec, 0, device=dev, dtype=dtype, experts=[held] * spec.num_layers)
    if dev.type == "cuda":
        from runtime.executors.cuda_executor import CudaExecutor
        ex = CudaExecutor(spec, w, None, dev, graphs=True, max_context=args.context + 64)
    else:
        from runtime.executors.torch_executor import TorchExecutor
        ex = TorchExecutor(spec, w)
    return spec, dev, dtype, held, ex


def measure(args) -> dict:
    from runtime.core.kv_cache import BlockAllocator, PagedKVStore
    spec, dev, dtype, held, ex = build(args)
    H, block = spec.hidden_size, 16
    points: dict[str, list] = {"attn": [], "expert": [], "sample": []}
    biggest = max(ATTN_ROWS)
    kv = PagedKVStore(spec.num_layers, BlockAllocator(biggest * (args.context // block + 4), block))
    for sid in range(biggest):
        kv.reserve(sid, args.context + 8)
    ex.prepare(kv)
    for B in ATTN_ROWS:
        h = torch.randn(B, H, device=dev, dtype=dtype)
        positions, segs = [args.context] * B, [(sid, sid, 1) for sid in range(B)]

        def attn_call():
            _, x = ex.attention(0, h, positions, segs, kv)   # the same KV slot rewritten: timing, not serving
            return ex.route(0, x)
        points["attn"].append((B, time_eager(attn_call, dev, args.iters, ROUNDS)))
    ex.detach(kv)
    for N in EXPERT_ROWS:
        x = torch.randn(N, H, device=dev, dtype=dtype) * 0.5
        ids = [held[i % len(held)] for i in range(N)]
        points["expert"].append((N, time_eager(lambda: ex.experts(0, x, ids), dev, args.iters, ROUNDS)))
    for B in SAMPLE_ROWS:
        h = torch.randn(B, H, device=dev, dtype=dtype)
        points["sample"].append((B, time_eager(lambda: ex.sample_batch(ex.logits(h), [None] * B, [0] * B),
                                               dev, args.iters, ROUNDS)))
    return {"spec": spec, "held": len(held), "points": points}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt-oss-120b", help="shipped spec name (models/specs/NAME.yaml)")
    ap.add_argument("--ranks", type=int, default=16, help="cluster size: one rank holds experts / ranks experts")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--context", type=int, default=512, help="tokens of history per decode row")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--iters", type=int, default=20, help="calls per timed round (5 rounds, median)")
    ap.add_argument("--base", type=Path, default=ROOT / "lab/costs/h200.yaml", help="profile for what is not measured")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--threads", type=int, default=1, help="CPU: torch threads (a CPU rank process runs with few)")
    args = ap.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    m = measure(args)
    base = yaml.safe_load(args.base.read_text())
    profile, lines = {}, []
    for kind, pts in m["points"].items():
        fixed, per_row, worst = fit_affine(pts)
        profile[f"{kind}_fixed_us"] = round(fixed * 1e6, 2)
        profile[f"{kind}_per_row_us"] = round(per_row * 1e6, 4)
        lines.append(f"# {kind}: rows -> us " + ", ".join(f"{r}: {s * 1e6:.1f}" for r, s in pts)
                     + f" (affine fit's worst relative error {worst:.0%})")
    profile.update({k: base[k] for k in NOT_MEASURED if k in base})
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    head = [f"# Cost profile measured by benchmarks/calibrate_costs.py, {datetime.date.today()}, on {name} "
            f"({socket.gethostname()}, torch {torch.__version__})",
            f"#   {' '.join(sys.argv)}",
            f"# {m['spec'].name}: one rank of {args.ranks} holding {m['held']} experts, {args.context} tokens of context",
            *lines, f"# not measured (copied from {args.base.name}): {', '.join(NOT_MEASURED)}"]
    args.out.write_text("\n".join(head) + "\n" + yaml.safe_dump(profile, sort_keys=False))
    print(args.out.read_text())


if __name__ == "__main__":
    main()
