"""The CUDA executor's bookkeeping around its static graph buffers: what an attention call leaves for the routing
(`Pending`), the counters tests and benchmarks read (`ExecStats`), and the in-place hand-over of rows between a
bucket's static buffers and the tensors the engine holds (`StaticInputs`).

Copies between the engine's tensors and a graph's static buffers are host work per batch (a torch call each, the
largest cost of a decode step on a fast GPU's host), so the executor avoids them where it can prove them safe:
- a combine whose rows go on to an attention stage writes them straight into the static input of the bucket they fit
  (a claim); that batch then replays without copying its input in;
- an attention batch hands out its outputs as views of the bucket's static output buffer, read in place until the
  bucket replays again.
Either way a tensor someone still holds is never overwritten: it is moved to storage of its own first
(`Tensor.set_` repoints it where it is held), and the bucket then backs off for a while (copies are cheaper than
moves when ranks sharing the executor take turns at one bucket).
"""
from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
from torch import Tensor

from runtime.executors.capture import bucket_for
from runtime.executors.host_staging import PendingHost

_CLAIM_BACKOFF = 64  # claims a bucket skips after one of its claims had to be moved out (CudaExecutor._claim_skip)


@dataclass
class Pending:
    """What the last attention call computed beyond (h_res, x), served to route / routed_payload / shared_expert."""

    x: Tensor
    route: Optional[PendingHost]  # the routing on its way to the host ([T, 2k] fp32: ids as values, then weights)
    shared: Optional[Tensor]
    # kept on the device (device-routed dispatch): the payload [T, H + c], rows, int32 ids and fp32 weights in
    # routed_rows.pack's layout
    on_device: Optional[Tensor] = None

    def read(self, v: Tensor) -> tuple[np.ndarray, np.ndarray]:
        """(ids [T, k] int64, weights [T, k] fp32) of the routing copy `v`, copied out of its pinned slot (the ring
        reuses it) and the slot released. numpy, not torch: one torch call (the view) instead of four slices and
        copies, and none later for the engine's .numpy() and the merge's weight packing (torch calls are what costs
        on a fast GPU's host)."""
        a, k = v.numpy(), v.shape[1] // 2
        out = a[:, :k].astype(np.int64), a[:, k:].copy()
        self.route.release()
        return out


@dataclass
class ExecStats:
    attn_graph: int = 0
    attn_paged_eager: int = 0  # through the paged kernels without a graph (over the largest bucket, or graphs off)
    attn_paged_prompt: int = 0  # batches holding a prompt's chunk that went through the paged kernels
    attn_eager: int = 0  # by models.attention (a sequence without a table row; prompts='eager')
    attn_claims_used: int = 0  # decode batches whose input a combine had written in place (no input copy)
    attn_claims_moved: int = 0  # another output's rows moved out of a bucket's input first (_attn_input)
    attn_outputs_moved: int = 0  # a bucket's last outputs still held when it replayed again: moved out first
    expert_graph: int = 0
    expert_eager: int = 0
    eager_reasons: dict = field(default_factory=dict)

    def note(self, why: str) -> None:
        self.eager_reasons[why] = self.eager_reasons.get(why, 0) + 1


def timed(kind: str):
    """An executor call between two CUDA events when the executor's `profile` is a list: (kind, start, end) appended
    to it (CudaExecutor._mark; benchmarks/gpu_bench.py derives GPU time per batch from them)."""
    def wrap(call):
        @functools.wraps(call)
        def timed_call(self, *args, **kwargs):
            start = self._mark()
            try:
                return call(self, *args, **kwargs)
            finally:
                if start is not None:
                    self.profile.append((kind, start, self._mark()))
        return timed_call
    return wrap


def same_list(a: list, b: list) -> bool:
    """Equal lists, by identity first: a decode wave hands every layer the same position and table-row lists, where
    comparing 256-512 items costs a few us per batch."""
    return a is b or a == b


class StaticInputs:
    """CudaExecutor's claims on its static buffers (module docstring)."""

    def _kept(self, key: tuple, static: bool, make):
        """What `make()` returns for `key`, made once and kept when static: a bucket's static buffers (a dict of
        tensors, key (kind, bucket): every graph of the bucket reads and writes them), the views of a batch's first
        rows of them (key (kind, bucket, rows): a slice is a torch call, ~10-25 us on the H200 host; the static buffers
        never change once made), or a device table (the RoPE cos/sin: ("rope", positions)). Made each time for an
        eager batch (its own buffers)."""
        if not static:
            return make()
        got = self._kept_views.get(key)
        if got is None:
            got = self._kept_views[key] = make()
        return got

    def _claim_attn_input(self, T: int) -> Optional[Tensor]:
        """Rows 0..T-1 of the static input of the attention bucket T fits, as a new view that is the claim (never a
        cached view: an eviction repoints the claim's storage), or None when another live output holds the bucket."""
        b = bucket_for(T, self.buckets["attn"]) if T else None
        if b is None:
            return None
        held = self._claims.get(b)
        if held is not None and held() is not None:
            return None
        skip = self._claim_skip.get(b)
        if skip:
            self._claim_skip[b] = skip - 1
            return None
        view = self._attn_bufs(b, True)["h"][:T]
        self._claims[b] = weakref.ref(view)
        return view

    def _release_outputs(self, b: int) -> None:
        """Before attention bucket b replays: its last batch's outputs (views of the static output buffer) that are
        still held (a merge group not combined yet: another wave, an in-process rank sharing this executor) move to
        tensors of their own (Tensor.set_ repoints them where they are held), and the bucket clones its outputs for
        its next _CLAIM_BACKOFF batches. In one wave's steady decode they are gone by then: the group's combine read
        h_res before the wave's next attention batch was made, and x lived in the batch that is done."""
        live = [t for t in (r() for r in self._out_claims.pop(b, ())) if t is not None]
        if not live:
            return
        for t in live:
            t.set_(t.clone())
        self.stats.attn_outputs_moved += 1
        self._out_skip[b] = _CLAIM_BACKOFF

    def _attn_input(self, b: int, h: Tensor) -> Optional[Tensor]:
        """What an attention batch of bucket b must copy into the bucket's static input: None when `h` is already
        there (the combine that made it claimed the bucket), else h. A live claim of another output is evicted
        first: its rows move to a tensor of their own (Tensor.set_ repoints the claim, so every queue item holding it
        reads them there), and an `h` sliced from that claim is re-sliced from the moved rows (a copy between
        overlapping rows of one buffer is not allowed)."""
        held = self._claims.pop(b, None)
        owner = held() if held is not None else None
        if owner is None:
            return h
        if owner is h:
            return None
        moved = owner.clone()
        if h.untyped_storage().data_ptr() == owner.untyped_storage().data_ptr():  # h is rows of the claim
            first = (h.storage_offset() - owner.storage_offset()) // owner.stride(0)
            h = moved[first:first + h.shape[0]]
        owner.set_(moved)
        self.stats.attn_claims_moved += 1
        self._claim_skip[b] = _CLAIM_BACKOFF
        return h
