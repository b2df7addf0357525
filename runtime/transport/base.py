"""The contract every transport keeps (in-process, ZeroMQ + torch.distributed, simulated network).

A message is a small picklable metadata dict (stage, request ids, positions, top-k weights, ...)
plus at most one tensor. The engine never blocks on the wire: `send` enqueues and returns, and
completed arrivals are collected with `poll`. Messages between one (src, dst) pair arrive in the
order they were sent; nothing is promised across pairs.

Transports subclass `Transport`, which holds the defaults of the two optional parts: `recv_into` (receive in place)
and `post_receives`. The engine sets `recv_into` on every transport; one that has no receive to aim (in-process: the
sent tensor is the arrival) never calls it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Protocol

import torch


@dataclass
class Arrival:
    src: int
    meta: dict
    tensor: Optional[torch.Tensor]


class LinkDelays(Protocol):
    """Extra per-message delays a transport applies inside each lane, after the message completed and before it is
    handed on, so per-peer order holds (fault injection: the tests' lab/chaos.py, the lab's link disturbances)."""

    def lane(self, direction: str, me: int, peer: int) -> Callable[[], float]:
        """The delay source of one lane ("send" or "recv", this rank, the peer): each call, the next message's
        seconds."""


class Transport(Protocol):
    rank: int
    world_size: int
    # Receive in place (phase 2 of ZmqDistTransport knows a message's shape and meta before its tensor): called with
    # (src, meta, shape, torch dtype) before a receive is posted; returns (a contiguous tensor of that shape and dtype
    # to receive into, a CUDA event the receive must wait for or None), or None for a buffer of the transport's own.
    # Runs on the engine thread. Set by the engine (Engine._landing: expert outputs into their merge buffer).
    recv_into: Optional[Callable[[int, dict, tuple, torch.dtype], Optional[tuple]]] = None

    def send(self, dst: int, meta: dict, tensor: Optional[torch.Tensor]) -> None:
        """Queue a message for `dst` (may be self). Never blocks on the network."""

    def poll(self) -> list[Arrival]:
        """Messages that fully arrived since the last poll, per-source FIFO."""

    def post_receives(self) -> None:
        """Start the transfers of messages already announced, so that a later poll() finds them done
        (ZmqDistTransport with engine-thread receives; by default there is nothing to start)."""

    def pending(self) -> int:
        """Messages sent by this rank that are not yet delivered (for idle/termination checks)."""

    def close(self) -> None:
        """Release sockets/threads. Idempotent."""
