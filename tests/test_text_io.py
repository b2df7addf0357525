"""Text in, text out, against transformers: a tiny Mixtral checkpoint (random fp32 weights, saved with
save_pretrained) with a real tokenizer made here (a byte-level BPE trained with `tokenizers`, a BOS post-processor,
tokenizer_config.json with a chat template that relies on trim_blocks / lstrip_blocks, raise_exception and tojson)
and a generation_config.json whose stop ids are [EOS, a token the model emits greedily].

Checked: our tokenizer and chat template give transformers' AutoTokenizer's ids and text; `dataflow run` on text and
chat prompts gives the same ids as the equivalent id prompts and transformers' greedy generate's tokens and text
(stopping where transformers stops on generation_config's ids); per-request stop ids, stop strings and sampling
fields; the stop ids on the wire; a text prompt on a spec without tokenizer is a one-line exit-2 error.
"""
from __future__ import annotations

import json
import sys

import pytest
import torch
from typer.testing import CliRunner

transformers = pytest.importorskip("transformers")

from dataflow import cli  # noqa: E402
from dataflow.cli import app  # noqa: E402
from graph_ir.errors import UserError  # noqa: E402
from models.generation_config import read_generation_config  # noqa: E402
from models.tokenizer import load_tokenizer, text_output  # noqa: E402

SENTENCES = ["The quick brown fox jumps over the lazy dog.", "Hello world, this is a tiny tokenizer.",
             "Experts route tokens to ranks; a dataflow graph has no barriers.",
             "What is the capital of France? Paris!", "Numbers like 1234 and 56.78 are fine, and so is naive cafe.",
             "user assistant system hello <b>bold</b>"]
SPECIALS = ["<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
PAD, BOS, EOS = 0, 1, 2
# Block tags indented and on their own lines: rendered right only with trim_blocks and lstrip_blocks
TEMPLATE = """{{ bos_token }}
{% for message in messages %}
  {% if loop.first and message['role'] == 'assistant' %}
    {{ raise_exception('the conversation must start with a user or system message') }}
  {% endif %}
{{ '<|' + message['role'] + '|>\\n' + message['content'] | trim }}
  {% if message['meta'] is defined %}
{{ message['meta'] | tojson }}
  {% endif %}
{{ eos_token + '\\n' }}
{% endfor %}
{% if add_generation_prompt %}
{{ '<|assistant|>\\n' }}
{% endif %}"""
CHAT = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is the capital of France?", "meta": {"tag": "<b>x</b>", "n": 1}}]
TEXT = "Hello world, the quick fox"
MAX_NEW = 10


def _tokenizer(path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=330, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(SENTENCES * 5, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", BOS)])
    assert [tok.token_to_id(t) for t in SPECIALS[:3]] == [PAD, BOS, EOS]
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>",
        "chat_template": TEMPLATE, "model_max_length": 256, "clean_up_tokenization_spaces": False}))
    return tok.get_vocab_size()


