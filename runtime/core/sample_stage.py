"""Sampling: a sample batch's tokens, asynchronously where the executor can, the next step queued before they are
read (step-ahead), and the requests that finish.

Part of the Engine (runtime/core/engine.py), whose state it reads: the live requests, the attn(0) queue, the
deferred batches, the policy (its adaptive hold bound observes the token step) and the metrics.

Asynchronous sampling (an executor whose `sample_batch_start` hands out a PendingTokens, i.e. the CUDA one): a
sample batch whose tokens are still being copied to the host is completed later, when they are there, instead of
the host waiting for the copy (and the GPU work queued before it) in `execute` (+15% tok/s on 2 x H200). Deferred
batches complete at the next `next_batch()` that finds them ready, in any driver.

Step-ahead (with asynchronous sampling): when a sample batch is launched, the next step's layer-0 rows of its
requests that go on whatever token they get (not at their length limit) are queued at once, their ids left on
the device for the embedding. The host reads the tokens later, while the device runs that next step: without it
the device drained at every step boundary, waiting for the host to read the tokens, complete the batch, embed and
launch layer 0. A request whose token turns out to be EOS "drains": it is finished then, and its extra row runs
to the sample, whose token is dropped, before its KV blocks are released and its finish is reported (the
coordinator's free blocks mirror the release).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from runtime.core.queues import AttnBlock
from runtime.core.requests import Request
from runtime.executors.base import PendingTokens

if TYPE_CHECKING:
    from runtime.core.batch_choice import Batch


class SampleStage:
    """The Engine's sample batches and request ends (module docstring)."""

    def _exec_sample(self, batch: Batch) -> None:
        items = batch.items
        h = items[0].h if len(items) == 1 else torch.cat([it.h for it in items])
        rids = items[0].rids if len(items) == 1 else [r for it in items for r in it.rids]
        reqs = [self.requests[r] for r in rids]
        logits = self.executor.logits(h)
        # a request's step counts its unread samples too (step-ahead: its output may lag)
        params, steps = [r.params for r in reqs], [len(r.output) + r.unread for r in reqs]
        pending = self.executor.sample_batch_start(logits, params, steps) if self.async_sample else None
        if pending is None:
            # (the CUDA executor starts every non-empty batch; an executor that declines one lands here)
            if self._unread:  # tokens go to a request in step order: read the older samples of any first
                self._read_unread()
            batch.out["tokens"] = self.executor.sample_batch(logits, params, steps)
        else:  # ready() / tokens(): completed by complete() or complete_deferred()
            batch.out["pending"] = pending
            batch.out["ahead"] = self._step_ahead(reqs, pending)
            for r in reqs:
                r.unread += 1
            self._unread += len(reqs)
        batch.out["reqs"] = reqs

    def _step_ahead(self, reqs: list[Request], pending: PendingTokens) -> Optional[list[bool]]:
        """Queue the next step's layer-0 block of the requests of a sample batch just launched that go on whatever
        token they sample, their ids taken on the device (module docstring); which rows it queued (None: none). Not a
        request whose earlier sample is still unread (its tokens, EOS or not, are not known yet: it goes on when
        they are, as without step-ahead), draining, or finishing its chunked prompt."""
        max_pos = self.cfg.max_position
        rows, rids, pos = [], [], []
        for i, req in enumerate(reqs):
            if req.unread or req.draining or req.chunked:
                continue
            n = len(req.output) + 1  # the output's length with the token being sampled
            p = len(req.prompt) + n - 1  # where that token's K/V goes next step
            if n < req.max_new_tokens and p < max_pos:
                rows.append(i)
                rids.append(req.rid)
                pos.append(p)
        if not rows:
            return None
        ids = pending.device_ids(None if len(rows) == len(reqs) else rows)
        self.queues[self.attn_stage[0]].push(AttnBlock(rids, pos, ids, None, self.clock.now(), len(rids)))
        if len(rows) == len(reqs):
            return [True] * len(reqs)
        ahead = [False] * len(reqs)
        for i in rows:
            ahead[i] = True
        return ahead

    def _read_unread(self) -> None:
        """Wait for every deferred sample batch's tokens and complete it (with the other deferred batches ready)."""
        for b in self.deferred:
            b.out["pending"].wait()
        self.complete_deferred()

    def complete_deferred(self) -> None:
        """Complete the deferred batches whose tokens arrived."""
        for _ in range(len(self.deferred)):
            batch = self.deferred.popleft()
            if batch.out["pending"].ready():
                self.complete(batch)
            else:
                self.deferred.append(batch)

    def wait_deferred(self) -> bool:
        """Block until the oldest deferred batch's tokens are on the host (a driver calls this when nothing else can
        run: sleeping a fixed time instead would add up to that long to every deferred batch). True when it
        waited (False: nothing is deferred)."""
        if not self.deferred:
            return False
        self.deferred[0].out["pending"].wait()
        return True

    def _complete_sample(self, batch: Batch) -> None:
        now = self.clock.now()
        q0 = self.queues[self.attn_stage[0]]
        eos = self.cfg.eos_token_ids
        max_pos = self.cfg.max_position
        reqs = batch.out["reqs"]
        # The wave hold's adaptive bound (hold_step) reads the mean time since each request's last token, and a
        # chunked prompt's first token ends its chunking: both skipped when nothing uses them (this loop runs once per
        # request per step: 0.15 -> 0.09 us per request here, ~3-4x that on the H200 hosts).
        observe = self.policy.observe_step if self.policy.hold_step > 0 else None
        if observe is not None:
            gaps = [now - r.token_times[-1] for r in reqs if r.token_times and not r.draining]
            if gaps:
                observe(sum(gaps) / len(gaps))
        if self._chunked:
            for req in reqs:
                if req.chunked:  # its prompt's chunks are all through every layer: one segment in flight from now on
                    req.chunked = False
                    self._chunked -= 1
        cont_rids, cont_pos, cont_toks = [], [], []  # requests that go on: one attn(0) block
        tokens = batch.out["tokens"]
        ahead = batch.out.get("ahead")  # rows whose next step was queued at the launch (step-ahead), or None
        read = int("ahead" in batch.out)  # launched asynchronously: its requests' unread samples are counted
        self._unread -= read * len(reqs)
        counted = len(tokens)
        for i, (req, tok) in enumerate(zip(reqs, tokens)):
            req.unread -= read
            if req.draining:  # its EOS came at the step before; this row was queued before that was known
                self._release(req)
                counted -= 1
                continue
            out = req.output
            out.append(tok)
            req.token_times.append(now)
            n = len(out)
            pos = len(req.prompt) + n - 1  # where the new token would be written
            if tok in eos and not req.ignore_eos:
                self._finish(req, "eos", now, ahead is not None and ahead[i])
            elif req.stop_token_ids and tok in req.stop_token_ids:  # the request's own stop ids (runtime/core/requests.py)
                self._finish(req, "stop", now, ahead is not None and ahead[i])
            elif n >= req.max_new_tokens or pos >= max_pos:
                self._finish(req, "length", now)
            elif req.cancelled:
                self._finish(req, "abort", now, ahead is not None and ahead[i])
            elif ahead is None or not ahead[i]:
                cont_rids.append(req.rid)
                cont_pos.append(pos)
                cont_toks.append(tok)
        if cont_rids:
            q0.push(AttnBlock(cont_rids, cont_pos, cont_toks, None, now, len(cont_rids)))
        self.metrics.tokens += counted
        if self.sampled is not None:  # a serving front streams their new tokens (runtime/drivers/front_link.py)
            self.sampled.extend(reqs)

    def _finish(self, req: Request, reason: str, now: float, row_queued: bool = False) -> None:
        """`row_queued`: its next step's row is on its way already (step-ahead): it drains (module docstring)."""
        req.finish_reason, req.t_finish = reason, now
        if row_queued:
            req.draining = True
        else:
            self._release(req)

    def _release(self, req: Request) -> None:
        """A finished request leaves: its KV blocks are freed and the driver may report it."""
        self.kv.release(req.rid)
        del self.requests[req.rid]
        self.finished.append(req)
