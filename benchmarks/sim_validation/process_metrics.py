"""One streaming cell of a `clock: process` bench config in real rank processes, its full run metrics printed (the
bench's report keeps only tokens/s and latencies of a process run): batch counts and sizes per kind, messages, busy.

    python benchmarks/sim_validation/process_metrics.py benchmarks/cpu_bench_process_slowrank.yaml [SCENARIO]
"""
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def run_streaming_cell(config: str, scenario=None, engine_setup=None):
    """(scenario, the run's RunResult): the config's streaming cell in real rank processes, with its scenario's link
    delays and slow ranks, and `engine_setup` (a picklable hook, run in each rank process) after them."""
    from dataflow.cmd_compile import resolve_model
    from lab.bench import WallLinkDelays, WallSlowRanks, _requests, _router, _setups
    from lab.routing_override import RoutedBy
    from lab.bench_config import load_config
    from lab.interference import from_config
    from lowering.plan import compile_plan
    from runtime.core.requests import Request
    from runtime.drivers.cluster import RunOptions
    from runtime.drivers.multiproc import run_workloads_multiprocess
    cfg = load_config(config)
    scenario = scenario or cfg.clean_scenario
    spec, _ = resolve_model(cfg.model)
    plan = compile_plan(spec, cfg.ranks)
    router = _router(cfg, spec)
    requests = _requests(cfg, spec, None)
    inter = from_config(cfg.scenarios[scenario] or {}, scenario, None)
    reqs = [Request(q.rid, q.name, list(q.prompt), q.max_new_tokens, ignore_eos=True, arrival=q.arrival)
            for q in requests]
    opts = RunOptions(policy=cfg.policies[0], clock="wall", kv_blocks=cfg.kv_blocks,
                      executor_wrapper=None if router is None else RoutedBy(router),
                      engine_setup=_setups(WallSlowRanks(inter) if inter.slow else None, engine_setup))
    return scenario, run_workloads_multiprocess(plan, [(reqs, opts)], chaos=WallLinkDelays(inter), timeout=600.0)[0]


def main() -> None:
    t0 = time.perf_counter()
    _, res = run_streaming_cell(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
    m = dict(res.metrics)
    m["wall_s"] = time.perf_counter() - t0
    print(json.dumps(m, indent=1, default=str))


if __name__ == "__main__":
    main()
