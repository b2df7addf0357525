"""Requests for `dataflow run`: a prompts JSONL file, or the small seeded default workload.

JSONL lines: {"id": ..., "prompt_token_ids": [...], "max_new_tokens": optional int}, or, where the model has a
tokenizer (models/tokenizer.py: a checkpoint directory with tokenizer.json), "prompt": "text" or "messages":
[{"role": ..., "content": ...}, ...] (OpenAI's chat shape, rendered by the checkpoint's chat template) instead of
"prompt_token_ids". A line may set its own sampling ("temperature", "top_p", "top_k", "seed"), "stop_token_ids"
(ids that end it besides the model's EOS) and, with a tokenizer, "stop" (strings that end its text). Every problem is
a UserError naming the file, the line and the field, because these files are written by hand.
"""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from graph_ir.errors import UserError
from runtime.core.requests import Request


def _check_request(where: str, prompt: Any, max_new: Any, spec, max_new_from: str = "max_new_tokens",
                   field: str = "prompt_token_ids") -> None:
    if not isinstance(prompt, list) or not prompt or not all(_is_int(t) for t in prompt):
        shown = repr(prompt) if len(repr(prompt)) <= 60 else repr(prompt)[:57] + "..."
        what = "must be a non-empty list of integers" if field == "prompt_token_ids" else "gives no tokens"
        raise UserError(f"{where}: field '{field}' {what}, got {shown}")
    bad = [t for t in prompt if not 0 <= t < spec.vocab_size]
    if bad:
        raise UserError(f"{where}: field '{field}': ids {bad[:5]} outside the vocabulary "
                        f"0..{spec.vocab_size - 1} of {spec.name}")
    if not _is_int(max_new) or max_new < 1:
        raise UserError(f"{where}: field 'max_new_tokens' must be a positive integer, got {max_new!r}")
    if len(prompt) + max_new - 1 > spec.max_position:
        room = spec.max_position - len(prompt) + 1
        valid = f"{max_new_from} 1..{room} for this prompt" if room >= 1 else \
            f"a prompt of at most {spec.max_position} tokens"
        raise UserError(f"{where}: prompt ({len(prompt)} tokens) + {max_new_from} ({max_new}) exceeds "
                        f"{spec.name}'s max_position {spec.max_position}; valid: {valid}")


PROMPT_FIELDS = ("prompt_token_ids", "prompt", "messages")
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "seed")
LINE_FIELDS = ("id", *PROMPT_FIELDS, "max_new_tokens", *SAMPLING_FIELDS, "stop_token_ids", "stop")


def no_tokenizer_reason(spec) -> str:
    """Why `spec` has no tokenizer, for the error a text prompt gets."""
    if spec.weights.source != "checkpoint":
        return f"{spec.name} has random weights and no checkpoint directory to read a tokenizer from"
    return f"there is no tokenizer.json in its checkpoint directory {spec.weights.path}"


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def chat_messages(where: str, messages: Any) -> list[dict]:
    """OpenAI chat messages: role and content (a string, or a list of {"type": "text", "text": ...} parts, joined by
    newlines as vLLM does for templates that take text) plus any other keys the template may read."""
    if not isinstance(messages, list) or not messages:
        raise UserError(f"{where}: field 'messages' must be a non-empty list of "
                        f'{{"role": ..., "content": ...}} objects, got {messages!r:.60}')
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise UserError(f"{where}: field 'messages'[{i}] must be an object with a string 'role', got {m!r:.60}")
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise UserError(f"{where}: field 'messages'[{i}].content: parts must be "
                                f'{{"type": "text", "text": ...}} (text only), got {content!r:.60}')
            m = {**m, "content": "\n".join(p["text"] for p in content)}
        elif content is not None and not isinstance(content, str):
            raise UserError(f"{where}: field 'messages'[{i}].content must be a string or a list of text parts, "
                            f"got {content!r:.60}")
        out.append(m)
    return out


def _encode(where: str, d: dict, spec, tokenizer) -> tuple[str, list]:
    """(the prompt field the line used, its token ids)."""
    given = [f for f in PROMPT_FIELDS if f in d]
    if not given:
        raise UserError(f"{where}: missing field 'prompt_token_ids' (a list of token ids; or, where the model has a "
                        f"tokenizer, 'prompt' (text) or 'messages' (chat))")
    if len(given) > 1:
        raise UserError(f"{where}: a line needs exactly one of 'prompt_token_ids' (ids), 'prompt' (text) or "
                        f"'messages' (chat), got {' and '.join(repr(f) for f in given)}")
    field = given[0]
    if field == "prompt_token_ids":
        return field, d[field]
    if tokenizer is None:
        raise UserError(f"{where}: field '{field}' is text, and {no_tokenizer_reason(spec)}; valid: "
                        f"'prompt_token_ids' (a list of token ids)")
    if field == "prompt":
        if not isinstance(d["prompt"], str) or not d["prompt"]:
            raise UserError(f"{where}: field 'prompt' must be a non-empty string, got {d['prompt']!r:.60}")
        return field, tokenizer.encode(d["prompt"])
    messages = chat_messages(where, d["messages"])
    try:
        return field, tokenizer.encode_chat(messages, add_generation_prompt=True)
    except UserError:
        raise
    except Exception as err:  # the template's raise_exception (jinja2.TemplateError), or it failed on these messages
        raise UserError(f"{where}: field 'messages': the chat template of {tokenizer.source} refused them: "
                        f"{type(err).__name__}: {err}") from None


