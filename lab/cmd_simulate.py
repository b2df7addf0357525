"""`python -m lab simulate MODEL --ranks N`: what a model would do on N GPUs, clean and with one slow NIC or GPU.

The streaming engine and the barrier baselines (all-gather and all-to-all EP) run on one virtual cluster: the
same engine, queues, scheduler, merge and transport code as real runs, with a model-free executor whose batches
cost what a cost profile says (default: lab/costs/h200_host.yaml, measured on the lent H200s), and a network of nodes
of G GPUs behind one shared NIC each (lab/network.py). The workload is the paper's decode-only setup: ShareGPT
lengths, `--requests-per-rank` requests per rank at t=0, the model's own hidden rows on the links. It writes the
bench's report (report.json, report.md, PNGs) and prints its table.

Named scenarios (`--scenario`, repeatable; or a YAML file of bench scenarios, name -> fields):
- clean: no disturbance;
- slow-nic: the last node's NIC in on/off bursts, +2 ms for 30% of every 20 ms, both ways (the recorded benches'
  link bursts, on one node's every link);
- slow-rank: the last GPU computes 1.5x slower.
Each streaming simulation runs split over `--processes` (default: one per CPU core this process may use), the same
report as in one process (runtime/drivers/partitions.py: why, and where it applies). It is a bench config built from
a few flags (`simulate_config`): for more control, write the config and run `python -m lab bench`. Lives in the lab: it compares the product with the lab's barrier baselines.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer

from graph_ir.errors import UserError
from graph_ir.files import load_yaml
from lowering.sizes import dtype_bytes

# The default profile is the validated one: device costs plus each batch's measured host time, within 13% of the
# recorded 2 x H200 runs (benchmarks/results/sim_validation.md, session 25). h200.yaml (device costs only) predicted
# those runs 6-154% fast, all-gather EP most: it stays as `--costs lab/costs/h200.yaml`, the ranks' device floor.
COSTS = Path(__file__).parent / "costs" / "h200_host.yaml"
# --processes' default: a split simulation gives the same report (runtime/drivers/partitions.py), so use the cores
CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
NAMED_SCENARIOS = ("clean", "slow-nic", "slow-rank")


def named_scenario(name: str, ranks: int, gpus_per_node: int) -> dict:
    """A named scenario as bench scenario fields, for this cluster."""
    if name == "clean":
        return {}
    if name == "slow-nic":
        first = (ranks - 1) // gpus_per_node * gpus_per_node   # the last node's GPUs
        links = [link for r in range(first, ranks) for link in ([r, -1], [-1, r])]
        return {"bursts": [{"period_ms": 20, "duty": 0.3, "extra_delay_us": 2000, "links": links}]}
    if name == "slow-rank":
        return {"slow_ranks": [{"rank": ranks - 1, "factor": 1.5}]}
    raise UserError(f"--scenario {name!r}: not a named scenario ({', '.join(NAMED_SCENARIOS)}) nor a YAML file")


def _scenarios(names: list[str], ranks: int, gpus_per_node: int) -> dict:
    out: dict = {}
    for name in names:
        path = Path(name)
        if path.suffix in (".yaml", ".yml"):
            if not path.is_file():
                raise UserError(f"--scenario {path}: no such file")
            loaded = load_yaml(path, "scenario file", max_bytes=None) or {}
            if not isinstance(loaded, dict) or not all(isinstance(v, dict) for v in loaded.values()):
                raise UserError(f"--scenario {path}: must map scenario names to bench scenario fields")
            out.update(loaded)
        else:
            out[name] = named_scenario(name, ranks, gpus_per_node)
    return out


def simulate_config(model: str, spec, ranks: int, gpus_per_node: int, scenarios: list[str], costs: Path,
                    requests_per_rank: int, new_tokens: int, systems: list[str], seed: int = 0, processes: int = 1):
    """The bench config `simulate` runs."""
    from lab.bench_config import BenchConfig, CostConfig, validated
    if not costs.is_file():
        raise UserError(f"--costs {costs}: no such file")
    cost = validated(CostConfig, load_yaml(costs, "cost profile", max_bytes=None) or {}, f"--costs {costs}")
    named = _scenarios(scenarios, ranks, gpus_per_node)
    clean = "clean" if "clean" in named else next(iter(named))
    return validated(BenchConfig, {
        "name": f"simulate {model} on {ranks} GPUs ({gpus_per_node} per node)",
        "model": model, "ranks": ranks, "clock": "virtual", "executor": "sim", "seed": seed,
        "row_bytes": spec.hidden_size * dtype_bytes(spec),
        "network": {"gpus_per_node": gpus_per_node},
        "workload": {"lengths": "sharegpt", "max_context": 512, "max_new_tokens": new_tokens,
                     "requests": requests_per_rank * ranks, "rate": 1e9, "decode_only": True},
        "routing": {"kind": "zipf", "s": 1.2, "drift_every": 32},
        "cost": cost.model_dump(), "systems": systems, "policies": ["defrag"], "baseline": "ag-ep" if "ag-ep" in systems
        else systems[0], "scenarios": named, "clean_scenario": clean, "peak_window_s": 0.05,
        "heatmap_policies": ["defrag"], "processes": processes,
    }, "simulate")


def register(app: typer.Typer) -> None:
    @app.command()
    def simulate(
        model: str = typer.Argument(..., help="model YAML, shipped name (gpt-oss-120b, ...) or checkpoint directory"),
        ranks: int = typer.Option(..., "--ranks", "-n", min=1, help="GPUs in the simulated cluster"),
        gpus_per_node: int = typer.Option(8, "--gpus-per-node", "-g", min=1, help="GPUs behind one NIC"),
        scenario: Optional[list[str]] = typer.Option(None, "--scenario", "-s",
                                                     help="clean | slow-nic | slow-rank | FILE.yaml (repeatable; "
                                                          "default: clean and slow-nic)"),
        costs: Path = typer.Option(COSTS, "--costs", help="cost profile YAML (bench cost fields)"),
        requests_per_rank: int = typer.Option(32, "--requests-per-rank", min=1),
        new_tokens: int = typer.Option(32, "--new-tokens", min=1,
                                       help="cap on the tokens a request decodes (ShareGPT output lengths)"),
        systems: str = typer.Option("streaming,ag-ep,a2a-ep", help="comma list: streaming,ag-ep,a2a-ep"),
        out: Path = typer.Option(Path("simulate-out"), "-o", "--out", help="report directory"),
        trace: bool = typer.Option(False, "--trace", help="also write streaming's predicted schedule as Perfetto "
                                                          "traces (OUT/traces/trace-POLICY-SCENARIO-r0.json)"),
        processes: int = typer.Option(CORES, "--processes", "-j", min=1,
                                      help="split each streaming simulation over this many processes (the same "
                                           "report, faster; default: one per CPU core this process may use)"),
    ) -> None:
        """Streaming vs barrier EP on a virtual cluster of N GPUs, clean and disturbed; write a report."""
        import torch

        from dataflow.cmd_compile import resolve_model
        from lab.cmd_bench import run_and_print
        # One torch thread: the simulation's tensors are tiny and its loop is one Python thread; on the 2-core VM,
        # torch's 2-thread path for a [1024, 4] index (all-gather EP's global batch at 1,024 ranks) took 5-10 ms
        # against 27 us on one thread (session 24).
        torch.set_num_threads(1)
        spec, _ = resolve_model(model)
        cfg = simulate_config(model, spec, ranks, gpus_per_node, scenario or ["clean", "slow-nic"], costs,
                              requests_per_rank, new_tokens, [s.strip() for s in systems.split(",") if s.strip()],
                              processes=processes)
        if trace:
            cfg = cfg.model_copy(update={"trace_dir": str(out / "traces")})
        run_and_print(cfg, spec, out)
