"""The barrier baselines' expert replicas: a static copy per (home, expert), as SGLang's static EPLB dispatch picks.

With `dataflow compile --replicas` some experts have copies on further ranks (lowering/plan.py Placement.replicas).
The streaming engine chooses a copy per batch from live turnaround times (runtime/core/replica_choice.py); a barrier
EP fixes the choice: a home uses its own copy where it holds one (no link), else copy `home mod copies`, which spreads
the homes over the copies. Same replicas, same memory, for every system: only the choice differs.
"""
from __future__ import annotations

import torch


class StaticCopies:
    """An ablation for the streaming engine (RunOptions.engine_setup; picklable, so rank processes apply it too): its
    homes choose copies by the barrier baselines' static rule instead of measured turnaround (the bench's
    `streaming+rNs`), which tells what the live choice adds to the replicas themselves."""

    def __call__(self, engine) -> None:
        if engine._replica is not None:
            from lowering.plan import Placement
            tables = static_owners(Placement(expert_rank=engine.cfg.expert_rank, replicas=engine.cfg.replicas),
                                   engine.cfg.world_size)
            engine._replica = _Fixed([t[engine.rank].numpy() if t.numel() else None for t in tables])


class _Fixed:
    def __init__(self, owners: list) -> None:
        self.table = owners

    def owners(self, layer: int, now: float):
        return self.table[layer]

    def sent(self, gid: int, now: float) -> None:
        pass

    def returned(self, rank: int, rows, now: float) -> None:
        pass


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
