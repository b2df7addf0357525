"""`python -m lab COMMAND`, from the repository root: the lab's commands (the lab is not installed with the
product). `python -m lab bench CONFIG [-o DIR]` runs a bench config (benchmarks/*.yaml); `python -m lab simulate
MODEL --ranks N` runs a model on a virtual cluster of N GPUs (lab/cmd_simulate.py)."""
from __future__ import annotations

import typer

from dataflow.cli import run_app
from lab import cmd_bench, cmd_simulate

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="The lab: the streaming engine against barrier baselines, under injected interference.")


@app.callback()
def _lab() -> None:
    """(a callback keeps `bench` a named subcommand, as more commands join it)"""


cmd_bench.register(app)
cmd_simulate.register(app)

if __name__ == "__main__":
    run_app(app)
