"""`dataflow options`: every runtime option (runtime/settings.py), its default and what it means."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    @app.command()
    def options() -> None:
        """List the runtime options `run` and `serve` take (--options FILE, --set FIELD=VALUE, DATAFLOW_OPTIONS)."""
        import json

        from rich.console import Console

        from dataflow.cmd_inspect import new_table
        from runtime.settings import RuntimeOptions

        t = new_table("option", "default", "meaning", show_edge=True,
                      title="runtime options (set: --options FILE, --set FIELD=VALUE, or DATAFLOW_OPTIONS='{...}')")
        for name, field in RuntimeOptions.model_fields.items():  # (each field's default and description)
            t.add_row(name, json.dumps(field.default), field.description or "")
        Console().print(t)
