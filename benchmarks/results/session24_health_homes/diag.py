import sys, statistics
from lab.bench_config import load_config
from lab import bench
from lab.interference import from_config
from dataflow.cmd_compile import resolve_model
from lowering.plan import compile_plan
from runtime.drivers import cluster as cl
cfg = load_config(sys.argv[1]); sc = sys.argv[2]; pol = sys.argv[3]
spec,_ = resolve_model(cfg.model)
plan = compile_plan(spec, cfg.ranks, device_memory_gib=141.0)
reqs = bench._requests(cfg, spec)
from runtime.executors.sim_executor import SimExecutor
ex = SimExecutor.for_spec(spec, seed=cfg.seed)
router = bench._router(cfg, spec)
if router is not None:
    from lab.routing_override import KeyedRoutingExecutor
    ex = KeyedRoutingExecutor(ex, router)
got = {}
orig = cl.Cluster.run
def run(self, rs):
    got['c'] = self; got['r'] = rs
    return orig(self, rs)
cl.Cluster.run = run
rec = bench.run_cell(bench.Cell("streaming", pol, sc), cfg, plan, ex, reqs, router, from_config(cfg.scenarios[sc] or {}, sc, None))
c, rs = got['c'], got['r']
from collections import defaultdict
by = defaultdict(list)
for r in rs: by[r.home].append(r)
end = max(r.t_finish for r in rs)
print(pol, sc, "end", round(end*1e3,1), "ms tokens", sum(len(r.output) for r in rs), "tok/s", round(sum(len(r.output) for r in rs)/end))
for h in sorted(by):
    L = by[h]; paces = [(r.token_times[-1]-r.token_times[0])/(len(r.token_times)-1) for r in L if len(r.token_times)>1]
    print(h, "n", len(L), "pace ms", round(statistics.mean(paces)*1e3,2), "last finish", round(max(r.t_finish for r in L)*1e3,1), "adm.pace", None if c.admission.pace[h] is None else round(c.admission.pace[h]*1e3,2))
