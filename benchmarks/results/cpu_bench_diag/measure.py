"""Diagnosis helper for benchmarks/results/cpu_bench.md (run from the repo root with the venv)."""
import sys, time, statistics as st, torch
ROOT = __import__("pathlib").Path(__file__).resolve().parents[3]; sys.path.insert(0, str(ROOT))
torch.set_num_threads(1)
from graph_ir.spec import load_spec
from models.weights import random_weights
from runtime.executors.torch_executor import TorchExecutor
from runtime.core.kv_cache import BlockAllocator, PagedKVStore
spec = load_spec(f"{ROOT}/models/specs/tiny.yaml"); w = random_weights(spec); ex = TorchExecutor(spec, w)
def tm(f, n=30):
    f(); ts=[]
    for _ in range(n):
        t=time.perf_counter(); f(); ts.append(time.perf_counter()-t)
    return st.median(ts)*1e6
ctx = 100
for T in (1, 8, 32, 128):
    kv = PagedKVStore(spec.num_layers, BlockAllocator(4096, 16))
    for r in range(T): kv.reserve(r, ctx+8)
    # prefill K/V of ctx positions for each seq at layer 0
    h = torch.randn(T*ctx, spec.hidden_size)
    segs = [(r, r*ctx, ctx) for r in range(T)]
    ex.attention(0, h, [p for r in range(T) for p in range(ctx)], segs, kv)
    hd = torch.randn(T, spec.hidden_size)
    a = tm(lambda: ex.attention(0, hd, [ctx]*T, [(r, r, 1) for r in range(T)], kv))
    x = torch.randn(T*2, spec.hidden_size)
    e = tm(lambda: ex.experts(0, x, [i % 2 for i in range(T*2)]))
    r_ = tm(lambda: ex.route(0, hd))
    s_ = tm(lambda: [ex.sample(l, None, 0) for l in ex.logits(hd)])
    print(f"T={T:4d}: attention(ctx {ctx}) {a:7.0f} us  route {r_:5.0f} us  experts({2*T} rows, 2 experts) {e:6.0f} us  logits+sample {s_:6.0f} us")
