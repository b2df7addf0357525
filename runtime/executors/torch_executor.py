"""Torch executor: the engine's tensor adapter, calling the stage functions of models/layers.py.

The engine never touches model math directly; it hands batches (already assembled as contiguous
tensors) to an executor (the contract: runtime/executors/base.py). This one runs the shared stage functions
eagerly on whatever device the weights live on, so the runtime and the reference decoder execute literally the
same code. The simulated executor (runtime/executors/sim_executor.py) has the same methods and no real model; the
CUDA-graph one replaces this one without the engine noticing.

The executor holds no per-rank state (the KV store is passed in), so in-process ranks share one
executor and one copy of the weights.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from graph_ir.spec import ModelSpec
from models import layers
from models.sampling import SamplingParams, sample, sample_tokens
from models.weights import ModelWeights
from runtime.core.routed_rows import unpack as unpack_routed
from runtime.executors.base import ExecutorBase

_GREEDY = SamplingParams()


def row_blocks(x) -> Tensor:
    """An expert batch's input: one [N, H] tensor, or its row blocks (a list, concatenated here; the
    CUDA executor concatenates them straight into its graph's static input instead)."""
    if isinstance(x, Tensor):
        return x
    return x[0] if len(x) == 1 else torch.cat(x)


class TorchExecutor(ExecutorBase):
    supports_device_routing = True  # experts_routed() selects the held slots on the host

    def __init__(self, spec: ModelSpec, weights: ModelWeights) -> None:
        self.spec = spec
        self.w = weights
        self.device = weights.embed.device

    @torch.no_grad()
    def embed(self, token_ids) -> Tensor:
        """token_ids: a list of ints or an int64 tensor."""
        if not isinstance(token_ids, Tensor):
            token_ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        return layers.embed(self.w, token_ids)

    @torch.no_grad()
    def attention(self, layer: int, h: Tensor, positions: list[int], segments: list[tuple[int, int, int]],
                  kv) -> tuple[Tensor, Tensor]:
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        return layers.attention_stage(self.spec, self.w, layer, h, pos, segments, kv)

    @torch.no_grad()
    def dense_mlp(self, layer: int, x: Tensor) -> Tensor:
        return layers.dense_mlp(self.spec, self.w, layer, x)

    @torch.no_grad()
    def route(self, layer: int, x: Tensor) -> tuple[Tensor, Tensor]:
        return layers.route(self.spec, self.w, layer, x)

    @torch.no_grad()
    def shared_expert(self, layer: int, x: Tensor) -> Optional[Tensor]:
        return layers.shared_expert(self.spec, self.w, layer, x)

    @torch.no_grad()
    def experts(self, layer: int, x, expert_ids: Tensor) -> Tensor:
        """x: [N, H] or its row blocks (`row_blocks`); expert_ids: int64 [N] (a CPU tensor from the engine;
        a list of ints is accepted too)."""
        ids = torch.as_tensor(expert_ids, dtype=torch.long).to(self.device)
        return layers.experts_forward(self.spec, self.w, layer, row_blocks(x), ids)

    @torch.no_grad()
    def experts_routed(self, layer: int, payloads: list[Tensor], owned: Tensor, out: Optional[Tensor] = None) -> Tensor:
        """The device-routed dispatch's expert batch (runtime/core/routed_rows.py): items whose payloads [T_i, H + c] hold
        T_i token rows with their top-k expert ids and weights (routed_rows.pack); returns [sum T_i, H]: per token,
        sum_j weights[t, j] * output of expert ids[t, j] over the slots j whose expert this rank holds (owned),
        in slot order in fp32 from zero (models.moe.combine's order), zero when it holds none of them; written into
        `out` [sum T_i, H] (and returned) when given. Here the held slots are selected on the host (data-dependent
        shapes) and run through experts()."""
        x, ids, weights = unpack_routed(row_blocks(payloads), self.spec.hidden_size)
        flat = ids.to(torch.long).reshape(-1)
        k = ids.shape[1]
        rows = torch.nonzero(owned[flat]).squeeze(1)  # the slots of experts held here
        slots = torch.zeros((flat.numel(), x.shape[1]), dtype=x.dtype, device=x.device)
        if rows.numel():
            slots[rows] = self.experts(layer, x.index_select(0, rows // k), flat[rows])
        y = layers.moe_combine(torch.zeros_like(x), None, slots.view(x.shape[0], k, -1), weights)
        return y if out is None else out.copy_(y)

    @torch.no_grad()
    def combine(self, h_res: Tensor, shared: Optional[Tensor], y: Tensor, weights: Tensor,
                row_index: Optional[Tensor] = None, feeds_attention: bool = False) -> Tensor:
        """h_res + sum_j weights[:, j] * y[:, j] (+ shared). y is [T, k, H], or, with `row_index` [T, k],
        rows [N, H] of which row_index[t, j] is slot j of token t (the merge buffer, in arrival order).
        `feeds_attention`: the result is an attention stage's next input (an executor with static graph inputs may
        write it there: CudaExecutor); the value is the same either way."""
        return layers.moe_combine(h_res, shared, y if row_index is None else y[row_index], weights)

    @torch.no_grad()
    def logits(self, h: Tensor) -> Tensor:
        return layers.final_logits(self.spec, self.w, h)

    def sample(self, logits: Tensor, params: Optional[SamplingParams], step: int) -> int:
        return sample(logits, params or _GREEDY, step)

    def sample_batch(self, logits: Tensor, params: list[Optional[SamplingParams]], steps: list[int]) -> list[int]:
        """sample() of every row, in one batched call where the logits are (models.sampling.sample_tokens)."""
        return sample_tokens(logits, params, steps).tolist()
