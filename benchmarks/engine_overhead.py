"""Host CPU per batch spent by the engine itself (not the math): attention, expert, merge, sample.

Two in-process ranks (in-process transport, zero link delay, wall clock), a 2-layer MoE chain
with top-4 routing over 32 experts split evenly between the ranks, and a null executor whose
math is a few vectorized torch ops on [T, H] tensors (H = 64 by default, so copies are
negligible). Every request is homed on rank 0 and decodes in lock step, so rank 0 runs attention
batches of R rows, each rank an expert batch of 2R rows per layer, and rank 0 a sample batch of
R rows. Host time per batch = wall time of execute + complete; "recv" = one poll() of the
receptor (enqueueing routed rows on the expert owner, scattering expert outputs into the merge on
the home rank and forwarding completed segments; recv@r1 is the expert owner receiving routed
rows, recv@r0 the home receiving expert outputs). The executor's own time is measured by a
wrapper and reported separately, so "engine" = host - executor.

    python benchmarks/engine_overhead.py [--rows 64 256 1024] [--hidden 64] [--steps 12] [--count-calls]
                                         [--dispatch host|device]

--dispatch device: the device-routed dispatch (runtime/core/routed_rows.py): each attention batch goes whole to both
ranks (expert:N counts slots, T*k per home batch) and the home sums the two parts.
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from typing import Optional

import torch
from torch.overrides import TorchFunctionMode

from runtime.core.clock import WallClock
from runtime.core.engine import Engine, EngineConfig, StageInfo
from runtime.executors.base import ExecutorBase
from runtime.executors.torch_executor import row_blocks
from runtime.core.requests import Request
from runtime.core.routed_rows import ids_of, pack, payload_columns
from runtime.core.scheduler import make_policy
from runtime.transport.inproc import InprocHub

E, K, LAYERS, WORLD, VOCAB = 32, 4, 2, 2, 64


class TorchCalls(TorchFunctionMode):
    """Counts the torch calls (functions and Tensor methods, top level only) made while active and not
    paused: with `--count-calls`, the engine's own calls per batch (the executor's are paused). On the H200
    host each costs 25-90 us inside a serving loop (benchmarks/NOTES.md §20), so the count is the
    hardware-independent half of the engine's host cost there."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0
        self.paused = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            self.n += 1
        return func(*args, **(kwargs or {}))


CALLS: Optional[TorchCalls] = None  # set by run(count_calls=True)


class NullExecutor(ExecutorBase):
    """The executor interface with near-zero math: vectorized, deterministic, shape-correct."""

    supports_device_routing = True  # experts_routed() below

    def __init__(self, hidden: int, route_on_device: bool = False) -> None:
        self.H = hidden
        self.t = 0.0  # seconds spent inside executor calls
        self._n = 0
        self.route_on_device = route_on_device  # the engine follows it (device-routed dispatch)

    def _timed(self, f, *a):
        t0 = time.perf_counter()
        if CALLS is not None:
            CALLS.paused += 1
        try:
            return f(*a)
        finally:
            if CALLS is not None:
                CALLS.paused -= 1
            self.t += time.perf_counter() - t0

    def embed(self, token_ids):
        return self._timed(lambda: torch.zeros(len(token_ids), self.H))

    def attention(self, layer, h, positions, segments, kv):
        return self._timed(lambda: (h + 1.0, h * 0.5))

    def dense_mlp(self, layer, x):
        return torch.zeros_like(x)

    def route(self, layer, x):
        def f():
            T = x.shape[0]
            # row r, slot j -> expert (4r + j + layer) % E: slots alternate ranks (expert e on rank e % 2)
            ids = (torch.arange(T * K, dtype=torch.int64).view(T, K) + layer) % E
            return ids, torch.full((T, K), 1.0 / K)
        return self._timed(f)

    def routed_payload(self, layer, x):
        ids, w = self.route(layer, x)
        return pack(x, ids, w)  # (the CUDA executor's attention graph packs them so)

    def experts_routed(self, layer, payloads, owned, out=None):
        def f():  # per token: twice the row where any of its experts is held here (the weights sum to 1)
            sel = row_blocks([ids_of(p, K) for p in payloads]).to(torch.int64)
            x = row_blocks([p[:, :p.shape[1] - payload_columns(K, p.dtype)] for p in payloads])
            y = x * owned[sel].any(dim=1, keepdim=True) * 2.0
            return y if out is None else out.copy_(y)
        return self._timed(f)

    def shared_expert(self, layer, x):
        return None

    def experts(self, layer, x, expert_ids):
        return self._timed(lambda: row_blocks(x) * 2.0)

    def combine(self, h_res, shared, y, weights, row_index=None, feeds_attention=False):
        return self._timed(lambda: h_res + ((y if row_index is None else y[row_index]) * weights.unsqueeze(-1)).sum(1))

    def logits(self, h):
        return self._timed(lambda: h[:, :VOCAB] if h.shape[1] >= VOCAB else h.repeat(1, VOCAB)[:, :VOCAB])

    def sample(self, logits, params, step):
        return self._timed(lambda: int(torch.argmax(logits)))

    def sample_batch(self, logits, params, steps):
        return self._timed(lambda: torch.argmax(logits, dim=-1).tolist())


