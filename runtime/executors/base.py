"""The executor contract: what the engine (runtime/core/engine.py) asks of the tensor adapter.

An executor runs a stage's math on batches the engine has already assembled; it holds no per-rank state (the KV
store is passed in), so in-process ranks may share one. `Executor` lists every call the engine makes, and the
engine makes them unconditionally: it never asks an executor what it has. The calls only some executors do
differently have a plain default in `ExecutorBase`, which the executors inherit:

- `route_arrays` / `routed_payload`: the routing in the form each dispatch sends it in (host-routed: ids and
  weights the host can index, numpy or tensors; device-routed: one packed payload, runtime/core/routed_rows.py).
  The defaults derive both from `route`; an executor that routes inside its attention graph hands out what the
  graph already made.
- `experts_routed`: the device-routed dispatch's expert batch; `supports_device_routing` declares it (an executor
  without it serves the host-routed dispatch only, and the engine refuses dispatch=device up front).
- `route_on_device`: the executor's own choice of dispatch where it made one when it was built (its graphs are
  captured for one form); None follows the plan and the options.
- `sample_batch_start`: asynchronous sampling, a handle to tokens still on their way to the host (`PendingTokens`);
  None (the default) makes the engine call `sample_batch` and wait.
- `prepare` / `detach`: a driver's hooks around a workload, not engine calls (capture graphs for a KV store before
  serving; free them before the next one); nothing to do by default.
- `kv_rows` (and `device`): a driver's question before the engine is built, the K and V row shapes and dtype of a KV
  pool the executor preallocates on `device` (runtime/executors/kv_fit.py clamps it to the free memory there); None
  by default: pages are allocated as they fill (torch) or there are none (sim).
"""
from __future__ import annotations

from typing import Optional, Protocol

from torch import Tensor

from models.sampling import SamplingParams
from runtime.core.routed_rows import pack


class PendingTokens(Protocol):
    """A sample batch's tokens on their way to the host (Executor.sample_batch_start)."""

    def ready(self) -> bool:
        """Whether the tokens are on the host (never blocks)."""

    def wait(self) -> None:
        """Block until they are (bounded: the executor raises past its device wait)."""

    def tokens(self) -> list[int]:
        """The tokens, once ready()."""

    def device_ids(self, rows: Optional[list[int]] = None) -> Tensor:
        """The ids of `rows` (None: all) where the device has them, for the next step's embedding before the host
        read them (the engine's step-ahead)."""


class Executor(Protocol):
    """Every call the engine makes on its executor (ExecutorBase has the defaults of the optional ones)."""

    route_on_device: Optional[bool]
    supports_device_routing: bool

    def embed(self, token_ids) -> Tensor:
        """Hidden rows of token ids (a list of ints, or int64 ids on the device)."""

    def attention(self, layer: int, h: Tensor, positions: list[int], segments: list[tuple[int, int, int]],
                  kv) -> tuple[Tensor, Tensor]:
        """(residual, normed MLP input) of an attention batch; segments are (request, first row, rows)."""

    def dense_mlp(self, layer: int, x: Tensor) -> Tensor: ...

    def route(self, layer: int, x: Tensor) -> tuple[Tensor, Tensor]:
        """(expert ids [T, k], weights [T, k])."""

    def route_arrays(self, layer: int, x: Tensor) -> tuple:
        """The host-routed dispatch's routing: ids and weights as numpy arrays or tensors."""

    def routed_payload(self, layer: int, x: Tensor) -> Tensor:
        """The device-routed dispatch's payload: rows, ids and weights packed (runtime/core/routed_rows.pack)."""

    def shared_expert(self, layer: int, x: Tensor) -> Optional[Tensor]: ...

    def experts(self, layer: int, x, expert_ids: Tensor) -> Tensor:
        """x: [N, H] or its row blocks (a list); one output row per input row."""

    def experts_routed(self, layer: int, payloads: list[Tensor], owned: Tensor,
                       out: Optional[Tensor] = None) -> Tensor:
        """Per token of the payloads, the weighted sum of the slots whose expert this rank holds (`owned`)."""

    def combine(self, h_res: Tensor, shared: Optional[Tensor], y: Tensor, weights: Tensor,
                row_index: Optional[Tensor] = None, feeds_attention: bool = False) -> Tensor: ...

    def logits(self, h: Tensor): ...

    def sample_batch(self, logits, params: list[Optional[SamplingParams]], steps: list[int]) -> list[int]: ...

    def sample_batch_start(self, logits, params: list[Optional[SamplingParams]],
                           steps: list[int]) -> Optional[PendingTokens]: ...


class ExecutorBase:
    """The defaults of the optional part of `Executor` (module docstring). Subclasses implement the rest."""

    route_on_device: Optional[bool] = None  # no choice of its own: the engine follows the plan and the options
    supports_device_routing = False  # experts_routed() is not implemented
    last_prepare: Optional[dict] = None  # what the last prepare() measured (a driver reports it)

    def route_arrays(self, layer: int, x: Tensor) -> tuple:
        return self.route(layer, x)

    def routed_payload(self, layer: int, x: Tensor) -> Tensor:
        ids, weights = self.route(layer, x)
        return pack(x, ids.to(x.device), weights.to(x.device))

    def experts_routed(self, layer: int, payloads: list[Tensor], owned: Tensor,
                       out: Optional[Tensor] = None) -> Tensor:
        raise NotImplementedError(f"{type(self).__name__} runs no device-routed expert batch (dispatch=host)")

    def sample_batch_start(self, logits, params: list, steps: list[int]) -> Optional[PendingTokens]:
        return None

    def prepare(self, kv, owned=None, *, host_experts: bool = True) -> int:
        """Graphs captured for this KV store (none: nothing is captured)."""
        return 0

    def detach(self, kv) -> None:
        """Free what prepare() made for `kv`."""

    def kv_rows(self) -> Optional[tuple]:
        return None

