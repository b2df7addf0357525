"""Diagnosis helper for benchmarks/results/cpu_bench.md (run from the repo root with the venv)."""
import sys, collections, statistics as st
ROOT = __import__("pathlib").Path(__file__).resolve().parents[3]; sys.path.insert(0, str(ROOT))
from lab.bench import load_config, _requests, _router, BenchConfig
from lab.interference import from_config
from dataflow.cmd_compile import resolve_model
from lowering.plan import compile_plan
from runtime.executors.sim_executor import SimExecutor
from lab.routing_override import KeyedRoutingExecutor
from runtime.drivers.cluster import Cluster, RunOptions
from runtime.transport.inproc import InprocHub
cfg = load_config(f"{ROOT}/benchmarks/cpu_bench.yaml")
pol, kv, nreq = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
d = cfg.model_dump(); d["kv_blocks"]=kv; d["workload"]["requests"]=nreq; d["workload"]["rate"]=1e6
cfg = BenchConfig.model_validate(d)
spec, _ = resolve_model(cfg.model); plan = compile_plan(spec, cfg.ranks)
router = _router(cfg, spec); ex = KeyedRoutingExecutor(SimExecutor.for_spec(spec, seed=0), router)
reqs = _requests(cfg, spec); inter = from_config(cfg.scenarios["clean"], "clean")
def factory(n, clock):
    def delay(s,d,m,nb,rng): return inter.delay(s,d,nb,clock.now())
    return InprocHub(n, clock, delay).transports()
cl = Cluster(plan, ex, RunOptions(policy=pol, clock="virtual", cost_model=cfg.cost.model(), kv_blocks=kv), factory)
stats = collections.Counter(); rows_forced=[]; rows_choice=[]
live = []
for e in cl.engines:
    inner = e.policy
    class P:
        name = inner.name
        def __init__(s, inner, e): s.inner, s.e = inner, e
        def params(s): return {}
        def choose(s, views, next_of):
            d = s.inner.choose(views, next_of)
            if d:
                nrun = sum(v.runnable for v in views)
                k = cl.engines[0].stages[d.stage].kind
                stats[(k, nrun==1)] += 1
                live.append(len(s.e.requests))
            return d
    e.policy = P(inner, e)
res = cl.run(reqs)
T = res.metrics["elapsed_s"]
print(f"{pol} kv={kv} n={nreq}: tok/s={res.metrics['tokens_per_s']:.0f} expert mean batch={res.metrics['expert_mean_batch']:.1f} attn mean={res.metrics['attn_mean_batch']:.1f} mean live req/rank at decisions={st.mean(live):.1f}")
for k in ("attn","expert","sample"):
    f, c = stats[(k,True)], stats[(k,False)]
    print(f"  {k}: decisions {f+c}, forced (only runnable stage) {f} ({100*f/max(1,f+c):.0f}%)")