def _line_params(where: str, d: dict, params, rid: int):
    """The line's SamplingParams: `params` (flags and generation_config.json defaults) with the line's own fields
    over it; seed: the line's, else params.seed + rid (two equal prompts do not sample the same tokens)."""
    from pydantic import ValidationError

    from models.sampling import SamplingParams
    own = {k: d[k] for k in SAMPLING_FIELDS if k in d}
    for k, v in own.items():
        ok = _is_int(v) if k in ("top_k", "seed") else isinstance(v, (int, float)) and not isinstance(v, bool)
        if not ok:
            raise UserError(f"{where}: field '{k}' must be {'an integer' if k in ('top_k', 'seed') else 'a number'}, "
                            f"got {v!r}")
    if params is None and not own:
        return None
    base = params if params is not None else SamplingParams()
    try:
        return SamplingParams.model_validate({**base.model_dump(), "seed": base.seed + rid, **own})
    except ValidationError as err:
        e = err.errors()[0]
        raise UserError(f"{where}: field '{e['loc'][0]}' ({e.get('input')!r}): {e['msg']}") from None


def _line_stops(where: str, d: dict, spec, tokenizer, stop_token_ids, stop) -> tuple[tuple, tuple]:
    ids = d.get("stop_token_ids", [])
    if not isinstance(ids, list) or not all(_is_int(t) and 0 <= t < spec.vocab_size for t in ids):
        raise UserError(f"{where}: field 'stop_token_ids' must be a list of token ids in 0..{spec.vocab_size - 1}, "
                        f"got {ids!r:.60}")
    strings = d.get("stop", [])
    strings = [strings] if isinstance(strings, str) else strings
    if not isinstance(strings, list) or not all(isinstance(x, str) and x for x in strings):
        raise UserError(f"{where}: field 'stop' must be a non-empty string or a list of them, got {strings!r:.60}")
    if strings and tokenizer is None:
        raise UserError(f"{where}: field 'stop' needs the text of the output, and {no_tokenizer_reason(spec)}; "
                        f"valid: 'stop_token_ids'")
    return tuple(dict.fromkeys([*stop_token_ids, *ids])), tuple(dict.fromkeys([*stop, *strings]))


def load_prompts(path: str | Path, spec, max_new_tokens: int, params=None, ignore_eos: bool = False,
                 tokenizer=None, stop_token_ids: tuple = (), stop: tuple = ()) -> list[Request]:
    """Read a prompts JSONL file. `max_new_tokens`, `params` (models.sampling.SamplingParams; its seed is offset by
    each request's index), `stop_token_ids` and `stop` apply to lines that do not set their own (a line's stop ids
    and strings add to them). `tokenizer` (models.tokenizer.Tokenizer, None: the model has none): encodes the text
    prompts, and each request then carries it, so its output line gets "text"."""
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
            raise UserError(f"{where}: expected an object with 'prompt_token_ids', 'prompt' or 'messages', "
                            f"got {type(d).__name__}")
        unknown = set(d) - set(LINE_FIELDS)
        if unknown:
            raise UserError(f"{where}: unknown field(s) {sorted(unknown)}; valid: {', '.join(LINE_FIELDS)}")
        name = str(d.get("id", f"req-{len(out)}"))
        if name in seen:
            raise UserError(f"{where}: field 'id': {name!r} used twice")
        seen.add(name)
        field, prompt = _encode(where, d, spec, tokenizer)
        max_new = d.get("max_new_tokens", max_new_tokens)
        _check_request(where, prompt, max_new, spec,
                       "max_new_tokens" if "max_new_tokens" in d else "--max-new-tokens", field)
        ids, strings = _line_stops(where, d, spec, tokenizer, stop_token_ids, stop)
        out.append(Request(len(out), name, list(prompt), max_new, params=_line_params(where, d, params, len(out)),
                           ignore_eos=ignore_eos, stop_token_ids=ids, stop=strings, tokenizer=tokenizer))
    if not out:
        raise UserError(f"{path}: no requests in the file; valid: one JSON object per line, "
                        f'e.g. {{"id": "a", "prompt_token_ids": [1, 2, 3]}}')
    return out


def default_workload(spec, n: int = 8, max_new_tokens: int = 16, seed: int = 0, params=None,
                     ignore_eos: bool = False, stop_token_ids: tuple = (), tokenizer=None) -> list[Request]:
    """`n` seeded random prompts of mixed lengths (short chat turns and a few longer ones, up to 48 tokens).
    `params` (models.sampling.SamplingParams): request i gets them with the seed params.seed + i, so two requests
    with the same prompt do not sample the same tokens. `tokenizer`: their output lines get "text"
    (models/tokenizer.py)."""
    rng = random.Random(seed)
    reserved = set(spec.eos_token_ids)
    vocab = [t for t in range(spec.vocab_size) if t not in reserved]
    max_prompt = max(1, min(48, spec.max_position - max_new_tokens + 1))
    out = []
    for i in range(n):
        length = rng.choice([rng.randint(1, 8), rng.randint(8, max_prompt), max_prompt])
        prompt = [rng.choice(vocab) for _ in range(length)]
        _check_request(f"default workload request {i}", prompt, max_new_tokens, spec)
        own = None if params is None else params.model_copy(update={"seed": params.seed + i})
        out.append(Request(i, f"req-{i}", prompt, max_new_tokens, params=own, ignore_eos=ignore_eos,
                           stop_token_ids=tuple(stop_token_ids), tokenizer=tokenizer))
    return out


def output_line(req: Request) -> str:
    """A request's line of an outputs file: {"id", "prompt_token_ids", "output_token_ids", "finish_reason", ...}, and
    "text" (the output decoded, cut at its first stop string: models/tokenizer.py text_output) when it carries a
    tokenizer."""
    line = req.result()
    if req.tokenizer is not None:
        from models.tokenizer import text_output
        line.update(text_output(req.tokenizer, line["output_token_ids"], line["finish_reason"], req.stop))
    return json.dumps(line) + "\n"


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