def _model(path, vocab: int):
    cfg = transformers.MixtralConfig(
        vocab_size=vocab, hidden_size=48, intermediate_size=40, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, head_dim=12, num_local_experts=6, num_experts_per_tok=2, rope_theta=5000.0,
        max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)
    cfg.dtype = torch.float32
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM._from_config(cfg, attn_implementation="eager",
                                                         experts_implementation="eager", dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():  # logits that spread (no greedy near-ties), as tests/test_hf_parity.py draws them
        for name, t in list(model.named_parameters()):
            noise = torch.randn(t.shape, generator=g)
            t.copy_(1.0 + 0.2 * noise if "norm" in name else (0.5 if "embed" in name or "lm_head" in name else 0.15)
                    * noise)
    model.save_pretrained(path)


def _hf_greedy(model, ids: list[int], **kw) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=PAD, **kw)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """(checkpoint dir, plan dir, transformers' tokenizer, transformers' model, the stop id chosen)."""
    path = tmp_path_factory.mktemp("ckpt")
    _model(path, _tokenizer(path))
    hf_tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    # the stop id: a token the model emits greedily after TEXT, first at its 4th step or later
    free = _hf_greedy(model, hf_tok(TEXT)["input_ids"], eos_token_id=None, min_new_tokens=MAX_NEW)
    j = next(i for i in range(3, MAX_NEW) if free[i] not in free[:i] and free[i] != EOS)
    (path / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": BOS, "eos_token_id": [EOS, free[j]], "pad_token_id": PAD, "do_sample": False}))
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    plan = path.parent / f"{path.name}-plan"
    res = CliRunner().invoke(app, ["compile", str(path), "--ranks", "2", "-o", str(plan)])
    assert res.exit_code == 0, res.output
    return path, plan, hf_tok, model, free[j]


def test_tokenizer_and_chat_template_match_transformers(ckpt):
    path, _, hf, _, _ = ckpt
    ours = load_tokenizer(path)
    for text in (TEXT, "The capital of France is", "naive cafe 1234 <|user|> x</s>", "  two  spaces  ", "é ü 日本"):
        ids = ours.encode(text)
        assert ids == hf(text)["input_ids"] and ids[0] == BOS
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids)
    turns = [*CHAT, {"role": "assistant", "content": " Paris. "}, {"role": "user", "content": "Why?"}]
    for chat in (CHAT, CHAT[1:], turns):
        for gen in (True, False):
            text = ours.render_chat(chat, add_generation_prompt=gen)
            assert text == hf.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False)
            assert ours.encode_chat(chat, gen) == hf.apply_chat_template(chat, add_generation_prompt=gen)["input_ids"]
    assert '{"tag": "<b>x</b>", "n": 1}' in ours.render_chat(CHAT)  # transformers' tojson: no HTML escaping
    assert "\n  " not in ours.render_chat(CHAT)  # trim_blocks + lstrip_blocks
    with pytest.raises(Exception, match="must start with a user"):
        ours.render_chat([{"role": "assistant", "content": "hi"}])
    # it pickles (it travels with the requests to rank 0's process) as its directory, read again on first use
    import pickle
    blob = pickle.dumps(ours)
    assert len(blob) < 1000
    again = pickle.loads(blob)
    assert again.encode_chat(CHAT) == ours.encode_chat(CHAT) and again.decode([5, 6]) == ours.decode([5, 6])
    assert len(pickle.dumps(again)) < 1000
    from models.tokenizer import Tokenizer  # one built in memory pickles whole
    mem = Tokenizer(ours.backend, ours.special_tokens, ours.chat_template)
    assert pickle.loads(pickle.dumps(mem)).encode_chat(CHAT) == ours.encode_chat(CHAT)


def _run(runner, plan, prompts, tmp_path, *args) -> dict:
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    out = tmp_path / "out.jsonl"
    res = runner.invoke(app, ["run", str(plan), "--prompts", str(tmp_path / "p.jsonl"), "-o", str(out), "-q",
                              "--max-new-tokens", str(MAX_NEW), *args])
    assert res.exit_code == 0, (res.output, res.exception)
    return {d["id"]: d for d in map(json.loads, out.read_text().splitlines())}


def test_text_and_chat_prompts_serve_like_id_prompts_and_like_transformers(ckpt, tmp_path):
    path, plan, hf, model, stop_id = ckpt
    assert import_eos(path) == [EOS, stop_id]  # the plan's stop ids are generation_config.json's
    text_ids = hf(TEXT)["input_ids"]
    chat_ids = hf.apply_chat_template(CHAT, add_generation_prompt=True)["input_ids"]
    prompts = [{"id": "text", "prompt": TEXT}, {"id": "ids", "prompt_token_ids": text_ids},
               {"id": "chat", "messages": CHAT}, {"id": "chat-ids", "prompt_token_ids": chat_ids},
               {"id": "other", "prompt": "What is the capital", "max_new_tokens": 6}]
    got = _run(CliRunner(), plan, prompts, tmp_path, "--in-process")
    assert got["text"]["prompt_token_ids"] == got["ids"]["prompt_token_ids"] == text_ids
    assert got["chat"]["prompt_token_ids"] == got["chat-ids"]["prompt_token_ids"] == chat_ids
    for name, ids, n in (("text", text_ids, MAX_NEW), ("chat", chat_ids, MAX_NEW),
                         ("other", hf("What is the capital")["input_ids"], 6)):
        with torch.no_grad():  # transformers stops at generation_config.json's ids, as loaded with the model
            want = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                                  pad_token_id=PAD)[0, len(ids):].tolist()
        line = got[name]
        assert line["output_token_ids"] == want, name
        stopped = want[-1] in (EOS, stop_id)
        assert line["finish_reason"] == ("eos" if stopped else "length")
        # the text: transformers' decode without the token that stopped it (vLLM's convention), special tokens skipped
        assert line["text"] == hf.decode(want[:-1] if stopped else want, skip_special_tokens=True), name
    # the generation_config stop id ends TEXT's request where transformers ends it (chosen at step >= 4)
    assert got["text"]["output_token_ids"][-1] == stop_id and len(got["text"]["output_token_ids"]) >= 4
    assert got["ids"]["output_token_ids"] == got["text"]["output_token_ids"]
    assert got["chat-ids"]["output_token_ids"] == got["chat"]["output_token_ids"]
    assert "text" in got["ids"]  # a tokenizer exists: id prompts get text too


