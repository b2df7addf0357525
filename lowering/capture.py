"""Capture pass: CUDA graph bucket lists per stage kind, which layers share a pool, graph memory.

A batch is padded up to the smallest bucket that holds it and replays the graph captured for
that (stage, bucket). Graphs of every layer at one (kind, bucket) run one at a time on a rank, so
they share one memory pool and one set of static input/output buffers: graph memory then grows
with the number of buckets, not with layers x buckets (the StreamEP trick).
The plan is computed on every device so `inspect` can show it; only cuda captures.
A graph kind is a node kind of the dataflow graph (attention, expert, sample), its batch cap that kind's cap.
"""
from __future__ import annotations

import networkx as nx

from graph_ir.graph import experts_by_rank
from lowering import sizes
from lowering.plan import PUBLISHED_ATTN_BUCKETS, PUBLISHED_EXPERT_BUCKETS, CapturePlan, CapturePool

# Fixed device cost of one captured graph (graph exec object, kernel nodes, allocator metadata).
# An estimate: the point is that it multiplies with graph count while the buffers do not.
GRAPH_OVERHEAD_BYTES = 256 * 1024


def buckets_for(published: list[int], cap: int) -> list[int]:
    """Published buckets up to the cap, doublings of the largest beyond them (a device-routed expert cap of several
    homes' batches: lowering.plan.default_expert_cap), and the cap itself as the last bucket so any batch fits."""
    out = [b for b in published if b < cap]
    b = 2 * published[-1]
    while b < cap:
        out.append(b)
        b *= 2
    return out + [cap]


def plan_capture(g: nx.DiGraph) -> CapturePlan:
    spec, caps, cluster = g.graph["spec"], g.graph["caps"], g.graph["cluster"]
    buckets = {"attn": buckets_for(PUBLISHED_ATTN_BUCKETS, caps.attn_tokens),
               "expert": buckets_for(PUBLISHED_EXPERT_BUCKETS, caps.expert_rows),
               "sample": buckets_for(PUBLISHED_ATTN_BUCKETS, caps.attn_tokens)}
    b = sizes.dtype_bytes(spec)
    # per stage kind: the layers of its nodes, whose graphs share a pool, and the static buffer bytes per row of a bucket
    kind_of = {"attention": "attn", "expert": "expert", "sample": "sample"}  # (a merge runs in the next attention)
    layers = {k: sorted({lid.layer for kind, lid in g.nodes if kind_of.get(kind) == k}) for k in buckets}
    attn_layers = layers["attn"]
    row_bytes = {"attn": max(sizes.attn_row_elems(spec, l) for l in attn_layers) * b,
                 "expert": sizes.expert_row_elems(spec) * b, "sample": sizes.sample_row_bytes(spec)}
    pools = [CapturePool(kind=kind, bucket=t, layers=layers[kind], static_buffer_bytes=t * row_bytes[kind])
             for kind in ("attn", "expert", "sample") for t in buckets[kind]]

    holders = {l: experts_by_rank(g, l) for l in layers["expert"]}
    graphs, memory = [], []
    for r in range(cluster.ranks):
        # A rank captures expert graphs only for layers where it holds experts.
        expert_layers = [l for l in layers["expert"] if r in holders[l]]
        n = len(attn_layers) * len(buckets["attn"]) + len(expert_layers) * len(buckets["expert"]) \
            + len(buckets["sample"])
        pool_bytes = sum(p.static_buffer_bytes for p in pools if p.kind != "expert" or expert_layers)
        graphs.append(n)
        memory.append(pool_bytes + n * GRAPH_OVERHEAD_BYTES if cluster.device == "cuda" else 0)
    return CapturePlan(enabled=cluster.device == "cuda", buckets=buckets, pools=pools,
                       graphs_per_rank=graphs, graph_memory_bytes=memory)
