"""A request's life-cycle state on its home rank (prompt, sampling parameters, output, timings).

A request is bound to one home rank for its whole life (its KV cache lives there); choosing that home is the
drivers' job (runtime/drivers/admission.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class Request:
    rid: int  # unique over the whole run, assigned by the driver
    name: str  # the user's id (from the prompts file)
    prompt: list[int]
    max_new_tokens: int
    params: Any = None  # models.sampling.SamplingParams (None: greedy)
    ignore_eos: bool = False
    arrival: float = 0.0
    # Token ids that end it besides the model's EOS (spec.eos_token_ids), finish reason "stop"; honoured with
    # ignore_eos too (as vLLM's stop_token_ids). Sent to the home with the request.
    stop_token_ids: tuple = ()
    # Text output (models/tokenizer.py text_output): the tokenizer that writes "text" in its output line, and the
    # strings that end that text. Kept by whoever writes the lines (the driver, rank 0's coordinator); not sent to the
    # home, which serves ids only.
    stop: tuple = ()
    tokenizer: Any = None
    # -- state, owned by the home engine --
    home: int = -1
    output: list[int] = field(default_factory=list)
    finish_reason: Optional[str] = None  # "eos" (the model's EOS) | "stop" (stop_token_ids; a stop string) | "length"
    t_admit: float = -1.0
    t_finish: float = -1.0
    token_times: list[float] = field(default_factory=list)
    # kv_next[layer]: first position whose K/V that layer has not written yet. A segment may enter
    # attention of a layer only at this position, so prefill chunks attend to complete context even
    # when an earlier chunk was held up in a slower merge. Kept only while `chunked`: a request with one
    # segment in flight (a prompt of one chunk, then every decode step: the next token exists only once
    # the last one went through every layer) cannot overtake itself.
    kv_next: list[int] = field(default_factory=list)
    chunked: bool = False  # its prompt entered attention as several chunks, and its first token is not sampled yet
    # Step-ahead (runtime/core/sample_stage.py): sample batches of it launched whose tokens the host has not
    # read yet; and finished (EOS) while its next step's row was already queued: it leaves once that row is sampled.
    unread: int = 0
    draining: bool = False
    # Cancelled by its client (`dataflow serve`: a disconnect): it finishes at its next sampled token, reason "abort",
    # the way it would at its length limit, so rows of it still in flight elsewhere come back first.
    cancelled: bool = False

    @property
    def kv_tokens(self) -> int:
        # The last sampled token is never fed back, so it never needs a KV slot.
        return len(self.prompt) + self.max_new_tokens - 1

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def result(self) -> dict:
        """Its output line's fields: ids, tokens, finish reason, and its latencies in seconds (runtime/observability/metrics.py
        request_timings: ttft_s from its arrival, tpot_s, itl_p50_s, itl_p99_s; null where too few tokens)."""
        from runtime.observability.metrics import request_timings
        return {"id": self.name, "prompt_token_ids": list(self.prompt), "output_token_ids": list(self.output),
                "finish_reason": self.finish_reason, **request_timings(self)}