def import_eos(path) -> list[int]:
    from models.checkpoint import import_spec
    return import_spec(path).eos_token_ids


def test_per_request_stops_and_sampling_in_rank_processes(ckpt, tmp_path):
    """One multi-process run (2 rank processes: the stop ids travel to the home rank on the wire): a line's own stop
    ids end it with finish reason "stop"; a stop string cuts the text before it and the ids after the token that
    completed it; greedy lines match the in-process greedy tokens; sampled lines are reproducible from their seed."""
    path, plan, hf, model, stop_id = ckpt
    text_ids = hf(TEXT)["input_ids"]
    with torch.no_grad():
        free = _hf_greedy(model, text_ids, eos_token_id=None, min_new_tokens=MAX_NEW)
    first_stop = free.index(stop_id)
    assert first_stop >= 3
    # a stop string: the first characters of free[1:3]'s text, not in free[0]'s
    full = hf.decode(free[:first_stop])
    needle = hf.decode(free[1:3]).strip()[:3]
    assert needle and full.find(needle) >= len(hf.decode(free[:1]))
    prompts = [{"id": "stop-id", "prompt": TEXT, "stop_token_ids": [free[1]]},
               {"id": "stop-str", "prompt": TEXT, "stop": ["@@never@@", needle]},
               {"id": "plain", "prompt": TEXT},
               {"id": "sampled-a", "prompt": TEXT, "temperature": 1.5, "top_k": 20, "seed": 11},
               {"id": "sampled-b", "prompt": TEXT, "temperature": 1.5, "top_k": 20, "seed": 11}]
    got = _run(CliRunner(), plan, prompts, tmp_path, "--procs-timeout", "240")
    assert got["stop-id"]["output_token_ids"] == free[:2] and got["stop-id"]["finish_reason"] == "stop"
    assert got["plain"]["output_token_ids"] == free[:first_stop + 1] and got["plain"]["finish_reason"] == "eos"
    cut = got["stop-str"]
    assert cut["finish_reason"] == "stop" and cut["text"] == full[:full.find(needle)]
    n = len(cut["output_token_ids"])
    assert cut["output_token_ids"] == free[:n]
    assert needle in hf.decode(free[:n]) and needle not in hf.decode(free[:n - 1])
    assert got["sampled-a"]["output_token_ids"] == got["sampled-b"]["output_token_ids"]


def test_load_prompts_fields_and_mistakes(ckpt, tmp_path):
    from lowering.plan import load_plan
    from models.sampling import SamplingParams
    from runtime.drivers.workload import load_prompts
    path, plan, _, _, _ = ckpt
    spec = load_plan(plan).spec
    tok = load_tokenizer(path)
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"id": "a", "prompt": "hi", "temperature": 0, "seed": 9, "stop_token_ids": [7]}) + "\n"
                 + json.dumps({"id": "b", "messages": [{"role": "user", "content": [{"type": "text", "text": "x"},
                                                                                    {"type": "text", "text": "y"}]}]})
                 + "\n")
    a, b = load_prompts(p, spec, 5, SamplingParams(temperature=0.5, top_p=0.9, seed=3), tokenizer=tok,
                        stop_token_ids=(4,), stop=("zz",))
    assert a.params == SamplingParams(temperature=0.0, top_p=0.9, seed=9) and a.stop_token_ids == (4, 7)
    assert b.params == SamplingParams(temperature=0.5, top_p=0.9, seed=4) and b.stop == ("zz",)
    assert b.prompt == tok.encode_chat([{"role": "user", "content": "x\ny"}])  # text parts joined, as vLLM does
    for line, needle in [({"prompt": "x", "prompt_token_ids": [1]}, "exactly one of"),
                         ({"messages": [{"role": "assistant", "content": "hi"}]}, "must start with a user"),
                         ({"messages": [{"content": "hi"}]}, "string 'role'"),
                         ({"prompt": ""}, "non-empty string"),
                         ({"prompt": "x", "top_p": 0}, "'top_p'"),
                         ({"prompt": "x", "top_k": 1.5}, "'top_k' must be an integer"),
                         ({"prompt": "x", "stop_token_ids": [10 ** 6]}, "stop_token_ids"),
                         ({"prompt": "x", "stop": [""]}, "'stop'"),
                         ({"prompt": "x", "n": 2}, "unknown field")]:
        p.write_text(json.dumps({"id": "z", **line}) + "\n")
        with pytest.raises(UserError, match=needle) as err:
            load_prompts(p, spec, 5, tokenizer=tok)
        assert f"{p}:1" in str(err.value) and "\n" not in str(err.value)


