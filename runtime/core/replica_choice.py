"""Which copy of a replicated expert a home sends its rows to: chosen per batch, at dispatch, from live state.

`dataflow compile --replicas` puts copies of some experts on further ranks (lowering/plan.py Placement.replicas);
every copy computes the same function, so a row may go to any of them and the tokens do not change. A barrier EP
picks copies statically (EPLB); a barrier-free home can see where its rows are slow to come back right now.

The rule. A home measures, per rank, how long its rows take to come back from there: dispatch to merge, an
exponential average over its recent dispatches (`turnaround`). That one number holds the link's delay both ways
and the queue and compute at the holder, so a slow link and a busy GPU look alike: slow. For each replicated
expert of a batch the copy with the least turnaround wins; ties go to this rank (no link), then to the lower rank.
A rank not measured yet counts as 0, so every copy gets tried; an estimate halves every HALF_LIFE_S without a new
measurement, so a link that recovered gets rows again. Experts without copies go to their owner, as without
replicas.
"""
from __future__ import annotations

import numpy as np

from runtime.core.merge import TAG_SHIFT

ALPHA = 0.3  # weight of the newest measurement in the average
HALF_LIFE_S = 0.02  # an unrefreshed estimate halves this often (the bench's link bursts last a few ms per 20 ms)
_SLOTS = 1 << 16  # dispatch times kept by merge-group id (a group lives far shorter than 65k dispatches)


class ReplicaChoice:
    def __init__(self, expert_rank: list[list[int]], replicas: list[list[list[int]]], rank: int, world: int) -> None:
        self.rank = rank
        self.owner = [np.asarray(er, dtype=np.int64) for er in expert_rank]
        # per layer with copies: (the replicated experts [n], their copies [n, most copies]), each row in the order
        # ties go (this rank first, then ascending), padded with `world`, whose estimate is infinite; layers without
        # copies are absent. One argmin per batch picks every copy (a Python min per expert cost ~1 us each on the
        # dispatch path).
        self.copies: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        for layer, reps in enumerate(replicas):
            held = [(e, sorted({int(expert_rank[layer][e]), *r}, key=lambda c: (c != rank, c)))
                    for e, r in enumerate(reps) if r]
            if held:
                width = max(len(c) for _, c in held)
                self.copies[layer] = (np.array([e for e, _ in held]),
                                      np.array([c + [world] * (width - len(c)) for _, c in held]))
        self.turnaround = np.zeros(world + 1)  # seconds; [world]: the padding, never chosen
        self.turnaround[world] = np.inf
        self.measured_at = np.zeros(world + 1)
        self._sent_at = np.zeros(_SLOTS)

    def owners(self, layer: int, now: float) -> np.ndarray:
        """The expert -> rank table for a batch of `layer` dispatched now (the owner table where nothing is replicated)."""
        held = self.copies.get(layer)
        if held is None:
            return self.owner[layer]
        experts, copies = held
        est = (self.turnaround * 0.5 ** ((now - self.measured_at) / HALF_LIFE_S))[copies]
        owner = self.owner[layer].copy()
        owner[experts] = copies[np.arange(len(experts)), est.argmin(axis=1)]  # (argmin: the first of equal ones)
        return owner

    def sent(self, gid: int, now: float) -> None:
        """Merge group `gid` was dispatched now."""
        self._sent_at[gid % _SLOTS] = now

    def returned(self, rank: int, rows, now: float) -> None:
        """Rows of a merge group (their tags' wire form: runtime/core/expert_wire.py) came back from `rank`."""
        first = rows[0] if type(rows) is tuple else int(rows[0])
        took = now - self._sent_at[(first >> TAG_SHIFT) % _SLOTS]
        self.turnaround[rank] += ALPHA * (took - self.turnaround[rank])
        self.measured_at[rank] = now
