"""Decode-only serving, the paper's throughput setup: no prefill compute, the prompt's K/V cache is
filled with random values, and a request enters the pipeline at its last prompt token.

`RandomPrefixKV` wraps a paged KV store. `prefix(seq, n)` registers a sequence whose positions
0..n-1 hold random K/V; they are written (seeded per sequence and layer) the first time a layer
writes that sequence, when the K/V row shape and dtype are known, so it works for any attention
kind (GQA, MLA) without knowing the model. Executors that never touch the KV store (the simulated
one) never pay for it. Tokens of a decode-only run are not the model's tokens for the prompt: the
mode is for throughput studies only.
"""
from __future__ import annotations

import torch


def decode_only(engine, seed: int = 0) -> None:
    """Put `engine` in decode-only mode before any admission: its KV store fills prompts with random K/V, and an
    admitted request enters attn(0) at its last prompt token (the engine's `decode_only`). A RunOptions
    `engine_setup` hook; the lab's barrier rank mains call it themselves."""
    engine.kv = RandomPrefixKV(engine.kv, seed)
    engine.decode_only = True


class RandomPrefixKV:
    def __init__(self, inner, seed: int = 0) -> None:
        self.inner = inner
        self.seed = seed
        self._pending: dict[int, tuple[int, set]] = {}

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def prefix(self, seq_id: int, n: int) -> None:
        if n > 0:
            self._pending[seq_id] = (n, set())

    def write(self, layer: int, seq_id: int, positions, k: torch.Tensor, v: torch.Tensor) -> None:
        p = self._pending.get(seq_id)
        if p is not None and layer not in p[1]:
            n, done = p
            done.add(layer)
            g = torch.Generator().manual_seed((self.seed * 1_000_003 + seq_id * 1009 + layer) & 0x7FFF_FFFF)
            kr = torch.randn((n,) + tuple(k.shape[1:]), generator=g).to(k.dtype)
            vr = torch.randn((n,) + tuple(v.shape[1:]), generator=g).to(v.dtype)
            self.inner.write(layer, seq_id, list(range(n)), kr, vr)
            if len(done) == len(self.inner._k):
                del self._pending[seq_id]
        self.inner.write(layer, seq_id, positions, k, v)

    def read(self, layer: int, seq_id: int, length: int):
        return self.inner.read(layer, seq_id, length)

    def release(self, seq_id: int) -> None:
        self._pending.pop(seq_id, None)
        self.inner.release(seq_id)
