"""The token-level dataflow graph of a model, as data: what the compiler lowers (lowering/pipeline.py).

Nodes are `(kind, LayerID)`; the compact graph the compiler works on has one node per (kind, layer[, expert]), for
every home at once (home_rank == ANY_HOME), because the per-home subgraphs are identical up to the home: a request
lives on its home rank and homes never exchange tokens.
  ("attention", LayerID(l))        layer l's attention (+ router / shared expert / dense MLP), on the home
  ("expert",    LayerID(l, -1, e)) expert e of layer l, on the ranks holding a copy of it
  ("merge",     LayerID(l))        the top-k merge on the home: waits for all k expert rows of a token
  ("sample",    LayerID(L))        final norm + LM head + sampler on the home (layer index L = num_layers)
Edges: attention(l) -> expert(l, e) for every e -> merge(l) -> attention(l+1); a dense layer goes attention(l) ->
attention(l+1); the last layer feeds sample, and sample -> attention(0) closes the decode loop. Each node's `ranks`
attribute says which ranks run it: empty until the placement pass (lowering/placement.py) fills it in (an expert:
its owner, then its replicas; the other kinds: the home ranks). A LayerID is exactly the routing key the runtime's
metadata carries (with the token's home filled in), so this graph and the runtime agree on a token's next hop.

`per_home(g, homes)` expands the compact graph into one subgraph per home, keyed LayerID(l, h, e), for drawing
(`dataflow inspect --dot`) and for tests/test_graph.py, whose invariants are those the compiler's plan check
(lowering/check.py) asserts of the stage chain and the placement.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import networkx as nx

from graph_ir.spec import ModelSpec

ANY_HOME = -1  # a node of the compact graph stands for every home


class LayerID(NamedTuple):
    layer: int
    home_rank: int = ANY_HOME
    expert: int = -1


Node = tuple[str, LayerID]


def build_graph(spec: ModelSpec) -> nx.DiGraph:
    """The compact graph of `spec`, its nodes not yet placed (`ranks` empty)."""
    L, E = spec.num_layers, spec.experts.num_experts
    g = nx.DiGraph(model=spec.name, num_layers=L, num_experts=E, top_k=spec.experts.top_k,
                   dense_layers=sorted(set(spec.dense_layers)), ranks=None)

    sample, prev = ("sample", LayerID(L)), None
    nodes: list[Node] = [sample]
    edges: list[tuple[Node, Node]] = []
    for layer in range(L):
        attn = ("attention", LayerID(layer))
        nodes.append(attn)
        edges += [(prev, attn)] if prev else []
        prev = attn
        if spec.is_moe_layer(layer):
            prev = ("merge", LayerID(layer))
            experts = [("expert", LayerID(layer, ANY_HOME, e)) for e in range(E)]
            nodes += [prev, *experts]
            edges += [(attn, ex) for ex in experts] + [(ex, prev) for ex in experts]
    edges += [(prev, sample), (sample, ("attention", LayerID(0)))]
    # (bulk adds: one add_node call per node made this a tenth of a 1,024-rank compile)
    g.add_nodes_from((n, {"kind": n[0], "lid": n[1], "ranks": []}) for n in nodes)
    g.add_edges_from(edges)
    return g


def stage_chain(g: nx.DiGraph) -> list[tuple[str, int]]:
    """The stage chain, walked along the edges from attention(0): ("attn", l), then ("expert", l) where layer l's
    attention feeds experts (whose merge feeds the next layer's attention), ..., ("sample", L)."""
    out, node = [], ("attention", LayerID(0))
    while node[0] != "sample":
        out.append(("attn", node[1].layer))
        node = next(iter(g.successors(node)))
        if node[0] == "expert":
            out.append(("expert", node[1].layer))
            node = next(iter(g.successors(next(iter(g.successors(node))))))  # expert -> merge -> next layer
    return out + [("sample", node[1].layer)]


def experts_of(g: nx.DiGraph, layer: int) -> list[Node]:
    """The expert nodes of `layer`, by ascending expert id ([] for a dense layer)."""
    return [n for n in g.successors(("attention", LayerID(layer))) if n[0] == "expert"]


def experts_by_rank(g: nx.DiGraph, layer: int) -> dict[int, list[int]]:
    """{rank: the experts of `layer` it holds, ascending}, copies included, for the ranks holding any."""
    held: dict[int, list[int]] = {}
    for n in experts_of(g, layer):
        for r in g.nodes[n]["ranks"]:
            held.setdefault(r, []).append(n[1].expert)
    return held


def per_home(g: nx.DiGraph, homes: Sequence[int]) -> nx.DiGraph:
    """Home h's copy of the (placed) compact graph for each h in `homes`: nodes keyed LayerID(l, h, e) whose `rank`
    is the rank that runs them for that home (an expert: its owner; its copies stay in `ranks`)."""
    out = nx.DiGraph(**g.graph)
    for h in homes:
        for (kind, lid), data in g.nodes(data=True):
            ranks = data["ranks"] if kind == "expert" else [h]
            out.add_node((kind, lid._replace(home_rank=h)), kind=kind, lid=lid._replace(home_rank=h),
                         rank=ranks[0], ranks=ranks)
        out.add_edges_from(((a, la._replace(home_rank=h)), (b, lb._replace(home_rank=h))) for (a, la), (b, lb) in g.edges)
    return out


def ranks_text(ranks: Sequence[int]) -> str:
    """[0,1,2,3] -> '0-3'; anything else comma-separated ('?' before placement)."""
    if len(ranks) > 2 and list(ranks) == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks)) or "?"


