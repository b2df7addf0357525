"""`python -m lab bench CONFIG.yaml`: systems x policies x scenarios, side by side, with a report.

Writes OUT/report.json, OUT/report.md and PNG plots (throughput bars with ratios to the baseline,
ITL CDFs, time x stage queue-depth heatmaps), and prints the table and the issue's targets.
Flags override the config (or stand in for one): `python -m lab bench --ranks 4 --clock virtual`.
It compares the product with the lab's barrier baselines, so it lives in the lab, run from the repository.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer


def register(app: typer.Typer) -> None:
    @app.command()
    def bench(
        config: Optional[Path] = typer.Argument(None, help="bench YAML (benchmarks/*.yaml); defaults apply without one"),
        out: Path = typer.Option(Path("bench-out"), "-o", "--out", help="report directory"),
        model: Optional[str] = typer.Option(None, help="model YAML or shipped name (overrides the config)"),
        ranks: Optional[int] = typer.Option(None, "--ranks", "-n"),
        clock: Optional[str] = typer.Option(None, help="virtual (cost model, deterministic) | wall (real time)"),
        executor: Optional[str] = typer.Option(None, help="sim (no model math) | torch (real tensors)"),
        requests: Optional[int] = typer.Option(None, help="number of requests"),
        rate: Optional[float] = typer.Option(None, help="Poisson arrival rate, requests/s"),
        systems: Optional[str] = typer.Option(None, help="comma list: streaming,ag-ep,a2a-ep"),
        policies: Optional[str] = typer.Option(None, help="comma list: defrag,mtfs,flfs,aging"),
        seed: Optional[int] = typer.Option(None),
        repeats: Optional[int] = typer.Option(None, "--repeats",
                                              help="measure every cell N times (round by round); report medians"),
        kv_blocks: Optional[int] = typer.Option(None, "--kv-blocks", help="KV pages per rank (bounds concurrency)"),
        prompts: Optional[Path] = typer.Option(None, "--prompts", help="prompts JSONL (id, prompt_token_ids, max_new_tokens)"),
        decode_only: Optional[bool] = typer.Option(None, "--decode-only/--with-prefill",
                                                   help="paper's mode: random prompt KV, no prefill compute"),
    ) -> None:
        """Run the barrier-free engine against barrier EP baselines under stragglers; write a report."""
        from dataflow.cmd_compile import resolve_model
        from lab.bench_config import BenchConfig, load_config

        cfg = load_config(config) if config else BenchConfig()
        upd = {k: v for k, v in (("model", model), ("ranks", ranks), ("clock", clock), ("executor", executor),
                                 ("seed", seed), ("kv_blocks", kv_blocks), ("repeats", repeats)) if v is not None}
        if systems:
            upd["systems"] = [s.strip() for s in systems.split(",") if s.strip()]
        if policies:
            upd["policies"] = [s.strip() for s in policies.split(",") if s.strip()]
        wl = {k: v for k, v in (("requests", requests), ("rate", rate), ("decode_only", decode_only),
                                ("prompts", str(prompts.resolve()) if prompts else None)) if v is not None}
        if wl:
            upd["workload"] = cfg.workload.model_copy(update=wl).model_dump()
        if upd:
            cfg = BenchConfig.model_validate({**cfg.model_dump(), **upd})
        spec, _ = resolve_model(cfg.model)
        run_and_print(cfg, spec, out, base_dir=config.parent if config else None)


def run_and_print(cfg, spec, out: Path, base_dir: Optional[Path] = None) -> dict:
    """Run a bench config with a progress bar, print its table and targets; the report document."""
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from lab.bench import run_bench
    console = Console()
    with Progress(console=console, transient=True) as prog:
        task = prog.add_task("bench", total=None)

        def progress(done, total, cell, summary):
            prog.update(task, total=total, completed=done,
                        description=f"{cell.system}/{cell.policy} [{cell.scenario}]")
            if summary is not None:
                rnd = f" [round {cell.repeat + 1}/{cfg.repeats}]" if cfg.repeats > 1 else ""
                prog.console.print(f"  {summary['label']:<20} {summary['scenario']:<12} "
                                   f"{summary['tokens_per_s']:10.1f} tok/s{rnd}", markup=False)

        doc = run_bench(cfg, spec, out, base_dir=base_dir, progress=progress)
    table = Table(title=f"{cfg.name}: {cfg.ranks} ranks, {cfg.clock} clock, {cfg.executor} executor")
    for col in ("system", "scenario", "tok/s", f"x {cfg.baseline}", "loss vs clean", "ITL p99 ms",
                "mean expert batch"):
        table.add_column(col)
    for r in doc["results"]:
        loss = r.get("loss_vs_clean")
        ratio = r.get("ratio_vs_baseline")
        itl = r.get("itl_p99_ms")
        reps = r.get("tokens_per_s_repeats")
        table.add_row(r["label"], r["scenario"], f"{r['tokens_per_s']:.1f}"
                      + (f" ({min(reps):.0f}-{max(reps):.0f})" if reps else ""),
                      "-" if ratio is None else f"{ratio:.2f}", "-" if loss is None else f"{loss * 100:+.1f}%",
                      "-" if itl is None else f"{itl:.2f}",
                      f"{r['batches'].get('expert', {}).get('mean_size', r.get('expert_mean_batch') or 0):.1f}")
    console.print(table)
    for t in doc.get("targets", []):
        v = t["value"]
        console.print(f"{'MET    ' if t['met'] else 'NOT MET'} {t['target']}: "
                      f"{f'{v:.3f}' if isinstance(v, float) else v}", markup=False)
    console.print(f"report: {out / 'report.md'}")
    return doc
