"""Queue pass: the stage chain and each rank's mu-queue table.

The chain is attn(0), expert(0), attn(1), ..., attn(L-1), expert(L-1), sample; dense layers have
no expert stage (their MLP runs inside attention on the home rank) and sample wraps to attn(0).
Every rank has one queue per stage with the same ids, so a stage id means the same on every rank
and the scheduler's lookahead walks the same chain everywhere.
"""
from __future__ import annotations

from graph_ir.spec import ModelSpec
from lowering.plan import BatchCaps, Placement, QueueEntry, RankPlan, Stage


def build_stages(spec: ModelSpec) -> list[Stage]:
    kinds: list[tuple[str, int]] = []
    for layer in range(spec.num_layers):
        kinds.append(("attn", layer))
        if spec.is_moe_layer(layer):
            kinds.append(("expert", layer))
    kinds.append(("sample", spec.num_layers))
    n = len(kinds)
    return [Stage(id=i, kind=k, layer=l, next=(i + 1) % n) for i, (k, l) in enumerate(kinds)]


def build_queues(spec: ModelSpec, stages: list[Stage], placement: Placement, caps: BatchCaps,
                 ranks: int) -> list[RankPlan]:
    def queue(s: Stage, r: int) -> QueueEntry:
        expert = s.kind == "expert"
        return QueueEntry(stage_id=s.id, kind=s.kind, layer=s.layer, next_stage=s.next,
                          batch_cap=caps.expert_rows if expert else caps.attn_tokens,
                          experts=placement.experts_on(s.layer, r) if expert else [])

    return [RankPlan(rank=r, queues=[queue(s, r) for s in stages]) for r in range(ranks)]
