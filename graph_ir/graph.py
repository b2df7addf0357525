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
subgraph per home; `build_graph(..., homes=[h])` builds one of them (`dataflow inspect --dot --rank h`). Its
invariants, checked by tests/test_graph.py, are those the compiler's plan check (lowering/check.py) asserts of the
stage chain and the placement.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import networkx as nx

from graph_ir.spec import ModelSpec


class LayerID(NamedTuple):
    layer: int
    home_rank: int
    expert: int = -1


Node = tuple[str, LayerID]


def build_graph(spec: ModelSpec, ranks: int, placement: Sequence[Sequence[int]], homes: Sequence[int]) -> nx.DiGraph:
    """Build the dataflow graph for `spec` on `ranks` ranks: `placement` is the per-layer expert->rank table
    (`plan.placement.expert_rank`; [] for dense layers), `homes` the home ranks to build."""
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
        for layer in range(L):
            attn = add("attention", LayerID(layer, h), h)
            if prev is not None:
                g.add_edge(prev, attn)
            if spec.is_moe_layer(layer):
                merge = add("merge", LayerID(layer, h), h)
                for e, rank in enumerate(placement[layer]):
                    ex = add("expert", LayerID(layer, h, e), rank)
                    g.add_edge(attn, ex)
                    g.add_edge(ex, merge)
                prev = merge
            else:
                prev = attn
        g.add_edge(prev, sample)
        g.add_edge(sample, ("attention", LayerID(0, h)))
    return g


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
