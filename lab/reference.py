"""Single-process dense reference decoder: the oracle the distributed runtime is tested against.

The lab's, not the product's: the tests, the benchmarks' correctness checks and model authors run it from the
repository (docs/adding-a-model.md); the product never imports it. Its KV stores live here too: DenseKVStore (one
growable buffer per layer and sequence) and PerSegmentKV (any store seen through the KVStore protocol only, so
models/attention.py takes every segment on its own: the reference path the batched one is compared against).

It runs one request at a time through exactly the stage functions of models/layers.py (the same
ones the runtime calls), with experts applied row by row in slot order and combined by
`moe_combine`, so any difference from the runtime is a runtime bug, not a math drift.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional, Sequence

import torch
from torch import Tensor

from graph_ir.spec import ModelSpec
from models.attention import latent_cache
from models.layers import (attention_stage, dense_mlp, embed, experts_forward, final_logits, moe_combine, route,
                           shared_expert)
from models.moe import router_logits
from models.sampling import SamplingParams, sample
from models.weights import ModelWeights

class DenseKVStore:
    """Contiguous in-memory KV store: one growable buffer per (layer, seq). For the reference decoder, which keeps
    MLA's K/V decompressed (the oracle) unless `mla_latent`."""

    def __init__(self, initial_capacity: int = 64, mla_latent: bool = False) -> None:
        self._initial = max(1, initial_capacity)
        self.mla_latent = mla_latent
        self._k: dict[tuple[int, int], Tensor] = {}
        self._v: dict[tuple[int, int], Tensor] = {}
        self._len: dict[tuple[int, int], int] = {}

    def write(self, layer: int, seq_id: int, positions: Tensor, k: Tensor, v: Tensor) -> None:
        key = (layer, seq_id)
        pos = positions.tolist()
        if not pos:
            return
        need = max(pos) + 1
        if key not in self._k:  # an empty buffer, grown below to initial_capacity (or more)
            self._k[key], self._v[key], self._len[key] = k[:0], v[:0], 0
        have = self._k[key].shape[0]
        if need > have:
            cap = max(need, 2 * have, self._initial)
            for buf in (self._k, self._v):
                new = buf[key].new_zeros((cap, *buf[key].shape[1:]))
                new[:have] = buf[key]
                buf[key] = new
        if pos[0] > self._len[key]:
            raise ValueError(f"KV write for seq {seq_id} layer {layer} at position {pos[0]} leaves a gap "
                             f"(have {self._len[key]} positions)")
        idx = positions.to(self._k[key].device, torch.long)
        self._k[key][idx] = k
        self._v[key][idx] = v
        self._len[key] = max(self._len[key], need)

    def read(self, layer: int, seq_id: int, length: int) -> tuple[Tensor, Tensor]:
        key = (layer, seq_id)
        have = self._len.get(key, 0)
        if length > have:
            raise ValueError(f"KV read of {length} positions for seq {seq_id} layer {layer}, only {have} written")
        return self._k[key][:length], self._v[key][:length]


class PerSegmentKV:
    """A store seen through the KVStore protocol only (no write_rows / gather): `_attend_rows` then takes every
    segment on its own, the reference path that the batched one is compared against (tests, benchmarks)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.mla_latent = latent_cache(inner)

    def write(self, *a):
        self.inner.write(*a)

    def read(self, *a):
        return self.inner.read(*a)


_SEQ = 0  # the reference runs one sequence at a time


@dataclass
class GenerationResult:
    tokens: list[int]  # generated tokens (the prompt excluded)
    logits: list[Tensor] = field(default_factory=list)  # [V] fp32 per generated token (step 0 = end of prefill)
    finish_reason: Literal["eos", "length"] = "length"


class ReferenceDecoder:
    def __init__(self, spec: ModelSpec, weights: ModelWeights, mla_latent: bool = False) -> None:
        """`mla_latent`: MLA layers keep the latent KV cache the runtime keeps (models.attention); by default the
        decompressed per-head K/V, the form transformers computes: the oracle."""
        self.spec = spec
        self.w = weights
        self.mla_latent = mla_latent
        self.device = weights.embed.device
        # A list to record each MoE layer's router logits [T, E] (fp32) of every forward in (for checks that ask how
        # close the expert choice was: benchmarks/gpu_bench.py); None: not recorded
        self.router_log: Optional[list] = None

    @torch.no_grad()
    def forward(self, token_ids: Tensor, start_pos: int, kv: DenseKVStore) -> Tensor:
        """Run tokens at positions start_pos.. of the sequence in `kv` through the model; logits [T, V]."""
        spec, w = self.spec, self.w
        T = token_ids.shape[0]
        positions = torch.arange(start_pos, start_pos + T, device=self.device)
        segments = [(_SEQ, 0, T)]
        h = embed(w, token_ids)
        for layer in range(spec.num_layers):
            h_res, x = attention_stage(spec, w, layer, h, positions, segments, kv)
            if not spec.is_moe_layer(layer):
                h = h_res + dense_mlp(spec, w, layer, x)
                continue
            ids, weights = route(spec, w, layer, x)
            if self.router_log is not None:
                self.router_log.append(router_logits(spec, w.layers[layer], x).float())
            k = ids.shape[1]
            # One row per (token, slot), in slot order, as the runtime hands rows to moe_combine.
            y = experts_forward(spec, w, layer, x.repeat_interleave(k, dim=0), ids.reshape(-1))
            h = moe_combine(h_res, shared_expert(spec, w, layer, x), y.view(T, k, -1), weights)
        return final_logits(spec, w, h)

    def forward_logits(self, prompt_ids: Sequence[int] | Tensor) -> Tensor:
        """Logits [T, V] for every prompt position from a fresh cache (one prefill segment)."""
        ids = torch.as_tensor(prompt_ids, dtype=torch.long, device=self.device)
        return self.forward(ids, 0, DenseKVStore(mla_latent=self.mla_latent))

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int,
                 sampling: Optional[SamplingParams] = None, eos_ids: Optional[Sequence[int]] = None,
                 ignore_eos: bool = False) -> GenerationResult:
        """Prefill the prompt as one segment, then decode one token per step.

        Step s samples with `sample(logits, sampling, s)`. Stops after max_new_tokens or on a
        token in eos_ids (spec.eos_token_ids when None) unless ignore_eos; the eos token is kept.
        """
        if len(prompt_ids) == 0:
            raise ValueError("generate needs a non-empty prompt")
        sampling = sampling or SamplingParams()
        eos = set(self.spec.eos_token_ids if eos_ids is None else eos_ids)
        kv = DenseKVStore(initial_capacity=len(prompt_ids) + max_new_tokens, mla_latent=self.mla_latent)
        result = GenerationResult(tokens=[])
        ids = torch.as_tensor(list(prompt_ids), dtype=torch.long, device=self.device)
        pos = 0
        for step in range(max_new_tokens):
            logits = self.forward(ids, pos, kv)[-1].float().cpu()
            pos += ids.shape[0]
            tok = sample(logits, sampling, step)
            result.tokens.append(tok)
            result.logits.append(logits)
            if tok in eos and not ignore_eos:
                result.finish_reason = "eos"
                break
            ids = torch.tensor([tok], dtype=torch.long, device=self.device)
        return result
