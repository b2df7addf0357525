"""Per-batch and per-message cost model: how long things take on the virtual clock.

Compute: affine in the batch rows per stage kind. An expert batch costs nearly the same from 1 to
hundreds of rows (a large fixed part), attention grows with tokens, and every batch pays a fixed
launch/host cost.

Communication, charged identically to every system (the wire itself, latency + bytes / bandwidth,
is the scenario's link model in lab/interference.py, not this file):
- `send_cpu`: host seconds the *sender* spends per point-to-point message it issues (torch
  `dist.isend` ~30 us on the H200 pair; ZeroMQ + gloo on the CPU machines ~230 us per message).
  Messages leave one after the other, `send_cpu` apart.
- `overlap_host`: True when host work pipelines with device work (a GPU: the CPU issues batch i's
  sends while the device runs batch i+1), so a streaming batch occupies its rank for
  max(device time, host time); False when both share the same cores (CPU-only runs): the sum.
- `collective_fixed`: per collective call (all-gather, all-reduce, all-to-all), the fixed cost
  every participant pays before its data moves (launch + NCCL/gloo setup). The data then moves
  over the links: a ring collective is R-1 (all-gather, reduce-scatter) link hops in sequence,
  each hop waiting for the slowest message of the step; a direct one is one hop to every peer.
- `collective_send_cpu`: host seconds per message *inside* a collective (0 on NCCL, where one call
  issues the whole collective; ~`send_cpu` on gloo, where every step is a host send).
- `collective_algo`: "ring" (NCCL's and gloo's default for all-gather/all-reduce) or "direct".

The defaults keep the original compute-only model (communication free for the sender, direct
collectives): they are what the unit tests use. Named profiles (`PROFILES`) carry measured numbers;
see benchmarks/results/cpu_bench.md for where each comes from.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class CostModel:
    attn_fixed: float = 60e-6
    attn_per_row: float = 1.0e-6
    expert_fixed: float = 150e-6
    expert_per_row: float = 0.3e-6
    sample_fixed: float = 30e-6
    sample_per_row: float = 0.5e-6
    send_cpu: float = 0.0
    overlap_host: bool = True
    collective_fixed: dict = field(default_factory=lambda: {"ag": 0.0, "ar": 0.0, "a2a": 0.0})
    collective_send_cpu: float = 0.0
    collective_algo: str = "direct"

    def __post_init__(self) -> None:
        if self.collective_algo not in ("ring", "direct"):
            raise ValueError(f"collective_algo {self.collective_algo!r}; valid: ring, direct")

    def duration(self, kind: str, rows: int) -> float:
        if kind.startswith("coll:"):
            return self.collective_fixed.get(kind[5:], 0.0)
        fixed, per_row = {"attn": (self.attn_fixed, self.attn_per_row),
                          "expert": (self.expert_fixed, self.expert_per_row),
                          "sample": (self.sample_fixed, self.sample_per_row)}[kind]
        return fixed + per_row * rows

    def with_sends(self, device: float, messages: int) -> float:
        """How long a batch of `device` seconds that then issues `messages` sends holds its rank."""
        host = messages * self.send_cpu
        return max(device, host) if self.overlap_host else device + host