def node_label(node: Node) -> str:
    kind, lid = node
    home = f" h{lid.home_rank}" if lid.home_rank != ANY_HOME else ""
    if kind == "expert":
        return f"E{lid.expert} L{lid.layer}{home}"
    if kind == "sample":
        return f"sample{home}"
    return f"{'attn' if kind == 'attention' else 'merge'} L{lid.layer}{home}"


def to_dot(g: nx.DiGraph) -> str:
    """DOT text (Graphviz) of the graph, one cluster per home rank (the compact graph: one cluster for every home);
    every node shows the rank(s) running it. Written by hand so no pydot/pygraphviz dependency is needed."""
    ids = {n: f"n{i}" for i, n in enumerate(g.nodes)}
    shape = {"attention": "box", "expert": "ellipse", "merge": "diamond", "sample": "doubleoctagon"}
    out = [f'digraph "{g.graph.get("model", "model")}" {{', "  rankdir=TB;", '  node [fontname="Helvetica"];']
    for h in sorted({n[1].home_rank for n in g.nodes}):
        name, label = (f"home{h}", f"home rank {h}") if h != ANY_HOME else ("homes", "every home")
        out.append(f'  subgraph cluster_{name} {{ label="{label}";')
        for n, data in g.nodes(data=True):
            if n[1].home_rank == h:
                where = f"\\n@rank {ranks_text(data['ranks'])}" if n[0] == "expert" or h == ANY_HOME else ""
                out.append(f'    {ids[n]} [label="{node_label(n)}{where}", shape={shape[n[0]]}];')
        out.append("  }")
    for a, b in g.edges:
        style = ' [style=dashed, label="next step"]' if a[0] == "sample" else ""
        out.append(f"  {ids[a]} -> {ids[b]}{style};")
    out.append("}")
    return "\n".join(out) + "\n"


def to_text(g: nx.DiGraph) -> str:
    """The compact graph in a few lines (`dataflow compile --dump-after`): where attention runs, and per MoE layer
    each expert's ranks (owner first), consecutive identical layers folded into one line."""
    L = g.graph["num_layers"]
    lines = [f"graph {g.graph['model']}: {g.number_of_nodes()} nodes, {g.number_of_edges()} edges, {L} layers, "
             f"{g.graph['num_experts']} experts top-{g.graph['top_k']}, {g.graph['ranks']} ranks; attention, merge "
             f"and sample on ranks {ranks_text(g.nodes[('sample', LayerID(L))]['ranks'])}"]
    rows = [" ".join(f"E{n[1].expert}@{ranks_text(g.nodes[n]['ranks'])}" for n in experts_of(g, l)) or "dense"
            for l in range(L)]
    start = 0
    for l in range(1, L + 1):
        if l == L or rows[l] != rows[start]:
            lines.append(f"  L{start}{f'-{l - 1}' if l - 1 > start else ''}: {rows[start]}")
            start = l
    return "\n".join(lines)
