"""A checkpoint's `generation_config.json`: its stop token ids and its default sampling parameters.

    read_generation_config(dir) -> GenerationDefaults | None   (None: the directory has no generation_config.json)

Read the way transformers' `generate` reads it: `eos_token_id` (an int or a list of ints) is where generation stops,
and it replaces config.json's (models/checkpoint.py import_spec puts it in spec.eos_token_ids, so a compiled plan
stops where transformers stops); `do_sample` false or absent means greedy whatever `temperature`, `top_p`, `top_k`
say; `do_sample` true samples with `temperature` (default 1.0), `top_k` (default 50, transformers' default; 0 = off)
and `top_p` (default 1.0). `dataflow run` flags and a prompts line's own fields override these defaults field by field.
Keys other than these (max_length, repetition_penalty, ...) are not applied. Every malformed value is a UserError
naming the file and the key.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from graph_ir.errors import UserError

FILE = "generation_config.json"
HF_TOP_K = 50  # transformers' GenerationConfig default, used when do_sample is true and top_k is not given


@dataclass(frozen=True)
class GenerationDefaults:
    source: str  # the file
    eos_token_ids: Optional[list[int]] = None  # None: the file sets no eos_token_id (config.json's then apply)
    sampling: dict[str, Any] = field(default_factory=dict)  # models.sampling.SamplingParams fields it sets


def _int_list(path: Path, key: str, value: Any) -> list[int]:
    ids = value if isinstance(value, list) else [value]
    if not ids or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise UserError(f"{path}: '{key}' must be a token id or a non-empty list of token ids, got {value!r}")
    return list(dict.fromkeys(ids))


def _number(path: Path, data: dict, key: str, default: Any, lo: float, hi: float, integer: bool = False):
    """data[key] checked to lie in lo..hi (an integer with `integer`); `default` when absent or null."""
    value = data.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)) or not lo <= value <= hi:
        kind = "an integer" if integer else "a number"
        raise UserError(f"{path}: '{key}' must be {kind} in {lo:g}..{hi:g}, got {value!r}")
    return value


def read_generation_config(directory: str | Path) -> Optional[GenerationDefaults]:
    """`<directory>/generation_config.json` as stop ids and sampling defaults; None when there is no such file."""
    from graph_ir.files import read_json_object

    path = Path(directory) / FILE
    if not path.is_file():
        return None
    data = read_json_object(path, "generation config", max_bytes=1 << 20)
    eos = data.get("eos_token_id")
    eos_ids = None if eos is None else _int_list(path, "eos_token_id", eos)
    do_sample = data.get("do_sample", False)
    if not isinstance(do_sample, bool):
        raise UserError(f"{path}: 'do_sample' must be true or false, got {do_sample!r}")
    sampling: dict[str, Any] = {"temperature": 0.0}  # greedy: transformers ignores temperature/top_p/top_k then
    if do_sample:
        temp = float(_number(path, data, "temperature", 1.0, 0.0, float("inf")))
        top_p = float(_number(path, data, "top_p", 1.0, 0.0, 1.0))
        top_k = _number(path, data, "top_k", HF_TOP_K, 0, 1 << 31, integer=True)
        if top_p == 0.0:
            raise UserError(f"{path}: 'top_p' must be in (0, 1], got 0")
        # temperature 0 with do_sample: transformers refuses it; the only sensible reading is greedy
        sampling = {"temperature": temp} if temp == 0.0 else {"temperature": temp, "top_p": top_p, "top_k": top_k}
    return GenerationDefaults(str(path), eos_ids, sampling)
