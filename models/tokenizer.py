"""Text in, text out: a checkpoint directory's tokenizer and chat template, without transformers.

    load_tokenizer(dir) -> Tokenizer | None   (None: no tokenizer.json there, e.g. a spec with random weights)
    tok.encode(text)                -> ids, the tokenizer's own special tokens added (tokenizer.json's post-processor)
    tok.encode_chat(messages)       -> ids of the rendered chat template (add_generation_prompt), no special tokens
                                       added
    tok.decode(ids)                 -> text, special tokens skipped
    text_output(tok, ids, reason, stop) -> {"output_token_ids", "text", "finish_reason"} of a finished request

The files are the ones transformers reads: tokenizer.json (through the `tokenizers` package, which transformers'
fast tokenizers wrap), tokenizer_config.json (named special tokens, `chat_template`, `clean_up_tokenization_spaces`),
special_tokens_map.json (older checkpoints' special tokens) and chat_template.jinja (transformers 5 saves the template
there; it wins over tokenizer_config.json's). The template is rendered as transformers' `apply_chat_template` renders
it (transformers/utils/chat_template_utils.py): a jinja2 ImmutableSandboxedEnvironment with trim_blocks and
lstrip_blocks, the loopcontrols extension and `{% generation %}` blocks, `raise_exception`, a `tojson` that does not
escape HTML, `strftime_now`, a restricted `dict` and `namespace`; variables `messages` (None-valued keys dropped, the
reasoning field aliased to `reasoning_content` and `thinking`), `tools`, `documents`, `add_generation_prompt` and the
named special tokens (bos_token, eos_token, ...). The rendered text is encoded without adding special tokens, as
transformers does. Scope: tokenizers that transformers loads as its generic fast tokenizer (the backend in
tokenizer.json as saved); a tokenizer class that rebuilds its backend in Python (some slow-only or SentencePiece
ones without a tokenizer.json) is not covered.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Sequence

from graph_ir.errors import UserError

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_MAP_FILE = "special_tokens_map.json"
TEMPLATE_FILE = "chat_template.jinja"
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _content(value: Any) -> Optional[str]:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict ({"content": ...})."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _read_json(path: Path) -> dict:
    """A tokenizer_config.json / special_tokens_map.json; {} when the checkpoint has none."""
    from graph_ir.files import read_json_object
    return read_json_object(path, "tokenizer file", max_bytes=1 << 30) if path.is_file() else {}


def _compile_template(source: str):
    """transformers' chat-template environment (chat_template_utils._cached_compile_jinja_template), mirrored."""
    from datetime import datetime

    import jinja2
    import jinja2.ext
    from jinja2 import nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        # `{% generation %}...{% endgeneration %}` marks assistant text for training masks; rendering keeps the body
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class TemplateDict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    def check_names(names):
        for name in names:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"chat templates cannot store underscore-prefixed attributes on a namespace, got {name!r}")

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):  # (self in args: like jinja2's, a template may name an attribute "self")
            attrs = dict(*args[1:], **kwargs)
            check_names(attrs)
            jinja2.utils.Namespace.__init__(args[0], attrs)

        def __setitem__(self, name, value):
            check_names([name])
            jinja2.utils.Namespace.__setitem__(self, name, value)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda format: datetime.now().strftime(format),
                       dict=TemplateDict(), namespace=TemplateNamespace)
    return env.from_string(source)


def _chat_messages(messages: Sequence[dict]) -> list[dict]:
    """What the template sees: each message without its None-valued keys (transformers drops them: templates test
    for a missing key, not for null), reasoning under the names templates read (reasoning_content, thinking)."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


class Tokenizer:
    """A checkpoint's tokenizer (see the module doc). Picklable: it travels with the requests to the process that
    writes the output lines. One loaded from a directory pickles as that directory and is read again on first use
    (every rank process unpickles the job, prompts included, and only rank 0 writes text); the compiled template is
    rebuilt."""

    def __init__(self, backend, special_tokens: dict[str, str], chat_template: Optional[str], clean_up: bool = False,
                 source: str = "") -> None:
        self.backend = backend  # tokenizers.Tokenizer
        self.special_tokens = dict(special_tokens)  # bos_token, eos_token, ... -> text
        self.chat_template = chat_template
        self.clean_up = clean_up
        self.source = source  # the directory, for messages
        self._template = None
        self._from_dir = False  # set by load_tokenizer: read again from `source` after unpickling

    def __getstate__(self) -> dict:
        # (unpickling sets these attributes as they are: one from a directory comes back as `_lazy`, its path)
        if self._from_dir:
            path = str(Path(self.source).resolve())
            return {"_lazy": path, "source": path, "_from_dir": False}
        return {**self.__dict__, "_template": None}

    def __getattr__(self, name: str):
        # only reached for attributes not set: those of a tokenizer unpickled from its directory, before first use
        lazy = self.__dict__.get("_lazy")
        if lazy is None or name.startswith("__"):
            raise AttributeError(name)
        loaded = load_tokenizer(lazy)
        if loaded is None:
            raise UserError(f"{lazy}: {TOKENIZER_FILE} is gone (it was there when the run started)")
        self.__dict__.update(loaded.__dict__)
        del self.__dict__["_lazy"]
        return getattr(self, name)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """`text` as ids, with the special tokens the tokenizer adds to a sequence (e.g. a BOS), as transformers'
        `tokenizer(text)` / vLLM's text prompts encode it."""
        return self.backend.encode(text, add_special_tokens=True).ids

    def render_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
        """The chat template applied to `messages` (OpenAI shape: role, content, ...). jinja2.TemplateError when the
        template refuses them (its raise_exception) or fails."""
        if self.chat_template is None:
            raise UserError(f"{self.source}: the tokenizer has no chat template (no chat_template in {CONFIG_FILE}, "
                            f"no {TEMPLATE_FILE}); give a 'prompt' (text) or 'prompt_token_ids' instead")
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        return self._template.render(messages=_chat_messages(messages), tools=None, documents=None,
                                     add_generation_prompt=add_generation_prompt, **self.special_tokens)

    def encode_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> list[int]:
        """transformers' apply_chat_template(messages, add_generation_prompt=..., tokenize=True): the rendered text
        encoded without adding special tokens (the template writes them)."""
        text = self.render_chat(messages, add_generation_prompt)
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        text = self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        if self.clean_up:
            text = (text.replace(" .", ".").replace(" ?", "?").replace(" !", "!").replace(" ,", ",")
                    .replace(" ' ", "'").replace(" n't", "n't").replace(" 'm", "'m").replace(" 's", "'s")
                    .replace(" 've", "'ve").replace(" 're", "'re"))
        return text


