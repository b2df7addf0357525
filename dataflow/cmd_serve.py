"""`dataflow serve [PLAN_DIR]`: an OpenAI-compatible HTTP server (dataflow/openai_api.py) over the plan's ranks.

The ranks are the same processes `dataflow run` starts (one per rank, runtime/drivers/front.py), serving an open workload:
requests arrive from HTTP clients while they run. Listens on 127.0.0.1 unless --host says otherwise. Ctrl-C (or
SIGTERM) cancels what is outstanding, stops the ranks and exits.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from graph_ir.errors import UserError
from dataflow.cmd_run import OPTIONS_HELP, SET_HELP, _tokenizer_of, check_policy


def build_server(plan_dir: Path, *, policy: str = "defrag", kv_blocks: Optional[int] = None,
                 peer_timeout: float = 10.0, stall_timeout: float = 60.0, max_outstanding: int = 256):
    """(Server, plan) for a plan directory: the front over its ranks, the checkpoint's tokenizer and generation
    defaults when the plan was compiled from one."""
    from dataflow.openai_api import Server
    from lowering.plan import load_plan
    from runtime.drivers.cluster import RunOptions
    from runtime.drivers.front import Front
    plan = load_plan(plan_dir)
    check_policy(policy, {})
    options = RunOptions(policy=policy, kv_blocks=kv_blocks, stall_timeout_s=stall_timeout)
    front = Front(plan, options, peer_timeout_s=peer_timeout, max_outstanding=max_outstanding)
    return Server(front, plan.spec, _tokenizer_of(plan.spec)), plan


def register(app: typer.Typer) -> None:
    from dataflow.cli import DEFAULT_PLAN_DIR

    @app.command()
    def serve(
        plan_dir: Path = typer.Argument(Path(DEFAULT_PLAN_DIR), help="plan directory written by `dataflow compile`"),
        host: str = typer.Option("127.0.0.1", "--host", help="address to listen on (loopback by default)"),
        port: int = typer.Option(8000, "--port"),
        policy: str = typer.Option("defrag", "--policy", help="scheduler: flfs, mtfs, defrag or aging"),
        kv_blocks: Optional[int] = typer.Option(None, "--kv-blocks", min=1, help="override KV pages per rank"),
        max_outstanding: int = typer.Option(256, "--max-outstanding",
                                            help="requests open at once; more are answered 503 (Retry-After)"),
        peer_timeout: float = typer.Option(10.0, "--peer-timeout", help="seconds of silence before a rank is dead"),
        stall_timeout: float = typer.Option(60.0, "--stall-timeout", help="see `dataflow run --help`"),
        options_file: Optional[Path] = typer.Option(None, "--options", help=OPTIONS_HELP),
        set_option: list[str] = typer.Option([], "--set", help=SET_HELP),
    ) -> None:
        """Serve PLAN_DIR over an OpenAI-compatible HTTP API (completions, chat, streaming, /metrics)."""
        import uvicorn

        from dataflow.openai_api import create_app
        from runtime import settings
        options = settings.from_flags(options_file and str(options_file), set_option)
        if not 0 < port < 65536:
            raise UserError(f"--port {port}; valid: 1..65535")
        if max_outstanding < 1:
            raise UserError(f"--max-outstanding {max_outstanding}; valid: a positive number of requests")
        for opt, value in (("--peer-timeout", peer_timeout), ("--stall-timeout", stall_timeout)):
            if not 0 < value < float("inf"):
                raise UserError(f"{opt} {value}; valid: a positive number of seconds")
        server, plan = build_server(plan_dir, policy=policy, kv_blocks=kv_blocks, peer_timeout=peer_timeout,
                                    stall_timeout=stall_timeout, max_outstanding=max_outstanding)
        if host not in ("127.0.0.1", "localhost", "::1"):
            print(f"note: listening on {host}: anyone who can reach it can use this server (no authentication)",
                  file=sys.stderr)
        text = "text and token ids" if server.tokenizer is not None else "token ids only (no tokenizer)"
        changed = settings.changed(options)
        given = f", options {changed}" if changed else ""
        print(f"serving {plan.spec.name} ({plan.cluster.ranks} rank process(es), {text}{given}) on "
              f"http://{host}:{port}/v1 once the ranks are up", file=sys.stderr, flush=True)
        uvicorn.run(create_app(server), host=host, port=port, log_level="warning")
