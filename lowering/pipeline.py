"""The lowering pipeline: the passes `compile_plan` runs, in this order, over the compact dataflow graph
(graph_ir/graph.py).

A pass is a function of the graph. It either annotates the graph and returns it (placement, replicas: the ranks that
run each node), or returns one section of the plan, which the pipeline keeps in g.graph[pass name] for the passes
after it. What compile was asked for (spec, cluster, caps, options) is in g.graph too, so a pass needs nothing else.
`dataflow compile --dump-after PASS` prints the graph, or the section, after PASS.
"""
from __future__ import annotations

from typing import Callable, Optional

import networkx as nx

from graph_ir.graph import to_text
from lowering.capture import plan_capture
from lowering.memory import plan_memory
from lowering.placement import place_experts, place_replicas
from lowering.queues import build_queues, build_stages
from lowering.routes import plan_routes

PIPELINE: list[tuple[str, Callable[[nx.DiGraph], object]]] = [
    ("placement", place_experts),  # expert nodes: their owner rank; attention/merge/sample: the home ranks
    ("replicas", place_replicas),  # expert nodes: + the ranks holding a copy
    ("stages", build_stages),  # the stage chain, walked along the edges
    ("queues", build_queues),  # each rank's mu-queue per stage, from the nodes it runs
    ("capture", plan_capture),  # CUDA graph buckets per node kind, from the batch caps
    ("routes", plan_routes),  # what crosses the wire on the edges between ranks
    ("memory", plan_memory),  # weights of the nodes each rank runs, then KV pages
]
PASS_NAMES = [name for name, _ in PIPELINE]
DUMP_LINES, DUMP_WIDTH = 12, 200  # a dump is for reading: the first items of a section, each cut to one line


def section_text(section: object) -> str:
    """A section in a few lines: one JSON line per item (the first DUMP_LINES, each cut at DUMP_WIDTH)."""
    parts = section if isinstance(section, (list, tuple)) else [section]  # (memory: the KV plan, then a list)
    lines = [x.model_dump_json() for part in parts for x in (part if isinstance(part, list) else [part])]
    cut = [x if len(x) <= DUMP_WIDTH else x[:DUMP_WIDTH] + " ..." for x in lines[:DUMP_LINES]]
    return "\n".join(cut + ([f"... ({len(lines) - DUMP_LINES} more)"] if len(lines) > DUMP_LINES else []))


def run_pipeline(g: nx.DiGraph, dump_after: Optional[str] = None, echo: Callable[[str], None] = print) -> nx.DiGraph:
    for name, run in PIPELINE:
        out = run(g)
        if out is not g:
            g.graph[name] = out
        if name == dump_after:
            echo(f"--- after {name}\n" + (to_text(g) if out is g else section_text(out)))
    return g
