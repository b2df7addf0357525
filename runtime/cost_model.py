"""Per-batch cost model: how long a batch of one stage kind and size takes, for virtual-clock runs.

Affine in the batch rows per stage kind. The defaults echo the shape of the paper's H200/L40S
measurements (see shared/docs/streamep.md): an expert batch costs nearly the same from 1 to
hundreds of rows (a large fixed part), attention grows with tokens, and every batch pays a fixed
launch/host cost. They are for relative comparisons of schedulers, not absolute predictions.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CostModel:
    attn_fixed: float = 60e-6
    attn_per_row: float = 1.0e-6
    expert_fixed: float = 150e-6
    expert_per_row: float = 0.3e-6
    sample_fixed: float = 30e-6
    sample_per_row: float = 0.5e-6

    def duration(self, kind: str, rows: int) -> float:
        fixed, per_row = {"attn": (self.attn_fixed, self.attn_per_row),
                          "expert": (self.expert_fixed, self.expert_per_row),
                          "sample": (self.sample_fixed, self.sample_per_row)}[kind]
        return fixed + per_row * rows
