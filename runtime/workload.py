"""Requests for `dataflow run`: a prompts JSONL file, or the small seeded default workload.

JSONL lines: {"id": ..., "prompt_token_ids": [...], "max_new_tokens": optional int}. Every problem is
a UserError naming the file, the line and the field, because these files are written by hand.
"""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from graph_ir.errors import UserError
from runtime.requests import Request


def _check_request(where: str, prompt: Any, max_new: Any, spec, max_new_from: str = "max_new_tokens") -> None:
    if not isinstance(prompt, list) or not prompt or not all(isinstance(t, int) and not isinstance(t, bool)
                                                             for t in prompt):
        shown = repr(prompt) if len(repr(prompt)) <= 60 else repr(prompt)[:57] + "..."
        raise UserError(f"{where}: field 'prompt_token_ids' must be a non-empty list of integers, got {shown}")
    bad = [t for t in prompt if not 0 <= t < spec.vocab_size]
    if bad:
        raise UserError(f"{where}: field 'prompt_token_ids': ids {bad[:5]} outside the vocabulary "
                        f"0..{spec.vocab_size - 1} of {spec.name}")
    if not isinstance(max_new, int) or isinstance(max_new, bool) or max_new < 1:
        raise UserError(f"{where}: field 'max_new_tokens' must be a positive integer, got {max_new!r}")
    if len(prompt) + max_new - 1 > spec.max_position:
        room = spec.max_position - len(prompt) + 1
        valid = f"{max_new_from} 1..{room} for this prompt" if room >= 1 else \
            f"a prompt of at most {spec.max_position} tokens"
        raise UserError(f"{where}: prompt ({len(prompt)} tokens) + {max_new_from} ({max_new}) exceeds "
                        f"{spec.name}'s max_position {spec.max_position}; valid: {valid}")


def load_prompts(path: str | Path, spec, max_new_tokens: int, params=None, ignore_eos: bool = False) -> list[Request]:
    """Read a prompts JSONL file. `max_new_tokens` applies to lines that do not set their own."""
    from graph_ir.files import parse_json, read_text

    path = Path(path)
    out, seen = [], set()
    # read_text: a missing path, a directory, a binary or non-UTF-8 file is one line naming it (and the line);
    # parse_json: a key given twice or NaN is an error, not silently the last value.
    for lineno, line in enumerate(read_text(path, "prompts file").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        d = parse_json(line, where)
        if not isinstance(d, dict):
            raise UserError(f"{where}: expected an object with 'prompt_token_ids', got {type(d).__name__}")
        unknown = set(d) - {"id", "prompt_token_ids", "max_new_tokens"}
        if unknown:
            raise UserError(f"{where}: unknown field(s) {sorted(unknown)}; valid: id, prompt_token_ids, max_new_tokens")
        if "prompt_token_ids" not in d:
            raise UserError(f"{where}: missing field 'prompt_token_ids'")
        name = str(d.get("id", f"req-{len(out)}"))
        if name in seen:
            raise UserError(f"{where}: field 'id': {name!r} used twice")
        seen.add(name)
        max_new = d.get("max_new_tokens", max_new_tokens)
        _check_request(where, d["prompt_token_ids"], max_new, spec,
                       "max_new_tokens" if "max_new_tokens" in d else "--max-new-tokens")
        out.append(Request(len(out), name, list(d["prompt_token_ids"]), max_new, params=params, ignore_eos=ignore_eos))
    if not out:
        raise UserError(f"{path}: no requests in the file; valid: one JSON object per line, "
                        f'e.g. {{"id": "a", "prompt_token_ids": [1, 2, 3]}}')
    return out


def default_workload(spec, n: int = 8, max_new_tokens: int = 16, seed: int = 0, params=None,
                     ignore_eos: bool = False, max_prompt: int = 48) -> list[Request]:
    """`n` seeded random prompts of mixed lengths (short chat turns and a few longer ones)."""
    rng = random.Random(seed)
    reserved = set(spec.eos_token_ids)
    vocab = [t for t in range(spec.vocab_size) if t not in reserved]
    max_prompt = max(1, min(max_prompt, spec.max_position - max_new_tokens + 1))
    out = []
    for i in range(n):
        length = rng.choice([rng.randint(1, 8), rng.randint(8, max_prompt), max_prompt])
        prompt = [rng.choice(vocab) for _ in range(length)]
        _check_request(f"default workload request {i}", prompt, max_new_tokens, spec)
        out.append(Request(i, f"req-{i}", prompt, max_new_tokens, params=params, ignore_eos=ignore_eos))
    return out


def output_line(req: Request) -> str:
    """A request's line of an outputs file: {"id", "prompt_token_ids", "output_token_ids", "finish_reason"}."""
    return json.dumps(req.result()) + "\n"


def write_outputs(path: str | Path, requests: list[Request]) -> None:
    """Every request's line, in the order given."""
    with Path(path).open("w") as f:
        for r in requests:
            f.write(output_line(r))


class OutputWriter:
    """Appends a request's line (output_line) as it finishes and flushes it to the OS at once, so the line
    survives this process being killed a moment later. Lines come in finish order."""

    def __init__(self, path: str | Path, truncate: bool = False) -> None:
        self.path = str(path)
        self._f = open(self.path, "w" if truncate else "a")

    def write(self, req: Request) -> None:
        self._f.write(output_line(req))
        self._f.flush()

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()
