"""What benchmarks/gpu_bench.py's sections share (and benchmarks/arrivals_bench.py): progress lines since the bench
started, a device sync, percentiles and dropping an executor's captured graphs of finished KV stores. Imported first:
without CUDA it turns on Triton's interpreter before anything imports triton, and puts the repository on sys.path.
(The models they run are lab/barrier_dist.py's recipe: cut_spec, device_weights.)"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton's own switch, read at its first import
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def detach_all(ex, cluster_or_kvs) -> None:
    inner = getattr(ex, "_inner", ex)
    kvs = [e.kv for e in cluster_or_kvs.engines] if hasattr(cluster_or_kvs, "engines") else cluster_or_kvs
    for kv in kvs:
        inner.detach(kv)
