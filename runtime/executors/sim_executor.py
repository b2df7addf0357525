"""Simulated executor: the executor contract (runtime/executors/base.py) with no model behind it, for scheduler studies.

Hidden states are single float64 values that fold in the token, the position and the layer, so
routing (a seeded hash of that value) is deterministic and varies token by token, while every tensor
stays [T, 1]: the engine, queues, merge and transport run unchanged and cheaply, and a cost model
supplies the time. Sampled tokens are derived from the same value and never hit an EOS id, so a
simulated request always runs to its max_new_tokens.
"""
from __future__ import annotations

import random
from typing import Optional

import numpy as np
import torch
from torch import Tensor

from runtime.executors.base import ExecutorBase
from runtime.executors.torch_executor import row_blocks

_MOD = float(2 ** 40)  # keep values exact in float64


class SimExecutor(ExecutorBase):
    """Host-routed dispatch only (no experts_routed), sampling on the host (no sample_batch_start). Every tensor it
    returns is a new one (torch ops out of place, no buffers kept): `fresh_outputs`."""
    fresh_outputs = True

    def __init__(self, num_experts: int, top_k: int, vocab_size: int, eos_token_ids=(), seed: int = 0) -> None:
        if top_k > num_experts:
            raise ValueError(f"top_k {top_k} > num_experts {num_experts}")
        self.num_experts, self.top_k, self.vocab_size = num_experts, top_k, vocab_size
        self.eos = set(eos_token_ids)
        self.seed = seed

    @classmethod
    def for_spec(cls, spec, seed: int = 0) -> "SimExecutor":
        return cls(spec.experts.num_experts, spec.experts.top_k, spec.vocab_size, spec.eos_token_ids, seed)

    def embed(self, token_ids: list[int]) -> Tensor:
        return torch.tensor(token_ids, dtype=torch.float64).unsqueeze(1)

    def attention(self, layer: int, h: Tensor, positions: list[int], segments, kv) -> tuple[Tensor, Tensor]:
        if len(positions) <= 16:  # a few rows: the same float64 operations on Python floats (bit for bit: float % is
            # fmod with remainder's sign rule, as torch.remainder), in a numpy array (torch.tensor of a list: ~2 us more)
            vals = [(r[0] * 1_000_003 + p * 7919 + layer) % _MOD for r, p in zip(h.tolist(), positions)]
            h_res = torch.from_numpy(np.array(vals, dtype=np.float64).reshape(-1, 1))
        else:
            h_res = torch.remainder(h * 1_000_003 + torch.tensor(positions, dtype=torch.float64).unsqueeze(1) * 7919
                                    + layer, _MOD)
        return h_res, h_res

    def dense_mlp(self, layer: int, x: Tensor) -> Tensor:
        return torch.zeros_like(x)

    def route(self, layer: int, x: Tensor) -> tuple[Tensor, Tensor]:
        ids = [random.Random(hash((self.seed, layer, v))).sample(range(self.num_experts), self.top_k)
               for v in x[:, 0].tolist()]
        ids_t = torch.tensor(ids, dtype=torch.long).reshape(x.shape[0], self.top_k)
        return ids_t, torch.full((x.shape[0], self.top_k), 1.0 / self.top_k, dtype=torch.float32)

    def shared_expert(self, layer: int, x: Tensor) -> Optional[Tensor]:
        return None

    def experts(self, layer: int, x, expert_ids: Tensor) -> Tensor:
        return torch.zeros_like(row_blocks(x))

    def combine(self, h_res: Tensor, shared: Optional[Tensor], y: Tensor, weights: Tensor,
                row_index: Optional[Tensor] = None, feeds_attention: bool = False) -> Tensor:
        return h_res

    def logits(self, h: Tensor) -> Tensor:
        return h

    def sample(self, logits: Tensor, params, step: int) -> int:
        tok = int(random.Random(hash((self.seed, float(logits[0]), step))).randrange(self.vocab_size))
        while tok in self.eos:
            tok = (tok + 1) % self.vocab_size
        return tok

    def sample_batch(self, logits: Tensor, params: list, steps: list[int]) -> list[int]:
        return [self.sample(logits[i], params[i], steps[i]) for i in range(len(steps))]
