"""Stage and queue passes: the stage chain, walked along the dataflow graph, and each rank's mu-queue table.

The chain is attn(0), expert(0), attn(1), ..., attn(L-1), expert(L-1), sample; dense layers have
no expert stage (their MLP runs inside attention on the home rank) and sample wraps to attn(0).
A layer's merge node is no stage: the top-k merge runs when the next stage's batch is assembled.
Every rank has one queue per stage with the same ids, so a stage id means the same on every rank
and the scheduler's lookahead walks the same chain everywhere.
"""
from __future__ import annotations

import networkx as nx

from graph_ir.graph import experts_by_rank, stage_chain
from lowering.plan import QueueEntry, RankPlan, Stage


def build_stages(g: nx.DiGraph) -> list[Stage]:
    chain = stage_chain(g)
    return [Stage(id=i, kind=k, layer=l, next=(i + 1) % len(chain)) for i, (k, l) in enumerate(chain)]


def build_queues(g: nx.DiGraph) -> list[RankPlan]:
    """Every rank gets a queue for every stage; an expert stage's queue lists the experts of the layer whose nodes
    run on the rank (copies included)."""
    stages, caps = g.graph["stages"], g.graph["caps"]
    held = {s.layer: experts_by_rank(g, s.layer) for s in stages if s.kind == "expert"}

    def queue(s: Stage, r: int) -> QueueEntry:
        expert = s.kind == "expert"
        return QueueEntry(stage_id=s.id, kind=s.kind, layer=s.layer, next_stage=s.next,
                          batch_cap=caps.expert_rows if expert else caps.attn_tokens,
                          experts=held[s.layer].get(r, []) if expert else [])

    return [RankPlan(rank=r, queues=[queue(s, r) for s in stages]) for r in range(g.graph["ranks"])]