def config(rank: int, rows: int, max_new: int) -> EngineConfig:
    stages, sid = [], 0
    for layer in range(LAYERS):
        stages.append(StageInfo(sid, "attn", layer, sid + 1, max(rows, 256)))
        stages.append(StageInfo(sid + 1, "expert", layer, sid + 2, max(2 * rows, 1024)))
        sid += 2
    stages.append(StageInfo(sid, "sample", -1, 0, max(rows, 256)))
    return EngineConfig(rank=rank, world_size=WORLD, num_layers=LAYERS, top_k=K, stages=stages,
                        expert_rank=[[e % WORLD for e in range(E)] for _ in range(LAYERS)],
                        block_size=16, num_blocks=rows * (max_new // 16 + 2))


def run(rows: int, hidden: int, steps: int, warmup: int = 2, count_calls: bool = False, device_routed: bool = False) -> dict:
    """Per batch key: (median host us, median engine us, batches), or with `count_calls` the median number
    of the engine's torch calls per batch in place of both times (timings under the counter are not clean)."""
    global CALLS
    CALLS = TorchCalls() if count_calls else None
    if CALLS is not None:
        with CALLS:
            return _run(rows, hidden, steps, warmup, device_routed)
    return _run(rows, hidden, steps, warmup, device_routed)


def _run(rows: int, hidden: int, steps: int, warmup: int, device_routed: bool = False) -> dict:
    clock = WallClock()
    hub = InprocHub(WORLD, clock)
    ts = hub.transports()
    ex = NullExecutor(hidden, device_routed)
    engines = [Engine(config(r, rows, warmup + steps + 2), ex, ts[r], clock, policy=make_policy("flfs")) for r in range(WORLD)]
    for i in range(rows):
        engines[0].admit(Request(i, f"r{i}", [1], max_new_tokens=warmup + steps + 2, ignore_eos=True))
    host = defaultdict(list)
    engine_only = defaultdict(list)
    tokens_target = (warmup + steps) * rows
    while engines[0].metrics.tokens < tokens_target:
        measuring = engines[0].metrics.tokens >= warmup * rows
        progressed = False
        for e in engines:
            ex0, c0 = ex.t, CALLS.n if CALLS else 0
            t0 = time.perf_counter()
            n = e.poll()
            dt = time.perf_counter() - t0
            if n and measuring:
                key = f"recv@r{e.rank}"
                host[key].append(dt if CALLS is None else CALLS.n - c0)
                engine_only[key].append(dt - (ex.t - ex0) if CALLS is None else CALLS.n - c0)
            b = e.next_batch()
            if b is None:
                continue
            progressed = True
            ex0, c0 = ex.t, CALLS.n if CALLS else 0
            b0 = time.perf_counter()
            e.execute(b)
            e.complete(b)
            dt = time.perf_counter() - b0
            if measuring:
                key = f"{b.stage.kind}:{b.rows}@r{e.rank}"
                host[key].append(dt if CALLS is None else CALLS.n - c0)
                engine_only[key].append(dt - (ex.t - ex0) if CALLS is None else CALLS.n - c0)
        if not progressed and not any(len(q) for e in engines for q in e.queues) and not hub.in_flight():
            raise RuntimeError("stalled: " + "; ".join(e.state() for e in engines) + f" tokens={engines[0].metrics.tokens}")
    scale = 1e6 if CALLS is None else 1
    return {k: (statistics.median(v) * scale, statistics.median(engine_only[k]) * scale, len(v)) for k, v in host.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--count-calls", action="store_true",
                    help="also count the engine's torch calls per batch (a second pass under a TorchFunctionMode)")
    ap.add_argument("--dispatch", choices=["host", "device"], default="host")
    a = ap.parse_args()
    dev = a.dispatch == "device"
    torch.set_num_threads(1)
    calls_col = f" {'torch calls':>11}" if a.count_calls else ""
    print(f"{'R':>6} {'batch':>14} {'host us':>10} {'engine us':>10} {'us/row':>8} {'n':>4}{calls_col}")
    for R in a.rows:
        res = run(R, a.hidden, a.steps, device_routed=dev)
        calls = run(R, a.hidden, a.steps, count_calls=True, device_routed=dev) if a.count_calls else {}
        for key in sorted(res, key=lambda s: ({"attn": 0, "expert": 1, "recv": 2, "sample": 3}[s.split(":")[0].split("@")[0]], s)):
            h, eng, n = res[key]
            rows = int(key.split(":")[1].split("@")[0]) if ":" in key else 0
            per = f"{eng / rows:8.2f}" if rows else f"{'':>8}"
            c = f" {calls[key][1]:11.0f}" if key in calls else (f" {'-':>11}" if a.count_calls else "")
            print(f"{R:>6} {key:>14} {h:10.1f} {eng:10.1f} {per} {n:>4}{c}")


if __name__ == "__main__":
    main()
