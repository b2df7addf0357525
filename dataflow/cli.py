"""The `dataflow` command. Each subcommand lives in its own module (dataflow/cmd_*.py) and is imported
lazily so `dataflow --help` stays fast and one broken subcommand cannot break the others.

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
    # Each cmd_* module defines `register(app)`; missing modules (work in progress) are skipped.
    import importlib
    for name in ("cmd_compile", "cmd_inspect", "cmd_run", "cmd_bench", "cmd_transport_bench"):
        try:
            mod = importlib.import_module(f"dataflow.{name}")
        except ModuleNotFoundError as err:
            if err.name == f"dataflow.{name}":
                continue
            raise
        mod.register(app)


_register()


def main() -> None:
    try:
        rc = app(standalone_mode=False)
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
    except SystemExit:
        raise
    except Exception as err:  # click usage errors come through here in non-standalone mode
        import click
        if isinstance(err, click.exceptions.ClickException):
            err.show()
            sys.exit(2)
        if isinstance(err, click.exceptions.Exit):
            sys.exit(err.exit_code)
        if isinstance(err, click.exceptions.Abort):
            sys.exit(130)
        raise
