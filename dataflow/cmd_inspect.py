"""`dataflow inspect [PLAN_DIR]`: read what the compiler decided, as tables, JSON or a DOT graph.

Sections: placement (experts per rank), queues (a rank's mu-queue table along the stage chain),
graphs (CUDA graph buckets, shared pools, graph memory), routes (rank pairs and message bytes per
stage edge), memory (per-rank budget).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import typer

from graph_ir.errors import UserError
from lowering.summary import compress_ids

SECTIONS = ("placement", "queues", "graphs", "routes", "memory")
GIB = 1024 ** 3
# A DOT file beyond this many nodes is not readable by a person nor renderable in reasonable time.
MAX_DOT_NODES = 20000


def _bytes(n: int) -> str:
    for unit, size in (("GiB", GIB), ("MiB", 1024 ** 2), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def new_table(*columns: str, right=(), no_wrap: bool = False, **kw):
    """A rich Table (no outer edge unless `kw` says otherwise) with these columns, those in `right` (every one for
    right=True) right-justified."""
    from rich.table import Column, Table

    cols = [Column(c, justify="right" if right is True or c in right else "left", no_wrap=no_wrap) for c in columns]
    return Table(*cols, **{"show_edge": False, **kw})


def stage_name(plan, stage_id: int) -> str:
    s = plan.stages[stage_id]
    return "sample" if s.kind == "sample" else f"{s.kind}({s.layer})"


def _section_data(plan, section: str, rank: Optional[int]) -> Any:
    """The JSON-able content of one section (one of SECTIONS: the command checked it), filtered to `rank` where that
    makes sense."""
    ranks = [rank] if rank is not None else list(range(plan.cluster.ranks))
    if section == "placement":
        data = plan.placement.model_dump(mode="json")
        if rank is not None:
            data["experts_on_rank"] = {str(l): plan.placement.experts_on(l, rank) for l in plan.spec.moe_layers}
        return data
    if section == "queues":
        return {"stages": [s.model_dump(mode="json") for s in plan.stages],
                "ranks": [plan.ranks[r].model_dump(mode="json") for r in ranks]}
    if section == "graphs":
        return plan.capture.model_dump(mode="json")
    if section == "routes":
        out = []
        for route in plan.routes:
            d = route.model_dump(mode="json")
            d["pairs"] = [list(p) for p in route.pairs() if rank is None or rank in p]
            out.append(d)
        return out
    return {"kv": plan.kv.model_dump(mode="json"),  # memory
            "ranks": [plan.memory[r].model_dump(mode="json") for r in ranks]}


def _group_layers(plan) -> list[list[int]]:
    """MoE layers grouped by identical expert->rank rows and replicas (usually one group for all layers)."""
    groups: dict[tuple, list[int]] = {}
    p = plan.placement
    for layer in plan.spec.moe_layers:
        groups.setdefault(repr((p.expert_rank[layer], p.replicas[layer] if p.replicas else [])), []).append(layer)
    return list(groups.values())


def _print_placement(console, plan, rank: Optional[int]) -> None:
    p = plan.placement
    console.print(f"[bold]placement[/]: {p.policy}; home-rank policy {p.home_policy}; "
                  f"dense layers {plan.spec.dense_layers or 'none'}"
                  + (f"; attention on ranks {compress_ids(p.attention_ranks)}" if p.attention_ranks else ""))
    for layers in _group_layers(plan):
        cols = ("rank", "experts", "count") + (("load",) if p.load is not None else ())
        table = new_table(*cols, right=("rank", "count", "load"), title=f"MoE layers {compress_ids(layers)}")
        for r in ([rank] if rank is not None else range(plan.cluster.ranks)):
            held = p.experts_on(layers[0], r)  # (replicas included)
            cells = [str(r), compress_ids(held), str(len(held))]
            if p.load is not None:
                cells.append(f"{sum(p.load[layers[0]][e] for e in held):.3g}")
            table.add_row(*cells)
        console.print(table)


def _print_queues(console, plan, rank: Optional[int]) -> None:
    r = 0 if rank is None else rank
    chain = " -> ".join(stage_name(plan, s.id) for s in plan.stages) + " -> (wraps to attn(0))"
    console.print(f"[bold]stage chain[/] ({len(plan.stages)} stages, same ids on every rank): {chain}")
    table = new_table("stage", "name", "kind", "layer", "next", "batch cap", "experts held",
                      right=("stage", "layer", "batch cap"),
                      title=f"mu-queues of rank {r}" + ("" if rank is not None else " (use --rank R for others)"))
    for q in plan.ranks[r].queues:
        unit = "rows" if q.kind == "expert" else "tokens"
        held = compress_ids(q.experts) if q.kind == "expert" else ""
        table.add_row(str(q.stage_id), stage_name(plan, q.stage_id), q.kind, str(q.layer),
                      f"{q.next_stage} {stage_name(plan, q.next_stage)}", f"{q.batch_cap} {unit}", held)
    console.print(table)


def _print_graphs(console, plan, rank: Optional[int]) -> None:
    c = plan.capture
    state = "captured" if c.enabled else "planned only (CUDA graphs are captured on cuda)"
    console.print(f"[bold]CUDA graph capture[/]: {state}")
    for kind, bks in c.buckets.items():
        console.print(f"  {kind} buckets: {bks}")
    table = new_table("kind", "bucket", "layers sharing", "static buffers", right=("bucket", "static buffers"),
                      title="memory pools (all listed layers share one pool and static buffers per bucket)")
    for p in c.pools:
        table.add_row(p.kind, str(p.bucket), compress_ids(p.layers), _bytes(p.static_buffer_bytes))
    console.print(table)
    ranks = [rank] if rank is not None else range(plan.cluster.ranks)
    per_rank = new_table("rank", "graphs", "graph memory", right=True)
    for r in ranks:
        per_rank.add_row(str(r), str(c.graphs_per_rank[r]), _bytes(c.graph_memory_bytes[r]))
    console.print(per_rank)


def _print_routes(console, plan, rank: Optional[int]) -> None:
    if plan.cluster.dispatch == "device":
        console.print("[bold]routes[/] (device-routed dispatch): dispatch = home ranks send each attention batch "
                      "whole, a normed hidden row per token with its top-k expert ids and weights, to every expert "
                      "holder; combine = one row per token comes back from each holder, the weighted sum of its own "
                      "slots, and the home adds them; local = stays on the home rank. Metadata (positions) travels "
                      "separately.")
    else:
        console.print("[bold]routes[/]: dispatch = home ranks send normed hidden rows, one per (token, expert), "
                      "to the expert holders; combine = expert outputs go back to the home rank's top-k merge; "
                      "local = stays on the home rank. Metadata (ids, weights, positions) travels separately.")
    table = new_table("edge", "kind", "from", "to", "remote pairs", "max rows", "max message", no_wrap=True,
                      right=("remote pairs", "max rows", "max message"),
                      title="per stage edge" + (f" (pairs involving rank {rank})" if rank is not None else ""))
    for route in plan.routes:
        pairs = [p for p in route.pairs() if p[0] != p[1] and (rank is None or rank in p)]
        src, dst = route.src_ranks, route.dst_ranks
        if rank is not None and route.kind != "local":
            src = sorted({p[0] for p in pairs})
            dst = sorted({p[1] for p in pairs})
        edge = f"{stage_name(plan, route.src_stage)}->{stage_name(plan, route.dst_stage)}"
        table.add_row(edge, route.kind, compress_ids(src), compress_ids(dst) if route.kind != "local" else "same",
                      str(len(pairs)), str(route.max_rows),
                      _bytes(route.max_message_bytes) if route.max_message_bytes else "-")
    console.print(table)


def _print_memory(console, plan, rank: Optional[int]) -> None:
    kv = plan.kv
    console.print(f"[bold]memory[/]: {plan.cluster.ranks} x {plan.cluster.device} "
                  f"{plan.cluster.device_memory_gib:g} GiB; KV {kv.bytes_per_token} bytes/token "
                  f"({kv.bytes_per_token_per_layer[0]} per layer, {kv.dtype}), pages of {kv.block_size} tokens")
    table = new_table("rank", "replicated", "experts", "graphs", "workspace", "KV", "KV tokens", "KV blocks", "free",
                      right=True, no_wrap=True)
    for m in (plan.memory if rank is None else [plan.memory[rank]]):
        table.add_row(str(m.rank), _bytes(m.replicated_weight_bytes), _bytes(m.expert_weight_bytes),
                      _bytes(m.graph_bytes), _bytes(m.workspace_bytes), _bytes(m.kv_bytes),
                      str(m.kv_capacity_tokens), str(m.kv_blocks), _bytes(m.free_bytes))
    console.print(table)


PRINTERS = {"placement": _print_placement, "queues": _print_queues, "graphs": _print_graphs,
            "routes": _print_routes, "memory": _print_memory}


def write_dot(plan, path: Path, rank: Optional[int]) -> int:
    """Write the dataflow graph after placement as DOT: home `rank`'s subgraph, or every home's while they fit
    MAX_DOT_NODES, else the compact graph (one node per kind, layer and expert, each showing the ranks that run it).
    Returns the node count."""
    from graph_ir.graph import build_graph, per_home, to_dot
    from lowering.placement import annotate

    g = build_graph(plan.spec)
    g.graph["ranks"] = plan.cluster.ranks
    annotate(g, plan.placement)
    homes = [rank] if rank is not None else plan.placement.homes(plan.cluster.ranks)
    if g.number_of_nodes() * len(homes) <= MAX_DOT_NODES or rank is not None:
        g = per_home(g, homes)
    try:
        path.write_text(to_dot(g))
    except OSError as err:
        raise UserError(f"option '--dot': cannot write {path} ({err.strerror or err}); valid: a file path in an "
                        f"existing, writable directory") from None
    return g.number_of_nodes()


def register(app: typer.Typer) -> None:
    from dataflow.cli import DEFAULT_PLAN_DIR

    @app.command()
    def inspect(
        plan_dir: Path = typer.Argument(Path(DEFAULT_PLAN_DIR), help="plan directory written by `dataflow compile`"),
        rank: Optional[int] = typer.Option(None, "--rank", "-r", help="show only this rank"),
        section: Optional[str] = typer.Option(None, "--section", "-s", help=" | ".join(SECTIONS)),
        as_json: bool = typer.Option(False, "--json", help="print the section (or the whole plan) as JSON"),
        dot: Optional[Path] = typer.Option(None, "--dot", help="write the dataflow graph after placement as Graphviz "
                                                               "DOT here (every home's, --rank's, or when too large "
                                                               "the compact graph: one node per layer and expert)"),
    ) -> None:
        """Show a compiled plan: placement, mu-queue tables, CUDA graph plans, routes, memory."""
        from rich.console import Console

        from lowering.plan import load_plan

        plan = load_plan(plan_dir)
        if rank is not None and not 0 <= rank < plan.cluster.ranks:
            raise UserError(f"option '--rank': got {rank}; valid: 0..{plan.cluster.ranks - 1} "
                            f"(the plan in {plan_dir} has {plan.cluster.ranks} ranks)")
        if section is not None and section not in SECTIONS:
            raise UserError(f"option '--section': got {section!r}; valid: {', '.join(SECTIONS)}")
        if dot is not None:
            n = write_dot(plan, dot, rank)
            typer.echo(f"wrote {dot} ({n} nodes)", err=True)
            if section is None and not as_json:
                return
        if as_json:
            data = _section_data(plan, section, rank) if section else plan.model_dump(mode="json")
            typer.echo(json.dumps(data, indent=1))
            return
        console = Console()
        s, c = plan.spec, plan.cluster
        console.print(f"[bold]{s.name}[/] ({s.family}) plan v{plan.version} from {plan.source or '?'}: "
                      f"{c.ranks} x {c.device}, caps attn {plan.caps.attn_tokens} tokens / "
                      f"expert {plan.caps.expert_rows} rows, dispatch {c.dispatch or 'by device'}")
        for name in ([section] if section else SECTIONS):
            console.print()
            PRINTERS[name](console, plan, rank)