def test_text_prompt_on_a_spec_without_tokenizer_is_exit_2(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert CliRunner().invoke(app, ["compile", "tiny", "--ranks", "2"]).exit_code == 0
    for line, field in (({"id": "a", "prompt": "hello"}, "prompt"),
                        ({"id": "a", "messages": [{"role": "user", "content": "hi"}]}, "messages"),
                        ({"id": "a", "prompt_token_ids": [1, 2], "stop": ["x"]}, "stop")):
        (tmp_path / "p.jsonl").write_text(json.dumps({"id": "ok", "prompt_token_ids": [3, 4]}) + "\n"
                                          + json.dumps(line) + "\n")
        monkeypatch.setattr(sys, "argv", ["dataflow", "run", "--prompts", "p.jsonl", "--in-process", "-q"])
        with pytest.raises(SystemExit) as code:
            cli.main()
        err = capsys.readouterr().err.strip()
        assert code.value.code == 2 and len(err.splitlines()) == 1, err
        assert "p.jsonl:2" in err and f"'{field}'" in err and "random weights" in err and "valid:" in err
    # ids keep working there, and no "text" appears
    (tmp_path / "p.jsonl").write_text(json.dumps({"id": "ok", "prompt_token_ids": [3, 4]}) + "\n")
    res = CliRunner().invoke(app, ["run", "--prompts", "p.jsonl", "--in-process", "-q", "-o", "o.jsonl",
                                   "--max-new-tokens", "2"])
    assert res.exit_code == 0, res.output
    assert "text" not in json.loads((tmp_path / "o.jsonl").read_text())


def test_generation_config_defaults(tmp_path):
    def read(d):
        (tmp_path / "generation_config.json").write_text(json.dumps(d))
        return read_generation_config(tmp_path)

    assert read_generation_config(tmp_path / "nowhere") is None
    assert read({"eos_token_id": 2}).eos_token_ids == [2]
    g = read({"eos_token_id": [2, 82, 2], "temperature": 0.7, "top_p": 0.9})  # do_sample absent: greedy
    assert g.eos_token_ids == [2, 82] and g.sampling == {"temperature": 0.0}
    assert read({"do_sample": True, "temperature": 0.6, "top_p": 0.95}).sampling == \
        {"temperature": 0.6, "top_p": 0.95, "top_k": 50}  # transformers' top_k default
    assert read({"do_sample": True, "top_k": 0}).sampling == {"temperature": 1.0, "top_p": 1.0, "top_k": 0}
    assert read({}).eos_token_ids is None
    for bad, needle in (({"eos_token_id": "2"}, "eos_token_id"), ({"do_sample": "yes"}, "do_sample"),
                        ({"do_sample": True, "top_p": 1.5}, "top_p"), ({"do_sample": True, "top_k": -1}, "top_k")):
        with pytest.raises(UserError, match=needle):
            read(bad)


def test_cli_sampling_defaults_come_from_generation_config(ckpt, tmp_path):
    from dataflow.cmd_run import _sampling_defaults
    from models.checkpoint import import_spec
    path = tmp_path / "c"
    path.mkdir()
    for f in ("config.json", "model.safetensors"):
        (path / f).symlink_to(ckpt[0] / f)
    (path / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 0.6, "top_k": 20}))
    spec = import_spec(path)
    assert spec.eos_token_ids == [EOS]  # no eos_token_id there: config.json's
    assert _sampling_defaults(spec, temperature=None, top_p=None, top_k=None) == \
        {"temperature": 0.6, "top_p": 1.0, "top_k": 20}
    assert _sampling_defaults(spec, temperature=0.0, top_p=0.5, top_k=None) == \
        {"temperature": 0.0, "top_p": 0.5, "top_k": 20}


