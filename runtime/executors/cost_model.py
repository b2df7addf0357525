"""Per-batch and per-message cost model: how long things take on the virtual clock.

Compute: affine in the batch rows per stage kind. An expert batch costs nearly the same from 1 to
hundreds of rows (a large fixed part), attention grows with tokens, and every batch pays a fixed
launch/host cost.

Communication, charged identically to every system (the wire itself, latency + bytes / bandwidth,
is the scenario's link model in lab/interference.py, not this file):
- `send_cpu`: host seconds the *sender* spends per point-to-point message it issues (torch
  `dist.isend` ~30 us on the H200 pair; ZeroMQ + gloo on the CPU machines ~230 us per message).
  Messages leave one after the other, `send_cpu` apart.
- `busy_receive`: where a message that lands while its rank runs a batch has its receive (header, payload,
  completion) done only after the batch, the seconds from the batch's end until it is ready, drawn per message
  (rng -> s); the rank takes it at its next loop turn, and if it starts another batch before then, the receive
  starts over at that batch's end. CPU rank processes: their receive threads wait for the engine thread's GIL
  (benchmarks/results/sim_validation.md, session 27). None: ready at the batch's end.
- `overlap_host`: True when host work pipelines with device work (a GPU: the CPU issues batch i's
  sends while the device runs batch i+1), so a streaming batch occupies its rank for
  max(device time, host time); False when both share the same cores (CPU-only runs): the sum.

The streaming engine runs no collectives; what the barrier baselines' collectives cost is the lab's
(lab/barrier.py BarrierCostModel, a subclass). The defaults keep the original compute-only model (communication
free for the sender): they are what the unit tests use. Measured profiles are the lab's cost files
(lab/costs/, the bench configs' `cost:`); benchmarks/results/cpu_bench.md says where each number comes from.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional


_FIELDS = {k: (f"{k}_fixed", f"{k}_per_row") for k in ("attn", "expert", "sample")}


@dataclass(frozen=True)
class CostModel:
    attn_fixed: float = 60e-6
    attn_per_row: float = 1.0e-6
    expert_fixed: float = 150e-6
    expert_per_row: float = 0.3e-6
    sample_fixed: float = 30e-6
    sample_per_row: float = 0.5e-6
    # an expert batch's cost per distinct expert beyond its first: the weights each further expert reads (expert
    # replicas put more distinct experts in a rank's batches); 0 keeps a batch's cost independent of its experts
    expert_per_expert: float = 0.0
    send_cpu: float = 0.0
    busy_receive: Optional[Callable[[object], float]] = field(default=None, compare=False)  # (a random.Random) -> s
    overlap_host: bool = True

    def duration(self, kind: str, rows: int, experts: int = 1) -> float:
        """Seconds of a batch of `rows` rows (an expert batch: of `experts` distinct experts)."""
        fixed, per_row = _FIELDS[kind]  # (no dict of tuples made per call)
        more = self.expert_per_expert * (experts - 1) if kind == "expert" and experts > 1 else 0.0
        return getattr(self, fixed) + getattr(self, per_row) * rows + more

    def min_duration(self) -> float:
        """No batch is shorter (per-row and per-expert costs are never negative): the shortest empty batch's."""
        return min(self.duration(k, 0) for k in _FIELDS)

    def with_sends(self, device: float, messages: int) -> float:
        """How long a batch of `device` seconds that then issues `messages` sends holds its rank."""
        host = messages * self.send_cpu
        return max(device, host) if self.overlap_host else device + host
