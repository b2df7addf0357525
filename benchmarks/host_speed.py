"""Host cost of the operations a streaming rank's loop is made of, one line each, on this machine.

A streaming rank on 2 x H200 is host-bound (its GPU is busy ~10-30% of the time), and its phase
timers there are 5-15x this CPU's engine_overhead.py numbers. This script prices the building blocks
(a Python loop iteration, a small numpy call, the Zipf router, a pickle round trip of a message header,
and on CUDA: an allocation, a small kernel launch, a pinned non-blocking copy, an event record/query, a
graph replay, a Triton launch) so a batch's host time can be read as "ops x cost", and the device host
compared with this one: run it on both.

    python benchmarks/host_speed.py [--reps 2000]
"""
from __future__ import annotations

import argparse
import pickle
import statistics
import time

import numpy as np
import torch


def per_call_us(f, reps: int, inner: int = 1) -> float:
    """Median over 5 rounds of the mean host time of one call (no device synchronization inside)."""
    f()
    rounds = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(reps):
            f()
        rounds.append((time.perf_counter() - t) / (reps * inner) * 1e6)
    return statistics.median(rounds)


def cpu_rows(reps: int) -> list[tuple[str, float]]:
    from lab.routing_override import ZipfRouting

    rows = []
    xs = list(range(256))
    rows.append(("python: 256-iteration list loop (per loop)", per_call_us(lambda: [v + 1 for v in xs], reps)))
    a = np.arange(256, dtype=np.int64)
    rows.append(("numpy: a + 1 on 256 int64", per_call_us(lambda: a + 1, reps)))
    rows.append(("numpy: argsort(stable) of 1024 int64", per_call_us(lambda: np.argsort(a.repeat(4), kind="stable"), reps)))
    t = torch.arange(1024)
    rows.append(("torch cpu: from_numpy(a).to(int32)", per_call_us(lambda: torch.from_numpy(a).to(torch.int32), reps)))
    rows.append(("torch cpu: t[10:200] (a view)", per_call_us(lambda: t[10:200], reps)))
    meta = {"t": 1, "layer": 3, "home": 0, "rows": np.arange(400, dtype=np.int64), "e": np.arange(400) % 32,
            "more": 12.5}
    rows.append(("pickle dumps+loads of an expert-in header (400 rows)",
                 per_call_us(lambda: pickle.loads(pickle.dumps((0, 1, 7, meta, (400, 2880), "bfloat16"),
                                                               protocol=5)), reps)))
    z = ZipfRouting(32, 4, s=1.2)
    rids = [f"r{i}" for i in range(192)]
    pos = list(range(100, 292))
    rows.append(("ZipfRouting(32 experts, k=4) of 192 rows", per_call_us(lambda: z(3, None, rids, pos), max(1, reps // 4))))
    return rows


def cuda_rows(reps: int) -> list[tuple[str, float]]:
    dev = torch.device("cuda")
    rows = []
    x = torch.randn(256, 2880, dtype=torch.bfloat16, device=dev)
    idx = torch.arange(0, 256, 2, device=dev)
    pinned = torch.arange(1024, dtype=torch.int64).pin_memory()
    dst = torch.empty(1024, dtype=torch.int64, device=dev)
    ev = torch.cuda.Event()
    rows.append(("cuda: torch.empty [256, 2880] bf16 (caching allocator)",
                 per_call_us(lambda: torch.empty(256, 2880, dtype=torch.bfloat16, device=dev), reps)))
    rows.append(("cuda: x.index_select(0, idx) launch", per_call_us(lambda: x.index_select(0, idx), reps)))
    rows.append(("cuda: x[:128].clone() launch", per_call_us(lambda: x[:128].clone(), reps)))
    rows.append(("cuda: torch.cat of two halves", per_call_us(lambda: torch.cat([x[:100], x[100:]]), reps)))
    rows.append(("cuda: pinned -> device copy_(non_blocking)", per_call_us(lambda: dst.copy_(pinned, non_blocking=True), reps)))
    rows.append(("cuda: event.record()", per_call_us(lambda: ev.record(), reps)))
    ev.record()
    torch.cuda.synchronize()
    rows.append(("cuda: event.query() of a completed event", per_call_us(ev.query, reps)))
    rows.append(("cuda: torch.cuda.current_stream()", per_call_us(torch.cuda.current_stream, reps)))
    y = torch.empty_like(x)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        y.copy_(x * 2)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        for _ in range(40):  # a layer's worth of small kernels in one graph
            y.mul_(1.0001)
    rows.append(("cuda: graph replay (40 small kernels)", per_call_us(g.replay, max(1, reps // 4))))
    try:
        from dataflow_kernels.topk_merge import topk_merge
        h = torch.randn(192, 2880, dtype=torch.bfloat16, device=dev)
        ys = torch.randn(192 * 4, 2880, dtype=torch.bfloat16, device=dev)
        ri = torch.arange(192 * 4, device=dev).view(192, 4)
        w = torch.rand(192, 4, device=dev)
        rows.append(("cuda: topk_merge (Triton launch, 192 rows)", per_call_us(lambda: topk_merge(h, None, ys, ri, w), max(1, reps // 4))))
    except Exception as err:  # noqa: BLE001 - a missing Triton is a line of the report, not a failure
        rows.append((f"cuda: topk_merge unavailable ({type(err).__name__})", float("nan")))
    torch.cuda.synchronize()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=2000)
    args = ap.parse_args()
    rows = cpu_rows(args.reps)
    if torch.cuda.is_available():
        rows += cuda_rows(args.reps)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads")
    for name, us in rows:
        print(f"{us:9.2f} us  {name}")


if __name__ == "__main__":
    main()