def test_stop_ids_on_the_wire_and_text_output():
    import numpy as np

    from runtime.core.requests import Request
    from runtime.drivers.admission import request_from_wire, request_to_wire
    from runtime.transport.wire import DATA, Codec, new_secret
    secret = new_secret()
    tx, rx = Codec(secret, 1, 2), Codec(secret, 0, 2)  # the signed msgpack frame the admission message travels in
    for stops in ((), (5, 9)):
        req = Request(3, "a", [1, 2], 4, stop_token_ids=stops, stop=("x",), tokenizer=object())
        meta = rx.decode(tx.encode(DATA, 0, {"t": "adm", "w": 0, "req": request_to_wire(req)})).meta
        back = request_from_wire(meta["req"])
        assert back.stop_token_ids == stops and back.stop == () and back.tokenizer is None
    d = request_to_wire(Request(3, "a", [1, 2], 4))
    d["stop_token_ids"] = np.zeros((1, 1), dtype=np.int64)
    with pytest.raises(ValueError, match="stop_token_ids"):
        request_from_wire(d)


def test_text_output_stop_strings(ckpt):
    tok = load_tokenizer(ckpt[0])
    ids = tok.encode("Hello world, this is a tiny tokenizer.")[1:]
    full = tok.decode(ids)
    assert text_output(tok, ids, "length") == {"output_token_ids": ids, "text": full, "finish_reason": "length"}
    out = text_output(tok, ids + [EOS], "eos", stop=[" tiny", "world"])
    assert out["text"] == "Hello " and out["finish_reason"] == "stop"
    assert "world" in tok.decode(out["output_token_ids"]) and "world" not in tok.decode(out["output_token_ids"][:-1])
    assert text_output(tok, ids, "length", stop=["absent"])["text"] == full


def test_the_server_answers_text_and_chat_like_dataflow_run(ckpt, tmp_path):
    """`dataflow serve` on the checkpoint, driven by the openai client: completions and chat, streamed and not, give
    `dataflow run`'s tokens and text for the same prompts; a stop string ends the text before it."""
    openai = pytest.importorskip("openai")
    from test_serve import running_server
    path, plan, hf, _, _ = ckpt
    want = _run(CliRunner(), plan, [{"id": "text", "prompt": TEXT}, {"id": "chat", "messages": CHAT}], tmp_path,
                "--in-process")
    with running_server(plan, max_outstanding=16) as (base, _srv):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
        name = client.models.list().data[0].id
        res = client.completions.create(model=name, prompt=TEXT, max_tokens=MAX_NEW, temperature=0)
        assert res.choices[0].model_extra["token_ids"] == want["text"]["output_token_ids"]
        assert res.choices[0].text == want["text"]["text"] and res.choices[0].finish_reason == "stop"
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model=name, prompt=TEXT, max_tokens=MAX_NEW, temperature=0, stream=True))
        assert streamed == want["text"]["text"]
        chat = client.chat.completions.create(model=name, messages=CHAT, max_tokens=MAX_NEW, temperature=0)
        assert chat.choices[0].message.content == want["chat"]["text"]
        assert chat.choices[0].model_extra["token_ids"] == want["chat"]["output_token_ids"]
        parts = [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in CHAT]   # OpenAI's content parts
        chat_parts = client.chat.completions.create(model=name, messages=parts, max_tokens=MAX_NEW, temperature=0)
        assert chat_parts.choices[0].model_extra["token_ids"] == want["chat"]["output_token_ids"]
        pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model=name, messages=CHAT, max_tokens=MAX_NEW, temperature=0, stream=True)]
        assert "".join(pieces) == want["chat"]["text"]
        text = want["chat"]["text"]
        if len(text.strip()) >= 2:  # a stop string taken from the middle of the expected text
            stop = text.strip()[len(text.strip()) // 2:][:2]
            cut = client.chat.completions.create(model=name, messages=CHAT, max_tokens=MAX_NEW, temperature=0,
                                                 stop=[stop])
            assert cut.choices[0].message.content == text[:text.find(stop)]
            assert cut.choices[0].finish_reason == "stop"
