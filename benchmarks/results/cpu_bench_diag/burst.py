"""Streaming under link bursts: per-home token rate and per-rank busy/batch size, burst-on vs burst-off windows."""
import sys, collections
ROOT = __import__("pathlib").Path(__file__).resolve().parents[3]; sys.path.insert(0, str(ROOT))
from lab.bench import load_config, BenchConfig, run_cell, Cell, _requests, _router
from lab.interference import from_config
from dataflow.cmd_compile import resolve_model
from lowering.plan import compile_plan
from runtime.executors.sim_executor import SimExecutor
from lab.routing_override import KeyedRoutingExecutor
cfgp, kv, system, pol = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
d = load_config(cfgp).model_dump(); d["kv_blocks"] = kv; cfg = BenchConfig.model_validate(d)
spec, _ = resolve_model(cfg.model); plan = compile_plan(spec, cfg.ranks)
router = _router(cfg, spec); ex = KeyedRoutingExecutor(SimExecutor.for_spec(spec, seed=cfg.seed), router)
reqs = _requests(cfg, spec)
inter = from_config(cfg.scenarios["link-bursts"], "link-bursts")
b = inter.link.effects[0]
run = run_cell(Cell(system, pol, "link-bursts"), cfg, plan, ex, reqs, router, inter)
# homes from the request list copies: run.requests lacks home; recompute via names -> use RunRecord? use batches of sample per rank
T0 = 0.0; T1 = max(t for r in run.requests for t in r.token_times) * 0.8   # steady part: drop the drain tail
on_t = sum(1 for i in range(int(T1 / 1e-4)) if b.active(i * 1e-4)) * 1e-4; off_t = T1 - on_t
print(f"{system}/{pol} kv={kv}: steady window 0..{T1*1e3:.0f} ms, burst-on {on_t*1e3:.0f} ms, off {off_t*1e3:.0f} ms")
samp = collections.defaultdict(lambda: [0, 0]); busy = collections.defaultdict(lambda: [0.0, 0.0]); eb = collections.defaultdict(lambda: [[], []])
for x in run.batches:
    if x.t_start > T1: continue
    k = 0 if b.active(x.t_start) else 1
    busy[x.rank][k] += x.t_end - x.t_start
    if x.kind == "sample": samp[x.rank][k] += x.size
    if x.kind == "expert": eb[x.rank][k].append(x.size)
print("rank | tokens/s homed here: burst on / off | busy on / off | mean expert batch on / off")
for r in sorted(busy):
    print(f"  {r} | {samp[r][0]/on_t:8.0f} / {samp[r][1]/off_t:8.0f} | {busy[r][0]/on_t:.2f} / {busy[r][1]/off_t:.2f} | "
          f"{sum(eb[r][0])/max(1,len(eb[r][0])):.1f} / {sum(eb[r][1])/max(1,len(eb[r][1])):.1f}")
tot_on = sum(v[0] for v in samp.values()) / on_t; tot_off = sum(v[1] for v in samp.values()) / off_t
print(f"  all | {tot_on:.0f} / {tot_off:.0f}  (burst-on rate is {100*(1-tot_on/tot_off):.1f}% lower)")
