"""The contract every transport keeps (in-process, ZeroMQ + torch.distributed, simulated network).

A message is a small picklable metadata dict (stage, request ids, positions, top-k weights, ...)
plus at most one tensor. The engine never blocks on the wire: `send` enqueues and returns, and
completed arrivals are collected with `poll`. Messages between one (src, dst) pair arrive in the
order they were sent; nothing is promised across pairs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

import torch


@dataclass
class Arrival:
    src: int
    meta: dict
    tensor: Optional[torch.Tensor]


class Transport(Protocol):
    rank: int
    world_size: int

    def send(self, dst: int, meta: dict, tensor: Optional[torch.Tensor]) -> None:
        """Queue a message for `dst` (may be self). Never blocks on the network."""

    def poll(self) -> list[Arrival]:
        """Messages that fully arrived since the last poll, per-source FIFO."""

    def post_receives(self) -> None:
        """Optional: start the transfers of messages already announced, so that a later poll() finds them done
        (ZmqDistTransport with engine-thread receives; other transports have nothing to start)."""

    def pending(self) -> int:
        """Messages sent by this rank that are not yet delivered (for idle/termination checks)."""

    def close(self) -> None:
        """Release sockets/threads. Idempotent."""
