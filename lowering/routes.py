"""Routes pass: for each edge of the stage chain, which rank pairs exchange what, and the
largest message the transport must be ready for (it sizes receive buffers from this).

attn(l) -> expert(l)        dispatch: home ranks send rows of the post-attention normed hidden state,
                            one row per (token, chosen expert), to the ranks holding those experts.
                            One attention batch (<= attn cap tokens) sends a rank at most
                            min(top_k, experts held there) rows per token.
expert(l) -> attn(l+1)/sample  combine: expert outputs go back to each row's home rank, where the
                            top-k merge waits for all k. One expert batch is <= expert cap rows.
dense attn(l) -> next, sample -> attn(0): stays on the home rank; nothing crosses the wire.
The ranks come from the dataflow graph's edges that cross ranks: attention -> expert nodes (the homes to the holders)
and expert -> merge nodes (back); the other edges join nodes that run on the same ranks.
Routing weights, request ids and positions travel in the metadata message, not in these bytes.

With the device-routed dispatch (plan.cluster.dispatch == "device", runtime/core/routed_rows.py) the dispatch carries
the whole attention batch to every holder, one row per token with its top-k expert ids and routing weights packed
behind the hidden state (8k bytes), and the combine carries one row per token back from each holder, the weighted
sum of its own slots' outputs (the home adds the holders' rows); an expert batch is <= expert cap slots, so it
returns <= cap / k rows.
"""
from __future__ import annotations

import networkx as nx

from graph_ir.graph import LayerID, experts_by_rank
from lowering import sizes
from lowering.plan import Route


def plan_routes(g: nx.DiGraph) -> list[Route]:
    spec, stages, caps = g.graph["spec"], g.graph["stages"], g.graph["caps"]
    row = spec.hidden_size * sizes.dtype_bytes(spec)
    whole = g.graph["cluster"].dispatch == "device"
    k = spec.experts.top_k
    routes = []
    for s in stages:
        dst = stages[s.next]
        homes = g.nodes[("sample" if s.kind == "sample" else "attention", LayerID(s.layer))]["ranks"]
        if s.kind == "attn" and dst.kind == "expert":
            held = experts_by_rank(g, s.layer)
            if whole:  # int32 ids and fp32 weights behind the row (runtime/routed_rows.pack)
                row_bytes, rows = row + 8 * k, caps.attn_tokens
                carries = (f"whole attention batches of layer {s.layer}: each token's normed hidden row with its "
                           f"top-{k} expert ids and weights, to every holder")
            else:
                row_bytes, rows = row, caps.attn_tokens * min(k, max(map(len, held.values())))
                carries = f"normed hidden rows of layer {s.layer}, one per (token, expert)"
            edge = dict(kind="dispatch", pattern="all_to_holders", src_ranks=homes, dst_ranks=sorted(held))
        elif s.kind == "expert":
            # (device-routed: a batch of <= cap slots, whole tokens of k slots each, one row per token back)
            row_bytes, rows = row, (-(-caps.expert_rows // k) if whole else caps.expert_rows)
            carries = (f"one row per token of layer {s.layer} back to its home: the weighted sum of this holder's "
                       f"slots (the home adds the holders' rows)" if whole else
                       f"expert outputs of layer {s.layer} back to their home rank's top-k merge")
            edge = dict(kind="combine", pattern="holders_to_all", src_ranks=sorted(experts_by_rank(g, s.layer)),
                        dst_ranks=g.nodes[("merge", LayerID(s.layer))]["ranks"])
        else:
            row_bytes, rows = row, caps.attn_tokens
            carries = "next decode token to layer 0" if s.kind == "sample" else \
                (f"hidden state of layer {s.layer} to " + ("the sampler" if dst.kind == "sample"
                                                            else f"layer {dst.layer}"))
            edge = dict(kind="local", pattern="self", src_ranks=homes, dst_ranks=homes)
        # a local edge sends no message
        routes.append(Route(src_stage=s.id, dst_stage=dst.id, carries=carries, row_bytes=row_bytes, max_rows=rows,
                            max_message_bytes=0 if edge["kind"] == "local" else rows * row_bytes, **edge))
    return routes
