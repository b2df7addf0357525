"""Hypothesis check (session 24): with every expert's copy on the far half of the cluster (another node), does live
replica choice route around node 1's NIC bursts? Patches the compiled replicas; the engine reads only placement."""
import sys
import lowering.plan as lp
orig = lp.compile_plan

def patched(spec, ranks, *a, **kw):
    plan = orig(spec, ranks, *a, **kw)
    if kw.get("replicas"):
        er = plan.placement.expert_rank
        plan.placement.replicas = [[[(o + ranks // 2) % ranks] for o in owners] if owners else [] for owners in er]
    return plan

lp.compile_plan = patched
from graph_ir.spec import load_spec
from lab.bench import run_bench
from lab.bench_config import load_config
cfg = load_config("benchmarks/sim_testbed16_replicas.yaml")
doc = run_bench(cfg, load_spec(cfg.model), sys.argv[1])
for r in doc["results"]:
    print(r["label"], r["scenario"], round(r["tokens_per_s"], 1), r["loss_vs_clean"])
