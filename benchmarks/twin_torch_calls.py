"""Torch calls per attention batch on the streaming engine's routing and dispatch path, counted on the CUDA
executor's CPU twin: `python benchmarks/twin_torch_calls.py`.

On the H200 host a torch call inside the serving loop costs 10-25 us (benchmarks/NOTES.md §20), so the count
is the hardware-free half of a host-path change's cost: a served run of the tiny GPT-OSS model (2 in-process
ranks, 16 one-token requests, 8 new tokens each), with the calls made inside CudaExecutor.route /
route_arrays (reading the routing), CudaExecutor.attention (the executor's host side of an attention
batch: staging, copies, the graph launch counted as one call, not the body the CPU twin runs eagerly) and
Engine._complete_attn (the dispatch) counted per attention batch, and CudaExecutor.experts (the host side of an
expert batch) per expert batch. With DATAFLOW_DISPATCH=device the device-routed path instead: routed_payload,
_complete_attn's routed dispatch and experts_routed. Per sample batch: CudaExecutor.logits (the sample graph's
host side since session 11) and sample_batch_start.
The twin's dispatch takes the CPU branch of the merge (no packed upload), so the CUDA path's count differs
by the upload's calls; the routing read is the same code.
"""
from __future__ import annotations

import collections
import random
import sys
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from graph_ir.spec import load_spec  # noqa: E402
from lowering.plan import compile_plan  # noqa: E402
from models.weights import random_weights  # noqa: E402
from runtime.drivers.cluster import RunOptions, run_workload  # noqa: E402
from runtime.executors.capture import StepGraph  # noqa: E402
from runtime.core.engine import Engine  # noqa: E402
from runtime.executors.cuda_executor import CudaExecutor  # noqa: E402
from runtime.core.requests import Request  # noqa: E402


def _is_attribute_read(func) -> bool:
    return getattr(func, "__qualname__", "").startswith("getset_descriptor.")


class _Count(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.where, self.n = None, collections.Counter()
        self.samples = 0  # sample batches (CudaExecutor.logits calls)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # Attribute reads (x.shape, x.dtype: getset descriptors, ~0.1 us) are not counted; counts recorded before
        # session 9 included them.
        if self.where and not _is_attribute_read(func):
            self.n[self.where] += 1
        return func(*args, **(kwargs or {}))


def main() -> None:
    torch.set_num_threads(1)
    count = _Count()
    real_run = StepGraph.run

    def run(self):  # on the GPU one replay call; the twin runs the body's math here: not counted
        where, count.where = count.where, None
        try:
            if where is not None:
                count.n[where] += 1
            return real_run(self)
        finally:
            count.where = where
    StepGraph.run = run
    for cls, name in ((Engine, "_complete_attn"), (CudaExecutor, "route"), (CudaExecutor, "route_arrays"),
                      (CudaExecutor, "routed_payload"), (CudaExecutor, "attention"), (CudaExecutor, "experts"),
                      (CudaExecutor, "experts_routed"), (CudaExecutor, "logits"),
                      (CudaExecutor, "sample_batch_start")):
        real = getattr(cls, name, None)
        if real is None:
            continue

        def wrapped(self, *a, real=real, name=name, **kw):
            if name == "logits":
                count.samples += 1
            outer, count.where = count.where, count.where or name  # the outermost counted call owns its calls
            try:
                return real(self, *a, **kw)
            finally:
                count.where = outer
        setattr(cls, name, wrapped)
    spec = load_spec("models/specs/tiny-gpt-oss.yaml")
    g = random.Random(1)
    reqs = [Request(i, f"r{i}", [g.randrange(3, spec.vocab_size)], 8, ignore_eos=True, arrival=0.0) for i in range(16)]
    with count:
        res = run_workload(compile_plan(spec, 2), reqs, RunOptions(policy="defrag", executor="cuda", kv_blocks=64),
                           weights=random_weights(spec))
    n, ne = res.metrics["attn_batches"], res.metrics["expert_batches"]
    print(f"{n} attention batches, {ne} expert batches; torch calls per batch: "
          + ", ".join(f"{k} {v / (ne if k.startswith('experts') else count.samples if k in ('logits', 'sample_batch_start') else n):.1f}"
                      for k, v in sorted(count.n.items()))
          + f" (logits and sample_batch_start: per sample batch, {count.samples} of them)")


if __name__ == "__main__":
    main()
