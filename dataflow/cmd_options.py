"""`dataflow options`: every runtime option (runtime/settings.py), its default and what it means."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    @app.command()
    def options() -> None:
        """List the runtime options `run` and `serve` take (--options FILE, --set FIELD=VALUE, DATAFLOW_OPTIONS)."""
        from rich.console import Console
        from rich.table import Table

        from runtime import settings

        t = Table(title="runtime options (set: --options FILE, --set FIELD=VALUE, or DATAFLOW_OPTIONS='{...}')")
        for col in ("option", "default", "meaning"):
            t.add_column(col)
        for name, default, meaning in settings.describe():
            t.add_row(name, default, meaning)
        Console().print(t)
