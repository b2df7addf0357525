"""Which part of the communication model moves the streaming/ag-ep ratio: one config, parts added one by one."""
import sys, copy, json
ROOT = __import__("pathlib").Path(__file__).resolve().parents[3]; sys.path.insert(0, str(ROOT))
from lab.bench import load_config, BenchConfig, run_bench
from dataflow.cmd_compile import resolve_model
base = load_config(f"{ROOT}/benchmarks/cpu_bench_h200costs.yaml").model_dump()
kv = int(sys.argv[1]) if len(sys.argv) > 1 else 512
base.update(kv_blocks=kv, systems=["streaming", "ag-ep"], policies=["defrag"])
base["scenarios"] = {k: v for k, v in base["scenarios"].items() if k in ("clean", "link-bursts")}
def variant(name, f):
    d = copy.deepcopy(base); f(d); return name, d
def legacy(d):
    d["row_bytes"] = None
    d["cost"].update(send_cpu_us=0, collective_algo="direct", collective_fixed_us={"ag": 0, "ar": 0, "a2a": 0})
    for s in d["scenarios"].values(): s["latency_us"] = 40
def v1(d):
    legacy(d); d["cost"].update(collective_algo="ring"); [s.update(latency_us=10) for s in d["scenarios"].values()]
def v2(d):
    v1(d); d["cost"].update(collective_fixed_us={"ag": 100, "ar": 25, "a2a": 100})
def v3(d):
    v2(d); d["cost"].update(send_cpu_us=30)
vs = [variant("A: old comm model (free sends, direct 1-hop collectives, 40 us links, 8-byte rows)", legacy),
      variant("B: A + ring collectives, 10 us links", v1),
      variant("C: B + collective fixed cost (ag 100, ar 25, a2a 100 us)", v2),
      variant("D: C + 30 us host per p2p send (streaming)", v3),
      variant("E: D + GPT-OSS rows on the links (5760 B) = cpu_bench_h200costs", lambda d: None)]
spec, _ = resolve_model("tiny")
print(f"kv_blocks={kv}")
print("| variant | streaming/defrag clean | ag-ep clean | ratio clean | streaming loss bursts | ag-ep loss bursts | ratio bursts |")
print("|---|---|---|---|---|---|---|")
for name, d in vs:
    doc = run_bench(BenchConfig.model_validate(d), spec, f"/tmp/cpu_bench_ablation/{kv}/{name[0]}")
    by = {(r["label"], r["scenario"]): r for r in doc["results"]}
    s, b, sb, bb = by["streaming/defrag", "clean"], by["ag-ep", "clean"], by["streaming/defrag", "link-bursts"], by["ag-ep", "link-bursts"]
    print(f"| {name} | {s['tokens_per_s']:.0f} | {b['tokens_per_s']:.0f} | {s['tokens_per_s']/b['tokens_per_s']:.2f} | "
          f"{100*sb['loss_vs_clean']:.1f}% | {100*bb['loss_vs_clean']:.1f}% | {sb['tokens_per_s']/bb['tokens_per_s']:.2f} |", flush=True)
