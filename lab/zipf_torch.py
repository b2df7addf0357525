"""ZipfRouting's draw as torch ops, so it can run inside the attention graph on the device.

A model's learned router runs inside the attention graph: its top-k costs the host nothing. The
synthetic Zipf router of the benchmarks ran on the host instead (zipf_kernel.py, ~200 us per attention
batch on the H200 host, in every system), which a real deployment never pays. This is the same draw as
torch tensor ops, capturable (no host synchronization, fixed shapes), bit for bit the draw of
zipf_kernel.py / the numpy passes on the CPU (tests/test_routing_override_vectorized.py):

    base = sm(sm(sm(req ^ seed) ^ pos) ^ layer),  h = sm(base ^ e),  u = ((h >> 11) + 0.5) / 2^53,
    score = logp[row(step), e] - log(-log(u)),  ids = top-k of score (descending),
    weights = exp(chosen - chosen[0]) / their sum (summed left to right),

with sm = SplitMix64. torch has no unsigned 64-bit arithmetic, so the uint64 values live in int64
tensors: addition and multiplication wrap the same way in two's complement, and a logical right
shift is the arithmetic shift with the sign-extended bits masked off. The per-request part
sm(req ^ seed) is hashed once on the host (`ZipfRouting.request_base`); the device gets it per row.

On CUDA the logarithms are the device's, not glibc's: a score can differ from the host's in its last
bit, which changes a choice only at an exact near-tie (tests on the device count them, NOTES §21).
"""
from __future__ import annotations

from typing import Optional

import torch

_M64 = 1 << 64


def _s64(c: int) -> int:
    """A uint64 constant as the int64 with the same bits."""
    return c - _M64 if c >= 1 << 63 else c


_ADD, _MUL1, _MUL2 = _s64(0x9E3779B97F4A7C15), _s64(0xBF58476D1CE4E5B9), _s64(0x94D049BB133111EB)
_INV53 = 1.0 / 9007199254740992.0  # 2^-53: exact


def _lsr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64-held uint64 bits."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def splitmix64(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64 finalizer on int64-held uint64 values (a new tensor)."""
    z = z + _ADD
    z = (z ^ _lsr(z, 30)) * _MUL1
    z = (z ^ _lsr(z, 27)) * _MUL2
    return z ^ _lsr(z, 31)


def zipf_route(base0: torch.Tensor, pos: torch.Tensor, layer: int, table: torch.Tensor, k: int,
               steps: Optional[torch.Tensor] = None, drift_every: int = 0, drift_stride: int = 1
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [T, k] int64, weights [T, k] float32) for rows with request bases base0 [T] (int64 bits of
    sm(req ^ seed)) at positions pos [T] int64; `table` [E, E] float64 is the layer's log-popularity
    per rotation (ZipfRouting._table) on pos's device; the step that picks the rotation is `steps`
    (default the position). Every shape is fixed by T: capturable in a CUDA graph."""
    E = table.shape[1]
    base = splitmix64(splitmix64(base0 ^ pos) ^ layer)
    h = splitmix64(base[:, None] ^ torch.arange(E, dtype=torch.int64, device=base.device)[None, :])
    u = (_lsr(h, 11).to(torch.float64) + 0.5) * _INV53
    if drift_every:
        step = pos if steps is None else steps
        logp = table.index_select(0, torch.remainder(torch.div(step, drift_every, rounding_mode="floor")
                                                     * drift_stride, E))
    else:
        logp = table[:1]
    score = logp - torch.log(-torch.log(u))
    chosen, ids = torch.topk(score, k, dim=1, largest=True, sorted=True)
    v = torch.exp(chosen - chosen[:, :1])
    total = v[:, 0]
    for j in range(1, k):  # left to right, as the compiled host loop sums
        total = total + v[:, j]
    return ids, (v / total[:, None]).to(torch.float32)
