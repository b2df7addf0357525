"""The barrier baselines' expert replicas: a static copy per (home, expert), as SGLang's static EPLB dispatch picks.

With `dataflow compile --replicas` some experts have copies on further ranks (lowering/plan.py Placement.replicas).
The streaming engine chooses a copy per batch from live turnaround times (runtime/core/replica_choice.py); a barrier
EP fixes the choice: a home uses its own copy where it holds one (no link), else copy `home mod copies`, which spreads
the homes over the copies. Same replicas, same memory, for every system: only the choice differs.
"""
from __future__ import annotations

import torch


def static_owners(placement, ranks: int) -> list[torch.Tensor]:
    """Per layer, int64 [ranks, E]: row h is the rank home h sends expert e's rows to ([0, 0] for dense layers), from
    a plan's Placement. A barrier EP runs attention on every rank: a disaggregated placement is refused."""
    if placement.attention_ranks:
        raise ValueError("the barrier baselines run attention on every rank; compile without --attention-ranks")
    expert_rank, replicas = placement.expert_rank, placement.replicas
    out = []
    for layer, owners in enumerate(expert_rank):
        table = torch.tensor(owners, dtype=torch.int64).repeat(ranks, 1) if owners else torch.zeros(0, 0)
        for e, reps in enumerate(replicas[layer] if replicas else ()):
            copies = [owners[e], *reps]
            for h in range(ranks):
                table[h, e] = h if h in copies else copies[h % len(copies)]
        out.append(table.to(torch.int64))
    return out
