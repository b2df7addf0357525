"""The OpenAI-compatible HTTP API of `dataflow serve` (FastAPI), over runtime/drivers/front.py's Front.

    POST /v1/completions        prompt: text (needs the checkpoint's tokenizer) or token ids; stream: SSE
    POST /v1/chat/completions   messages, rendered with the tokenizer's chat template; stream: SSE
    GET  /v1/models             the one model this server serves
    GET  /health                200 once the ranks serve, 503 before and after
    GET  /metrics               Prometheus text: requests running / waiting, tokens, TTFT and ITL histograms,
                                free KV pages and queued rows per rank

Request bodies are pydantic models; a bad one is a 400 in OpenAI's error shape ({"error": {"message", "type",
"param", "code"}}). Sampling defaults come from the checkpoint's generation_config.json (runtime values of the
request override them), its stop ids end requests besides the model's EOS, and stop strings are matched on the
decoded text as tokens stream (the request is cancelled at the first match: its KV is freed). A client that
disconnects cancels its request. Too many requests outstanding is a 503 with Retry-After, never an unbounded queue.
Extensions (as vLLM's): top_k, ignore_eos, stop_token_ids; and each choice carries "token_ids".
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Optional, Union

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from models.sampling import SamplingParams
from models.tokenizer import first_stop
from runtime.drivers.front import Front, Overloaded, Unavailable
from runtime.drivers.workload import chat_messages

OPENAI_FINISH = {"eos": "stop", "stop": "stop", "length": "length", "abort": "abort", "error": "error"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: Optional[str] = None,
                 code: Optional[str] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def response(self) -> JSONResponse:
        headers = {"Retry-After": "1"} if self.status == 503 else None
        return JSONResponse({"error": {"message": self.message, "type": self.kind, "param": self.param,
                                       "code": self.code}}, status_code=self.status, headers=headers)


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")  # OpenAI clients send fields this server has no use for (user, ...)

    model: Optional[str] = None
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=0)
    seed: Optional[int] = None
    stream: bool = False
    stop: Union[str, list[str], None] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    n: int = Field(1, ge=1, le=1)


class CompletionBody(_Sampling):
    prompt: Union[str, list[int], list[str]]
    echo: bool = False
    logprobs: Optional[int] = Field(None, le=0)


class ChatBody(_Sampling):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)


class Server:
    """What the endpoints share: the front, the model's (a graph_ir ModelSpec) name and limits, its tokenizer (None:
    token ids only) and its checkpoint's generation defaults."""

    def __init__(self, front: Front, spec, tokenizer=None) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        from models.generation_config import read_generation_config
        self.front, self.tokenizer, self.model = front, tokenizer, spec.name
        self.max_position, self.vocab_size = spec.max_position, spec.vocab_size
        self.defaults = read_generation_config(spec.weights.path) if spec.weights.source == "checkpoint" else None
        self.stop_ids = tuple(spec.eos_token_ids) + tuple((self.defaults.eos_token_ids or []) if self.defaults else [])
        self.created = int(time.time())
        r = self.registry = CollectorRegistry()
        buckets = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
        self.m_running = Gauge("dataflow_requests_running", "requests admitted to a rank and not finished", registry=r)
        self.m_waiting = Gauge("dataflow_requests_waiting", "requests waiting for KV pages", registry=r)
        self.m_outstanding = Gauge("dataflow_requests_outstanding", "requests this server has open", registry=r)
        self.m_kv_free = Gauge("dataflow_kv_free_pages", "free KV pages per rank", ["rank"], registry=r)
        self.m_queued = Gauge("dataflow_queued_rows", "rows waiting in each rank's mu-queues", ["rank"], registry=r)
        self.m_requests = Counter("dataflow_requests", "finished requests", ["finish_reason"], registry=r)
        self.m_prompt = Counter("dataflow_prompt_tokens", "prompt tokens", registry=r)
        self.m_generated = Counter("dataflow_generation_tokens", "generated tokens", registry=r)
        self.m_ttft = Histogram("dataflow_time_to_first_token_seconds", "time to first token", buckets=buckets,
                                registry=r)
        self.m_itl = Histogram("dataflow_inter_token_latency_seconds", "time between a request's tokens",
                               buckets=buckets, registry=r)
        self.m_e2e = Histogram("dataflow_e2e_request_latency_seconds", "request latency", buckets=buckets, registry=r)

    # ------------------------------------------------------------------ request -> ids and sampling
    def check_model(self, body: _Sampling) -> None:
        if body.model is not None and body.model != self.model:
            raise ApiError(404, f"model {body.model!r} is not served here; this server serves {self.model!r}",
                           param="model", code="model_not_found")

    def _need_tokenizer(self, what: str):
        if self.tokenizer is None:
            raise ApiError(400, f"{what} needs a tokenizer, and model {self.model!r} has none (a shipped spec with "
                                f"random weights): send the prompt as token ids", param="prompt")
        return self.tokenizer

    def prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            ids = self._need_tokenizer("a text prompt").encode(prompt)
        elif prompt and all(isinstance(x, int) for x in prompt):
            ids = list(prompt)
        elif len(prompt) == 1 and isinstance(prompt[0], str):
            ids = self._need_tokenizer("a text prompt").encode(prompt[0])
        else:
            raise ApiError(400, "prompt must be a string, a list of one string, or a non-empty list of token ids "
                                "(batched prompts: one request each)", param="prompt")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if not ids or bad:
            raise ApiError(400, f"prompt token ids must be 0..{self.vocab_size - 1} and at least one; got "
                                f"{bad[:5] if bad else 'none'}", param="prompt")
        return ids

    def chat_ids(self, messages: list[dict]) -> list[int]:
        tok = self._need_tokenizer("chat")
        try:  # content as a string or OpenAI's text parts, joined as `dataflow run`'s prompt files join them
            return tok.encode_chat(chat_messages("body", messages), add_generation_prompt=True)
        except Exception as err:  # a template's raise_exception, a missing template, a bad message
            raise ApiError(400, f"messages: {err}", param="messages") from None

    def sampling(self, body: _Sampling, prompt_len: int, max_tokens: Optional[int], default_max: int):
        room = self.max_position - prompt_len
        if room < 1:
            raise ApiError(400, f"the prompt has {prompt_len} tokens; this model's context is {self.max_position}",
                           param="prompt", code="context_length_exceeded")
        n = max_tokens if max_tokens is not None else min(default_max, room)
        if n > room:
            raise ApiError(400, f"prompt ({prompt_len} tokens) + max_tokens ({n}) exceeds this model's context of "
                                f"{self.max_position} tokens", param="max_tokens", code="context_length_exceeded")
        values = dict(self.defaults.sampling) if self.defaults is not None else {}
        for key in ("temperature", "top_p", "top_k", "seed"):
            if getattr(body, key) is not None:
                values[key] = getattr(body, key)
        try:
            params = SamplingParams(**values)
        except ValidationError as err:
            e = err.errors()[0]
            raise ApiError(400, f"{e['loc'][0]}: {e['msg']}", param=str(e["loc"][0])) from None
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        stop_ids = tuple(body.stop_token_ids or ()) + (() if body.ignore_eos else self.stop_ids)
        return n, params, stop, stop_ids

    # ------------------------------------------------------------------ serving one request
    async def generate(self, ids: list[int], n: int, params, stop: list[str], stop_ids: tuple,
                       ignore_eos: bool) -> AsyncIterator[tuple[str, list[int], Optional[str]]]:
        """(text delta, new token ids, finish reason or None) as tokens come; the last item has the reason."""
        try:
            stream = await self.front.submit(ids, n, params, stop_token_ids=stop_ids, ignore_eos=ignore_eos)
        except Overloaded as err:
            raise ApiError(503, f"server busy: {err}; retry later", kind="server_error", code="overloaded") from None
        except Unavailable as err:
            raise ApiError(503, f"not serving: {err}", kind="server_error", code="unavailable") from None
        self.m_prompt.inc(len(ids))
        t0 = last = time.monotonic()
        tokens: list[int] = []
        sent = ""  # text already given out
        finished = False
        ends = set(stop_ids)  # a token that ends the request: not part of its text (vLLM's convention)
        hold = max((len(s) for s in stop), default=1) - 1
        try:
            async for new in stream:
                now = time.monotonic()
                (self.m_ttft if not tokens else self.m_itl).observe(now - (t0 if not tokens else last))
                last = now
                tokens.extend(new)
                self.m_generated.inc(len(new))
                text = self._text(tokens, drop_last=tokens[-1] in ends)
                cut = first_stop(text, stop) if stop else -1
                if cut >= 0:  # a stop string: the text ends before it, the request is cancelled
                    delta = text[len(sent):cut] if cut > len(sent) else ""
                    finished = True
                    await self.front.cancel(stream.rid)
                    self._finish("stop", t0)
                    yield delta, new, "stop"
                    return
                # Held back: a partial character at the end (it decodes as U+FFFD until its last byte comes), and as
                # many characters as could be the start of a stop string, so no text given out is ever taken back.
                safe = len(text.rstrip("\ufffd")) - hold
                delta = text[len(sent):safe] if safe > len(sent) else ""
                sent += delta
                yield delta, new, None
            finished = True
            reason = stream.reason or "error"
            if reason == "error":
                raise ApiError(500, stream.error or "the request failed", kind="server_error")
            final = self._text(tokens, drop_last=reason in ("eos", "stop") or bool(tokens) and tokens[-1] in ends)
            self._finish(reason, t0)
            yield final[len(sent):] if final.startswith(sent) else "", [], reason
        finally:
            if not finished:  # the client went away (the task is being cancelled): free its KV pages
                asyncio.get_running_loop().create_task(self.front.cancel(stream.rid))
                self._finish("abort", t0)

    def _text(self, tokens: list[int], drop_last: bool = False) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(tokens[:-1] if drop_last and tokens else tokens)

    def _finish(self, reason: str, t0: float) -> None:
        self.m_requests.labels(OPENAI_FINISH.get(reason, reason)).inc()
        self.m_e2e.observe(time.monotonic() - t0)

    def metrics_text(self) -> str:
        from prometheus_client import generate_latest
        st = self.front.stats
        self.m_outstanding.set(self.front.outstanding)
        if st:
            self.m_running.set(st["running"])
            self.m_waiting.set(st["waiting"])
            for rank, free in enumerate(st["free_kv"]):
                self.m_kv_free.labels(str(rank)).set(free)
            for rank, rows in enumerate(st["queued"]):
                self.m_queued.labels(str(rank)).set(rows)
        return generate_latest(self.registry).decode()


