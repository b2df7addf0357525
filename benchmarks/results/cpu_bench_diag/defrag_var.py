"""Defrag score variants (evidence for the diagnosis; not shipped policies)."""
import sys, copy
ROOT = __import__("pathlib").Path(__file__).resolve().parents[3]; sys.path.insert(0, str(ROOT))
from lab.bench import load_config, BenchConfig, run_cell, Cell, _requests, _router
from lab.interference import from_config
from lab.report import summarize
from dataflow.cmd_compile import resolve_model
from lowering.plan import compile_plan
from runtime.executors.sim_executor import SimExecutor
from lab.routing_override import KeyedRoutingExecutor
import runtime.core.scheduler as sch
kv = int(sys.argv[1])
d = load_config(f"{ROOT}/benchmarks/cpu_bench_h200costs.yaml").model_dump(); d["kv_blocks"] = kv
cfg = BenchConfig.model_validate(d)
spec, _ = resolve_model(cfg.model); plan = compile_plan(spec, cfg.ranks)
router = _router(cfg, spec); ex = KeyedRoutingExecutor(SimExecutor.for_spec(spec, seed=cfg.seed), router)
reqs = _requests(cfg, spec)
orig_h = sch.Defrag._h
variants = [("defrag W=4 H=4 (shipped)", {}, False), ("defrag W=3", {"lookahead": 3}, False),
            ("defrag without H", {}, True), ("defrag W=1", {"lookahead": 1}, False), ("defrag delta=0.5", {"delta": 0.5}, False)]
import lab.bench as rb
from runtime.drivers.cluster import RunOptions
print(f"kv={kv}\n| variant | clean tok/s | expert batch | link-bursts tok/s | loss |\n|---|---|---|---|---|")
for name, params, noh in variants:
    sch.Defrag._h = (lambda self, n: [0.0] * n) if noh else orig_h
    # policy params through make_policy: patch make_policy default for "defrag"
    orig_make = sch.make_policy
    import runtime.drivers.cluster as rc
    rc.make_policy = lambda n, **p: orig_make(n, **{**params, **p})
    out = []
    for sc in ("clean", "link-bursts"):
        run = run_cell(Cell("streaming", "defrag", sc), cfg, plan, ex, reqs, router, from_config(cfg.scenarios[sc], sc))
        out.append(summarize(run, cfg.peak_window_s))
    rc.make_policy = orig_make
    c, b = out
    print(f"| {name} | {c['tokens_per_s']:,.0f} | {c['batches']['expert']['mean_size']:.1f} | {b['tokens_per_s']:,.0f} | {100*(1-b['tokens_per_s']/c['tokens_per_s']):.1f}% |", flush=True)
