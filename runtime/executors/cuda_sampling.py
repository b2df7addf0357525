"""The CUDA executor's LM head and sampling: one graph per sample bucket, token ids copied to the host once.

logits(h) returns a `DeviceLogits`: for a batch that fits a sample bucket the bucket's graph (final norm, LM head and
the greedy argmax into a static ids buffer: layers.final_logits, the stage function) replays when the ids are first
wanted, and the ids reach the host through one D2H copy into a pinned slot. The logits themselves stay inside the
graph's pool; a caller that reads them (a sampling row, a test) gets them recomputed eagerly from the same rows. Above
the largest bucket: eagerly. A batch with rows that sample draws on the device (models.sampling.sample_tokens).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
from torch import Tensor

from models import layers
from models.sampling import SamplingParams, sample, sample_tokens
from runtime.executors.capture import bucket_for
from runtime.executors.host_staging import HostStaging

_GREEDY = SamplingParams()


class DeviceLogits:
    """logits [T, V] plus the batched greedy argmax, copied to the host once. `argmax`: the ids already computed on
    the device, or a function that computes them (the sample graph's replay: its ids are its static buffer), called
    only when the ids are first wanted, so a batch that samples from the eager logits never replays the graph (its LM
    head would run twice); the logits are computed only if read, by `eager()` (the same rows through the same ops).
    `n`: the rows, when neither the logits nor the ids are given yet."""

    def __init__(self, logits: Optional[Tensor], staging: HostStaging, argmax=None, eager=None,
                 n: Optional[int] = None) -> None:
        self._tensor, self._eager, self._staging = logits, eager, staging
        self._make_ids = argmax if callable(argmax) else None
        self._ids: Optional[Tensor] = None if callable(argmax) else argmax
        self._n = logits.shape[0] if logits is not None else (n if n is not None else argmax.shape[0])
        self._copy = None  # the ids' copy to the host (HostStaging.d2h), made with the ids
        self._host: Optional[list[int]] = None

    @property
    def _argmax(self):
        """The ids' copy to the host, the ids made first if they are not yet."""
        if self._copy is None:
            if self._ids is None:
                # the ids: the logits' argmax, or the function's (a sample graph's static buffer)
                self._ids = self._make_ids() if self._make_ids is not None else torch.argmax(self._tensor, dim=-1)
            self._copy = self._staging.d2h(self._ids)
        return self._copy

    @property
    def tensor(self) -> Tensor:
        if self._tensor is None:
            self._tensor = self._eager()
        return self._tensor

    def __len__(self) -> int:
        return self._n

    def greedy(self, i: int) -> int:
        if self._host is None:
            self._host = self._argmax.wait().tolist()
            self._argmax.release()
        return self._host[i]

    # the engine's asynchronous sampling (CudaExecutor.sample_batch_start): the greedy ids, read once copied
    def ready(self) -> bool:
        return self._host is not None or self._argmax.ready()

    def wait(self) -> None:
        """Block until ready() (the engine's driver, when it has nothing else to run)."""
        if self._host is None:
            self._argmax.wait()

    def tokens(self) -> list[int]:
        if len(self):
            self.greedy(0)  # reads the copy once (and releases its slot)
        return list(self._host or [])

    def device_ids(self, rows: Optional[list[int]] = None) -> Tensor:
        """The token ids of rows `rows` (all when None: the argmax, or the ids sample_tokens drew) as a device tensor
        of their own, queued right behind them (the engine's step-ahead: the next step embeds them before the host has
        read them; a copy, since the sample graph's buffer is rewritten by its next replay)."""
        self._argmax  # the ids exist (and are on their way to the host)
        if rows is None:
            return self._ids.clone()
        return self._ids.index_select(0, self._staging.upload(np.asarray(rows, dtype=np.int64))[0])

    def __getitem__(self, i: int) -> "LogitsRow":
        return LogitsRow(self, i)


@dataclass
class LogitsRow:
    parent: DeviceLogits
    index: int

    @property
    def tensor(self) -> Tensor:
        return self.parent.tensor[self.index]



class SamplingMixin:
    """CudaExecutor's logits / sample methods (runtime/executors/cuda_executor.py composes it)."""

    @torch.no_grad()
    def logits(self, h: Tensor) -> DeviceLogits:
        """The batch's logits and their greedy argmax (copied to the host once). For a batch that fits a sample bucket
        the argmax is that bucket's graph (norm, LM head, argmax: 16 torch calls on the host became ~7, and a sample
        batch 857-900 -> 129-143 us of host on an H200 host), replayed when the ids are first wanted; the
        logits are computed eagerly only if read (a batch that samples: then the graph never runs)."""
        h = self._to_dev(h)
        T = h.shape[0]
        head = lambda: layers.final_logits(self.spec, self.w, h)  # noqa: E731 (the eager logits)
        b = bucket_for(T, self.buckets.get("sample", ()))
        if b is None or T == 0:
            return DeviceLogits(head(), self.staging)
        bufs = self._sample_bufs(b)

        def replay() -> Tensor:
            h_in, ids = self._kept(("sample", b, T), True, lambda: (bufs["h"][:T], bufs["ids"][:T]))
            h_in.copy_(h)
            self.graphs.get(("sample", -1, b), lambda: self._sample_body(bufs)).run()
            return ids
        return DeviceLogits(None, self.staging, argmax=replay, eager=head, n=T)

    def _sample_bufs(self, b: int) -> dict[str, Tensor]:
        return self._kept(("sample", b), True, lambda: {
            "h": torch.zeros((b, self.spec.hidden_size), dtype=self.dtype, device=self.device),
            "ids": torch.zeros(b, dtype=torch.int64, device=self.device)})

    def _sample_body(self, bufs: dict[str, Tensor]):
        h_in, ids = bufs["h"], bufs["ids"]
        spec, w = self.spec, self.w

        def body() -> None:
            ids.copy_(torch.argmax(layers.final_logits(spec, w, h_in), dim=-1))
        return body

    def sample(self, logits, params: Optional[SamplingParams], step: int) -> int:
        params = params or _GREEDY
        if isinstance(logits, LogitsRow):
            if params.greedy:
                return logits.parent.greedy(logits.index)
            logits = logits.tensor
        return sample(logits, params, step)

    def sample_batch_start(self, logits: DeviceLogits, params: list[Optional[SamplingParams]],
                           steps: list[int]) -> Optional[DeviceLogits]:
        """The engine's asynchronous sampling: the batch's token ids on their way to a pinned slot (held until read:
        the ring must not reuse it meanwhile), with ready() / tokens() / device_ids(). An all-greedy batch's are the
        logits' argmax (the sample graph's); a batch with rows that sample draws all its rows on the device
        (models.sampling.sample_tokens over the eagerly computed logits) and hands out their ids the same way.
        None for an empty batch."""
        if not params:
            return None
        if all(p is None or p.greedy for p in params):
            pending = logits
        else:
            pending = DeviceLogits(None, self.staging, argmax=sample_tokens(logits.tensor, params, steps))
        pending._argmax.hold()
        return pending

    def sample_batch(self, logits: DeviceLogits, params: list[Optional[SamplingParams]], steps: list[int]) -> list[int]:
        """sample() of every row, in one device call; an all-greedy batch reads the argmax DeviceLogits copied once."""
        if all(p is None or p.greedy for p in params):
            return [logits.greedy(i) for i in range(len(params))] if params else []
        return sample_tokens(logits.tensor, params, steps).tolist()