def _usage(ids: list[int], tokens: list[int]) -> dict:
    return {"prompt_tokens": len(ids), "completion_tokens": len(tokens), "total_tokens": len(ids) + len(tokens)}


def _sse_response(chunks) -> StreamingResponse:
    """Server-sent events: each JSON object of the async iterator `chunks`, then [DONE]."""
    async def events():
        async for obj in chunks:
            yield f"data: {json.dumps(obj)}\n\n"
        yield "data: [DONE]\n\n"
    return StreamingResponse(events(), media_type="text/event-stream")


def create_app(server: Server) -> FastAPI:
    """The FastAPI app; its lifespan starts the ranks and shuts them down."""

    @asynccontextmanager
    async def lifespan(_app):
        await server.front.start()
        try:
            yield
        finally:
            await server.front.close()

    app = FastAPI(title="dataflow", lifespan=lifespan)

    @app.exception_handler(ApiError)
    async def _api_error(_req, err: ApiError):
        return err.response()

    @app.exception_handler(RequestValidationError)
    async def _bad_body(_req, err: RequestValidationError):
        e = err.errors()[0]
        where = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        return ApiError(400, f"{where}: {e.get('msg')}", param=where or None).response()

    @app.get("/health")
    async def health():
        if not server.front.ready:
            return JSONResponse({"status": "unavailable", "error": server.front.failure}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.model, "object": "model", "created": server.created,
                                            "owned_by": "dataflow", "max_model_len": server.max_position,
                                            "vocab_size": server.vocab_size}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(server.metrics_text(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(body: CompletionBody):
        server.check_model(body)
        ids = server.prompt_ids(body.prompt)
        n, params, stop, stop_ids = server.sampling(body, len(ids), body.max_tokens, 16)
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": server.model}
        gen = server.generate(ids, n, params, stop, stop_ids, body.ignore_eos)
        prefix = server._text(ids) if body.echo else ""

        def choice(text: str, tokens: list[int], reason: Optional[str]) -> dict:
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": OPENAI_FINISH.get(reason, reason),
                    "token_ids": tokens}

        if body.stream:
            first = await anext(gen, None)  # errors before the first token are plain HTTP errors, not a broken stream

            async def chunks():
                echo = prefix  # (with the first chunk)
                async for text, tokens, reason in _chain(first, gen):
                    yield {**head, "choices": [choice(echo + text, tokens, reason)]}
                    echo = ""
            return _sse_response(chunks())
        text, tokens, reason = await _collect(gen)
        return {**head, "choices": [choice(prefix + text, tokens, reason)], "usage": _usage(ids, tokens)}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody):
        server.check_model(body)
        ids = server.chat_ids(body.messages)
        limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        n, params, stop, stop_ids = server.sampling(body, len(ids), limit, server.max_position)
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": server.model}
        gen = server.generate(ids, n, params, stop, stop_ids, body.ignore_eos)
        if body.stream:
            first = await anext(gen, None)
            head["object"] = "chat.completion.chunk"

            async def chunks():
                yield {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                            "finish_reason": None}]}
                async for text, tokens, reason in _chain(first, gen):
                    delta = {"content": text} if text or reason is None else {}
                    yield {**head, "choices": [{"index": 0, "delta": delta, "token_ids": tokens,
                                                "finish_reason": OPENAI_FINISH.get(reason, reason)}]}
            return _sse_response(chunks())
        text, tokens, reason = await _collect(gen)
        return {**head, "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                     "finish_reason": OPENAI_FINISH.get(reason, reason), "token_ids": tokens}],
                "usage": _usage(ids, tokens)}

    return app


async def _chain(first, gen):
    if first is not None:
        yield first
        async for item in gen:
            yield item


async def _collect(gen) -> tuple[str, list[int], Optional[str]]:
    text, tokens, reason = "", [], None
    async for delta, new, why in gen:
        text += delta
        tokens.extend(new)
        reason = why or reason
    return text, tokens, reason
