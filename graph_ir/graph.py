"""The token-level dataflow graph of a model on a cluster: what a token goes through, as data.

Nodes are `(kind, LayerID)`:
  ("attention", LayerID(l, h, -1))  layer l's attention (+ router / shared expert / dense MLP) on home rank h
  ("expert",    LayerID(l, h, e))   expert e of layer l, for tokens whose home is h; runs on the rank
                                    that holds e (node attribute `rank`)
  ("merge",     LayerID(l, h, -1))  the top-k merge on home h: waits for all k expert rows of a token
  ("sample",    LayerID(L, h, -1))  final norm + LM head + sampler on home h (layer index L = num_layers)
Edges: attention(l,h) -> expert(l,h,e) for every e -> merge(l,h) -> attention(l+1,h); a dense layer
goes attention(l,h) -> attention(l+1,h); the last layer feeds sample(h), and sample(h) ->
attention(0,h) closes the decode loop. A LayerID is exactly the routing key the runtime's metadata
carries, so this graph and the runtime agree on what a token's next hop is.

Homes never exchange tokens (a request lives on its home rank), so the graph is one identical
subgraph per home; `build_graph(spec, R, homes=[0])` builds one of them, cheap enough for every compile.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import networkx as nx

from graph_ir.spec import ModelSpec

NODE_KINDS = ("attention", "expert", "merge", "sample")


class LayerID(NamedTuple):
    layer: int
    home_rank: int
    expert: int = -1


Node = tuple[str, LayerID]


class GraphValidationError(ValueError):
    """The graph breaks an invariant: a bug in whatever built it, listed problem by problem."""


def _contiguous(num_experts: int, ranks: int) -> list[int]:
    # Same rule as lowering.placement.contiguous; duplicated (one line) so graph_ir does not
    # import lowering (data flows graph_ir -> lowering only).
    return [e * ranks // num_experts for e in range(num_experts)]


def build_graph(spec: ModelSpec, ranks: int, placement: Optional[Sequence[Sequence[int]]] = None,
                homes: Optional[Sequence[int]] = None) -> nx.DiGraph:
    """Build the dataflow graph for `spec` on `ranks` ranks.

    `placement`: per-layer expert->rank table (`plan.placement.expert_rank`; [] for dense layers);
    None places experts contiguously. `homes`: which home ranks to build (default all).
    """
    if placement is None:
        table = [(_contiguous(spec.experts.num_experts, ranks) if spec.is_moe_layer(l) else [])
                 for l in range(spec.num_layers)]
    else:
        table = [list(row) for row in placement]
    if homes is None:
        homes = range(ranks)
    L, E = spec.num_layers, spec.experts.num_experts
    g = nx.DiGraph(model=spec.name, num_layers=L, num_experts=E, top_k=spec.experts.top_k,
                   dense_layers=sorted(set(spec.dense_layers)), ranks=ranks)

    def add(kind: str, lid: LayerID, rank: int) -> Node:
        node = (kind, lid)
        g.add_node(node, kind=kind, lid=lid, rank=rank)
        return node

    for h in homes:
        sample = add("sample", LayerID(L, h), h)
        prev: Optional[Node] = None
        first: Optional[Node] = None
        for layer in range(L):
            attn = add("attention", LayerID(layer, h), h)
            if prev is None:
                first = attn
            else:
                g.add_edge(prev, attn)
            if spec.is_moe_layer(layer):
                merge = add("merge", LayerID(layer, h), h)
                for e, rank in enumerate(table[layer]):
                    ex = add("expert", LayerID(layer, h, e), rank)
                    g.add_edge(attn, ex)
                    g.add_edge(ex, merge)
                prev = merge
            else:
                prev = attn
        g.add_edge(prev, sample)
        g.add_edge(sample, first)
    return g


def graph_problems(g: nx.DiGraph) -> list[str]:
    """Every broken invariant, as readable lines (empty list: the graph is valid)."""
    L, E, k = g.graph["num_layers"], g.graph["num_experts"], g.graph["top_k"]
    ranks = g.graph["ranks"]
    dense = set(g.graph["dense_layers"])
    problems: list[str] = []
    homes = sorted({lid.home_rank for _, lid in g.nodes})
    for node, data in g.nodes(data=True):
        kind, lid = node
        if kind not in NODE_KINDS:
            problems.append(f"{node}: unknown node kind {kind!r}")
            continue
        if g.degree(node) == 0:
            problems.append(f"{node}: orphan node (no edges)")
        if not 0 <= data["rank"] < ranks:
            problems.append(f"{node}: runs on rank {data['rank']}, outside 0..{ranks - 1}")
        if kind == "expert":
            if not 0 <= lid.expert < E:
                problems.append(f"{node}: expert id {lid.expert} outside 0..{E - 1}")
            if lid.layer in dense:
                problems.append(f"{node}: expert node in dense layer {lid.layer}")
        elif lid.expert != -1:
            problems.append(f"{node}: {kind} node must have expert -1")
        if kind == "merge":
            sources = [p for p in g.predecessors(node) if p[0] == "expert" and p[1].layer == lid.layer
                       and p[1].home_rank == lid.home_rank]
            got = sorted(p[1].expert for p in sources)
            if got != list(range(E)):
                problems.append(f"{node}: merge fed by experts {got}, needs all {E} experts of layer {lid.layer}")
            if k > g.in_degree(node):
                problems.append(f"{node}: top_k {k} > {g.in_degree(node)} inputs: a token could never complete")
        for succ in g.successors(node):
            if succ[1].home_rank != lid.home_rank:
                problems.append(f"{node} -> {succ}: edge crosses homes; a request never leaves its home")
    for h in homes:
        sample, first = ("sample", LayerID(L, h)), ("attention", LayerID(0, h))
        if sample not in g or first not in g:
            problems.append(f"home {h}: missing sample or layer-0 attention node")
            continue
        if not g.has_edge(sample, first):
            problems.append(f"home {h}: chain does not close (no edge sample -> attention(0))")
        # One traversal each way per home, not a path search per layer: has_path per layer made this
        # O(layers^2 x experts) (minutes for a 256-layer, 512-expert spec).
        after_first = nx.descendants(g, first) | {first}
        before_sample = nx.ancestors(g, sample) | {sample}
        for layer in range(L):
            a = ("attention", LayerID(layer, h))
            if a not in g:
                problems.append(f"home {h}: no attention node for layer {layer}")
            elif a not in after_first or a not in before_sample:
                problems.append(f"home {h}: layer {layer} attention is not on the chain attention(0) -> sample")
            if layer not in dense and ("merge", LayerID(layer, h)) not in g:
                problems.append(f"home {h}: MoE layer {layer} has no merge node")
    return problems


def validate_graph(g: nx.DiGraph) -> None:
    problems = graph_problems(g)
    if problems:
        shown = problems[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else [])
        raise GraphValidationError("dataflow graph is invalid:\n  " + "\n  ".join(shown))


def node_label(node: Node) -> str:
    kind, lid = node
    if kind == "expert":
        return f"E{lid.expert} L{lid.layer} h{lid.home_rank}"
    if kind == "sample":
        return f"sample h{lid.home_rank}"
    return f"{'attn' if kind == 'attention' else 'merge'} L{lid.layer} h{lid.home_rank}"


def to_dot(g: nx.DiGraph) -> str:
    """DOT text (Graphviz) of the graph, one cluster per home rank; experts show their rank.
    Written by hand so no pydot/pygraphviz dependency is needed."""
    ids = {n: f"n{i}" for i, n in enumerate(g.nodes)}
    shape = {"attention": "box", "expert": "ellipse", "merge": "diamond", "sample": "doubleoctagon"}
    out = [f'digraph "{g.graph.get("model", "model")}" {{', "  rankdir=TB;", '  node [fontname="Helvetica"];']
    homes = sorted({n[1].home_rank for n in g.nodes})
    for h in homes:
        out.append(f'  subgraph cluster_home{h} {{ label="home rank {h}";')
        for n, data in g.nodes(data=True):
            if n[1].home_rank == h:
                label = node_label(n) + (f"\\n@rank {data['rank']}" if n[0] == "expert" else "")
                out.append(f'    {ids[n]} [label="{label}", shape={shape[n[0]]}];')
        out.append("  }")
    for a, b in g.edges:
        style = ' [style=dashed, label="next step"]' if a[0] == "sample" else ""
        out.append(f"  {ids[a]} -> {ids[b]}{style};")
    out.append("}")
    return "\n".join(out) + "\n"