def load_tokenizer(directory: str | Path) -> Optional[Tokenizer]:
    """The tokenizer of a checkpoint directory; None when it has no tokenizer.json. A file that is there but
    broken is a UserError naming it."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as Backend

    root = Path(directory)
    path = root / TOKENIZER_FILE
    if not path.is_file():
        return None
    try:
        backend = Backend.from_file(str(path))
    except Exception as err:  # tokenizers raises its own Exception subclass with serde's message
        raise UserError(f"{path}: not a tokenizer the `tokenizers` package can load ({err})") from None
    config, older = _read_json(root / CONFIG_FILE), _read_json(root / SPECIAL_MAP_FILE)
    special = {}
    for name in SPECIAL_TOKENS:
        text = _content(config.get(name))
        text = text if text is not None else _content(older.get(name))
        if text is not None:
            special[name] = text
    # transformers adds the tokens tokenizer_config.json declares (added_tokens_decoder, the named special tokens)
    # that tokenizer.json lacks, as special tokens
    declared = config.get("added_tokens_decoder") or {}
    missing = [_content(t) for t in declared.values() if isinstance(t, dict)]
    missing += list(special.values())
    missing = [t for t in dict.fromkeys(missing) if t and backend.token_to_id(t) is None]
    if missing:
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in missing])
    if (root / TEMPLATE_FILE).is_file():
        from graph_ir.files import read_text
        template = read_text(root / TEMPLATE_FILE, "chat template")
    else:
        raw = config.get("chat_template")
        if isinstance(raw, list):  # [{"name": ..., "template": ...}]: the default one
            raw = next((t.get("template") for t in raw if isinstance(t, dict) and t.get("name") == "default"), None)
        if raw is not None and not isinstance(raw, str):
            raise UserError(f"{root / CONFIG_FILE}: 'chat_template' must be a string (or a list of named templates "
                            f"with a 'default'), got {type(raw).__name__}")
        template = raw
    # transformers skips the clean-up for BPE models: it would delete real spaces before punctuation
    clean_up = config.get("clean_up_tokenization_spaces") is True and type(backend.model).__name__ != "BPE"
    tok = Tokenizer(backend, special, template, clean_up, str(root))
    tok._from_dir = True
    return tok


def first_stop(text: str, stop: Sequence[str]) -> int:
    """Index in `text` of the earliest occurrence of any stop string, or -1."""
    found = [i for i in (text.find(s) for s in stop if s) if i >= 0]
    return min(found) if found else -1


def text_output(tok: Tokenizer, ids: Sequence[int], finish_reason: Optional[str], stop: Sequence[str] = ()) -> dict:
    """A finished request's text fields. `text`: its output decoded (special tokens skipped), without the token that
    stopped it (an EOS or stop token id), as vLLM writes it. `stop`: strings that end the output where the decoded
    text first contains one: the ids end with the token that completed it, the text just before it, and the finish
    reason is "stop". The runtime does not see stop strings (they need the tokenizer, and a rank does not have it),
    so a request generates past one and is cut here."""
    ids = list(ids)
    body = ids[:-1] if finish_reason in ("eos", "stop") and ids else ids
    text = tok.decode(body)
    if not stop or first_stop(text, stop) < 0:
        return {"output_token_ids": ids, "text": text, "finish_reason": finish_reason}
    # the fewest tokens whose text holds a stop string (a prefix's text is a prefix of the longer one's, up to a
    # partial character at its end): binary search over the prefixes
    lo, hi = 1, len(body)
    while lo < hi:
        mid = (lo + hi) // 2
        if first_stop(tok.decode(body[:mid]), stop) >= 0:
            hi = mid
        else:
            lo = mid + 1
    text = tok.decode(body[:lo])
    cut = first_stop(text, stop)
    return {"output_token_ids": body[:lo], "text": text[:cut] if cut >= 0 else text, "finish_reason": "stop"}
