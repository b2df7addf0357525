"""The `dataflow` command. Each subcommand lives in its own module (dataflow/cmd_*.py).

User mistakes raise `graph_ir.UserError`; `main` prints the message and exits 2 without a traceback.
"""
from __future__ import annotations

import sys

import typer

from graph_ir.errors import UserError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Compile MoE models into per-rank dataflow plans and run them without per-layer barriers.")

DEFAULT_PLAN_DIR = "dataflow-plan"  # `compile` writes here without -o; `run`/`inspect` read it without args


def _register() -> None:
    # Each cmd_* module defines `register(app)` and imports its heavy dependencies (torch, the
    # runtime) inside the command, so `dataflow --help` stays fast.
    # (`bench`, which compares against the lab's baselines, is the lab's: `python -m lab bench`; the transport's
    # per-message costs are benchmarks/transport_bench.py's.)
    from dataflow import cmd_compile, cmd_inspect, cmd_options, cmd_run, cmd_serve
    for mod in (cmd_compile, cmd_inspect, cmd_run, cmd_serve, cmd_options):
        mod.register(app)


_register()


def main() -> None:
    run_app(app)


def run_app(typer_app: typer.Typer) -> None:
    """Run `typer_app` (the `dataflow` command, or the lab's) with user mistakes as one line and exit code 2."""
    try:
        rc = typer_app(standalone_mode=False)
        # Non-standalone mode returns (not raises) some exit codes, e.g. typer turns Ctrl-C into 130.
        if isinstance(rc, int) and rc:
            if rc == 130:
                print("interrupted", file=sys.stderr)
            sys.exit(rc)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(err.exit_code)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    except typer.Exit as err:
        sys.exit(err.exit_code)
    except typer.Abort:
        sys.exit(130)
    except Exception as err:  # usage errors (an unknown option, a bad value) come through here in non-standalone mode
        if isinstance(err, _usage_error_types()):
            err.show()  # "Error: No such option: --plan" and the like, no traceback
            sys.exit(2)
        raise


def _usage_error_types() -> tuple:
    """The usage-error base class of the click that typer runs on: its own copy since typer 0.2x (typer._click), the
    click package before. Checking click's alone let an unknown option end in a traceback with exit code 1 under
    typer 0.29."""
    import importlib
    types = []
    for name in ("typer._click.exceptions", "click.exceptions"):
        try:
            types.append(importlib.import_module(name).ClickException)
        except (ImportError, AttributeError):
            pass
    return tuple(types)
