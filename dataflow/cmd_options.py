"""`dataflow options`: every runtime option (runtime/settings.py), its default and what it means."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    @app.command()
    def options() -> None:
        """List the runtime options `run` and `serve` take (--options FILE, --set FIELD=VALUE, DATAFLOW_OPTIONS)."""
        from rich.console import Console

        from dataflow.cmd_inspect import new_table
        from runtime import settings

        t = new_table("option", "default", "meaning", show_edge=True,
                      title="runtime options (set: --options FILE, --set FIELD=VALUE, or DATAFLOW_OPTIONS='{...}')")
        for name, default, meaning in settings.describe():
            t.add_row(name, default, meaning)
        Console().print(t)
