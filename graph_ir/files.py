"""Reading the files users write or edit by hand (model YAML, load profiles, prompts JSONL, plan.json).

Every way such a file can be broken (missing, a directory, binary, not UTF-8, bad YAML/JSON syntax, a key
given twice) ends in one `UserError` line naming the file, the line and what is valid, never a traceback.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import yaml

from graph_ir.errors import UserError

# A model spec is a few KB (the largest shipped one is ~2 KB; a 256-entry layer_types list adds ~3 KB):
# anything bigger than this is not a spec, and reading a huge file into PyYAML would stall compile.
MAX_SPEC_BYTES = 1 << 20


def read_text(path: str | Path, what: str, max_bytes: Optional[int] = None) -> str:
    """The UTF-8 text of `path` (a leading BOM dropped). `what` names the file's role in errors
    ("model file", "prompts file"): missing -> "PATH: no such <what>"."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"{path}: no such {what}")
    if path.is_dir():
        raise UserError(f"{path}: is a directory; expected a {what}")
    if not path.is_file():
        raise UserError(f"{path}: not a regular file; expected a {what}")
    try:
        size = path.stat().st_size
        if max_bytes is not None and size > max_bytes:
            raise UserError(f"{path}: {size} bytes; a {what} is at most {max_bytes} bytes")
        raw = path.read_bytes()
    except OSError as err:
        raise UserError(f"{path}: cannot read the {what}: {err.strerror or err}") from None
    nul = raw.find(b"\0")
    if nul >= 0:
        raise UserError(f"{path}:{_line_of(raw, nul)}: a binary file (NUL byte at offset {nul}); "
                        f"expected a UTF-8 text {what}")
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise UserError(f"{path}:{_line_of(raw, err.start)}: not UTF-8 text (byte 0x{raw[err.start]:02x} "
                        f"at offset {err.start}); a {what} must be UTF-8") from None


def _line_of(raw: bytes, offset: int) -> int:
    return raw.count(b"\n", 0, offset) + 1


class _Refused(Exception):
    def __init__(self, line: int, msg: str):
        super().__init__(msg)
        self.line, self.msg = line, msg


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses a mapping key given twice (PyYAML silently keeps the last one) and aliases
    (`*name`: a model file needs none, and nested aliases expand exponentially when validated)."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise _Refused(event.start_mark.line + 1,
                           f"YAML alias '*{event.anchor}' is not supported here; write the value out")
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            first: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    hash(key)
                except TypeError:
                    continue  # the base class reports an unhashable key
                line = key_node.start_mark.line + 1
                if key in first:
                    raise _Refused(line, f"duplicate key {key!r} (first at line {first[key]}); YAML would keep "
                                         f"only the last value, so remove one of them")
                first[key] = line
        return super().construct_mapping(node, deep)


def load_yaml(path: str | Path, what: str, max_bytes: Optional[int] = MAX_SPEC_BYTES) -> Any:
    """Parse a hand-written YAML file; every problem is a one-line UserError naming the file and line."""
    path = Path(path)
    text = read_text(path, what, max_bytes)
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 (a SafeLoader subclass)
    except _Refused as err:
        raise UserError(f"{path}:{err.line}: {err.msg}") from None
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        what_went_wrong = " ".join(str(p) for p in (err.context, err.problem) if p)
        raise UserError(f"{where}: not valid YAML: {what_went_wrong}") from None
    except yaml.YAMLError as err:
        raise UserError(f"{path}: not valid YAML: {' '.join(str(err).split())}") from None


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict:
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def read_json_object(path: str | Path, what: str, max_bytes: Optional[int] = None) -> dict:
    """A JSON file whose top level is an object (read_text's and parse_json's checks, then that one)."""
    data = parse_json(read_text(path, what, max_bytes), str(path))
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def parse_json(text: str, where: str, what: str = "valid JSON") -> Any:
    """json.loads refusing duplicate keys (json keeps the last one silently) and NaN/Infinity; errors are
    one-line UserErrors "<where>: not <what> (<why>)", `where` e.g. "prompts.jsonl:3"."""
    def bad_constant(name: str):
        raise ValueError(f"{name} is not a valid JSON number")

    try:
        return json.loads(text, object_pairs_hook=_no_duplicate_keys, parse_constant=bad_constant)
    except json.JSONDecodeError as err:
        at = f"column {err.colno}" if err.lineno == 1 else f"line {err.lineno} column {err.colno}"
        raise UserError(f"{where}: not {what} ({err.msg} at {at})") from None
    except (ValueError, RecursionError) as err:
        raise UserError(f"{where}: not {what} ({err})") from None
