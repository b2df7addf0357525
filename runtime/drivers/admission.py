"""Admission: which rank homes a request, and the message that carries it there.

`Admission` keeps the arrived-but-not-admitted requests in FIFO order and places the head on a rank with room
for all the KV it can ever need; when no rank has room it waits (head-of-line on purpose: letting small requests
overtake would starve big ones). It only reads free-block counts, so an in-process cluster can pass the engines'
real counts and a multi-process coordinator can pass its mirror of them (exact, because pages are reserved at
admission and freed at finish, both of which it sees). The coordinator sends the admitted request to its home as
`request_to_wire`'s plain values (runtime/drivers/control.py's `adm`).
"""
from __future__ import annotations

from collections import deque
from typing import Optional

import numpy as np

from runtime.core.requests import Request

HOME_POLICIES = ("most_free_kv", "round_robin")

_WIRE_FIELDS = {"rid": (int,), "name": (str, int), "prompt": (np.ndarray,), "max_new_tokens": (int,),
                "params": (dict, type(None)), "ignore_eos": (bool,), "arrival": (float, int), "home": (int,),
                "stop_token_ids": (np.ndarray,)}


def request_to_wire(req: Request) -> dict:
    """A request as the coordinator's admission message carries it (runtime/transport/wire.py: plain values, no
    pickle): what the home needs to serve it; its state starts empty there."""
    return {"rid": req.rid, "name": req.name, "prompt": np.asarray(req.prompt, dtype=np.int64),
            "max_new_tokens": req.max_new_tokens, "ignore_eos": req.ignore_eos, "arrival": req.arrival,
            "home": req.home, "params": None if req.params is None else req.params.model_dump(),
            "stop_token_ids": np.asarray(req.stop_token_ids, dtype=np.int64)}


def request_from_wire(d: dict) -> Request:
    """The inverse of request_to_wire; ValueError (pydantic's included) for a field of the wrong type or range."""
    from models.sampling import SamplingParams
    if type(d) is not dict or d.keys() != _WIRE_FIELDS.keys():
        raise ValueError(f"a request carries the fields {sorted(_WIRE_FIELDS)}, got {sorted(map(str, d))[:10]}")
    for key, types in _WIRE_FIELDS.items():
        if type(d[key]) not in types:
            raise ValueError(f"request field {key!r} is a {type(d[key]).__name__}")
    if d["prompt"].dtype != np.int64 or not len(d["prompt"]) or d["max_new_tokens"] < 1:
        raise ValueError("a request needs a non-empty int64 prompt and max_new_tokens >= 1")
    if d["stop_token_ids"].dtype != np.int64 or d["stop_token_ids"].ndim != 1:
        raise ValueError("a request's stop_token_ids are a 1-d int64 array")
    params = None if d["params"] is None else SamplingParams.model_validate(d["params"])
    return Request(d["rid"], d["name"], d["prompt"].tolist(), d["max_new_tokens"], params=params,
                   ignore_eos=d["ignore_eos"], arrival=float(d["arrival"]), home=d["home"],
                   stop_token_ids=tuple(d["stop_token_ids"].tolist()))


class Admission:
    """FIFO admission queue with a home-rank policy."""

    def __init__(self, block_size: int, capacity_blocks: list[int], policy: str = "most_free_kv",
                 homes: Optional[list[int]] = None) -> None:
        if policy not in HOME_POLICIES:
            raise ValueError(f"home policy {policy!r}; valid: {', '.join(HOME_POLICIES)}")
        self.block_size = block_size
        self.capacity = list(capacity_blocks)
        self.policy = policy
        # the ranks that may home a request (a disaggregated plan's attention ranks: Placement.homes); None: every rank
        self.homes = None if homes is None else set(homes)
        self._waiting: deque[Request] = deque()
        self._rr = 0

    def blocks_needed(self, req: Request) -> int:
        return -(-req.kv_tokens // self.block_size)

    def submit(self, req: Request) -> None:
        need = self.blocks_needed(req)
        most = max(c for r, c in enumerate(self.capacity) if self.homes is None or r in self.homes)
        if need > most:
            # Could never be admitted: refuse now instead of waiting forever.
            raise ValueError(f"request {req.name!r} needs {need} KV blocks ({req.kv_tokens} tokens) but the "
                             f"largest rank holds {most}")
        self._waiting.append(req)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def remove(self, rid: int) -> Optional[Request]:
        """Take a waiting request out (its client went away); None when it is not waiting."""
        for req in self._waiting:
            if req.rid == rid:
                self._waiting.remove(req)
                return req
        return None

    def pick_home(self, need: int, free_blocks: list[int]) -> Optional[int]:
        fits = [r for r, f in enumerate(free_blocks) if f >= need and (self.homes is None or r in self.homes)]
        if not fits:
            return None
        if self.policy == "most_free_kv":
            return max(fits, key=lambda r: (free_blocks[r], -r))  # ties: lowest rank
        n = len(free_blocks)
        for i in range(n):
            r = (self._rr + i) % n
            if r in fits:
                self._rr = (r + 1) % n
                return r
        return None

    def admit(self, free_blocks: list[int]) -> list[tuple[Request, int]]:
        """Place waiting requests in order while the head fits somewhere. `free_blocks` is updated."""
        out = []
        while self._waiting:
            req = self._waiting[0]
            need = self.blocks_needed(req)
            home = self.pick_home(need, free_blocks)
            if home is None:
                break
            self._waiting.popleft()
            free_blocks[home] -= need
            out.append((req, home))
        return out
