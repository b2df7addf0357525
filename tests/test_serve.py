"""`dataflow serve` (dataflow/openai_api.py over runtime/drivers/front.py): 2 CPU rank processes behind the HTTP API, driven
by the official openai client. Token-id prompts here (a shipped spec has no tokenizer); text and chat prompts on a
checkpoint with a tokenizer are in tests/test_text_io.py. Nothing asserts on wall-clock time; every wait is bounded.
"""
from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from lowering.plan import compile_plan, save_plan
from test_runtime import assert_matches_reference, make_requests, model

NAME = "tiny-mixtral"


def running_server(plan_dir, **options):
    from lab.serve_thread import serve_in_thread
    return serve_in_thread(plan_dir, startup_timeout_s=120, **options)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One server for the module (starting rank processes is the expensive part): (base url, plan, Server)."""
    spec, _, _ = model(NAME)
    plan = compile_plan(spec, 2, attn_cap=16, block_size=4)
    plan_dir = tmp_path_factory.mktemp("plan")
    save_plan(plan, plan_dir)
    with running_server(plan_dir, kv_blocks=128, max_outstanding=128) as (base, srv):
        yield base, plan, srv


def _client(base: str):
    import openai
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)


def _requests(n: int, seed: int, max_new: int):
    spec, _, _ = model(NAME)
    return make_requests(spec.vocab_size, n, seed=seed, max_new=max_new, max_prompt=40)


def test_completions_streamed_and_not_match_the_reference(server):
    base, plan, _ = server
    client = _client(base)
    assert [m.id for m in client.models.list().data] == [plan.spec.name]
    reqs = _requests(4, seed=11, max_new=10)
    for r in reqs:
        res = client.completions.create(model=plan.spec.name, prompt=r.prompt, max_tokens=r.max_new_tokens,
                                        temperature=0, extra_body={"ignore_eos": True})
        choice = res.choices[0]
        r.output, r.finish_reason = choice.model_extra["token_ids"], "length"
        assert choice.finish_reason == "length" and res.usage.completion_tokens == r.max_new_tokens
        streamed = []
        for chunk in client.completions.create(model=plan.spec.name, prompt=r.prompt, max_tokens=r.max_new_tokens,
                                               temperature=0, stream=True, extra_body={"ignore_eos": True}):
            streamed.extend(chunk.choices[0].model_extra["token_ids"])
        assert streamed == r.output
    assert assert_matches_reference(NAME, reqs) > 15


def test_64_concurrent_streams_lose_and_duplicate_nothing(server):
    import openai
    base, plan, _ = server
    reqs = _requests(64, seed=12, max_new=8)

    async def one(client, r):
        got = []
        stream = await client.completions.create(model=plan.spec.name, prompt=r.prompt, max_tokens=r.max_new_tokens,
                                                 stream=True, extra_body={"ignore_eos": True})
        async for chunk in stream:
            got.extend(chunk.choices[0].model_extra["token_ids"])
        return got

    async def main():
        client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)
        return await asyncio.gather(*(one(client, r) for r in reqs))

    outs = asyncio.run(main())
    for r, out in zip(reqs, outs):
        assert len(out) == r.max_new_tokens
        r.output, r.finish_reason = out, "length"
    assert assert_matches_reference(NAME, reqs) > 15


def _metric(base: str, name: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_a_client_that_disconnects_frees_its_pages(server):
    base, plan, srv = server
    free_before = None
    deadline = time.monotonic() + 30
    while free_before is None:  # the ranks' admission state reaches the front every second: an idle one
        st = srv.front.stats
        if st and st["running"] == 0 and st["waiting"] == 0 and srv.front.outstanding == 0:
            free_before = tuple(st["free_kv"])
        assert time.monotonic() < deadline
        time.sleep(0.1)
    aborted_before = _metric(base, 'dataflow_requests_total{finish_reason="abort"}')
    prompt = _requests(1, seed=13, max_new=1)[0].prompt
    body = {"model": plan.spec.name, "prompt": prompt, "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as res:
        assert res.status_code == 200
        lines = res.iter_lines()
        for _ in range(3):  # a few tokens, then hang up
            assert next(lines).startswith("data: ")
            next(lines)
    deadline = time.monotonic() + 60
    while True:  # bounded: the cancel reaches the home, which finishes it at its next token and frees its pages
        st = srv.front.stats
        if srv.front.outstanding == 0 and st and tuple(st["free_kv"]) == free_before and st["running"] == 0:
            break
        assert time.monotonic() < deadline, (srv.front.outstanding, st, free_before)
        time.sleep(0.1)
    assert _metric(base, 'dataflow_requests_total{finish_reason="abort"}') == aborted_before + 1
    text = httpx.get(f"{base}/metrics", timeout=10).text
    for rank in (0, 1):  # per-rank gauges from rank 0's admission state and every rank's heartbeat
        assert f'dataflow_kv_free_pages{{rank="{rank}"}}' in text and f'dataflow_queued_rows{{rank="{rank}"}}' in text


def test_bad_requests_get_openai_errors(server):
    base, plan, _ = server
    cases = [
        ({"model": plan.spec.name, "prompt": [1, 2], "max_tokens": -1}, 400, "max_tokens"),
        ({"model": plan.spec.name, "prompt": "text needs a tokenizer"}, 400, "tokenizer"),
        ({"model": plan.spec.name, "prompt": [10 ** 9]}, 400, "token ids"),
        ({"model": plan.spec.name, "prompt": [1, 2], "max_tokens": 10 ** 6}, 400, "context"),
        ({"model": "gpt-4", "prompt": [1, 2]}, 404, "not served"),
        ({"prompt": [1], "n": 3}, 400, "n"),
    ]
    for body, status, words in cases:
        res = httpx.post(f"{base}/v1/completions", json=body, timeout=30)
        assert res.status_code == status, (body, res.text)
        err = res.json()["error"]
        assert words in err["message"] and err["type"], (body, err)
    res = httpx.post(f"{base}/v1/completions", content=b"{not json", timeout=30,
                     headers={"content-type": "application/json"})
    assert res.status_code == 400 and "error" in res.json()
    assert _metric(base, "dataflow_generation_tokens_total") > 0


def test_the_serving_benchmark_measures_the_server(server, tmp_path):
    """benchmarks/serve_bench.py against this server: every request completes with its sampled length, and the
    report has the latency percentiles (their values are the benchmark's business, not this test's)."""
    import argparse
    import sys
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent.parent / "benchmarks"))
    import serve_bench
    base, _, _ = server
    args = argparse.Namespace(base_url=base, plan=None, dataset="gsm8k", num_prompts=6, request_rate=50.0,
                              max_context=96, vocab_size=None, kv_blocks=None, max_outstanding=64, seed=1)
    report = asyncio.run(serve_bench.run(args))
    serve_bench.write(report, tmp_path, "test")
    assert report["completed"] == 6 and report["failed"] == 0, report["errors"]
    assert report["p99_ttft_ms"] >= report["p50_ttft_ms"] > 0 and report["output_tokens_per_s"] > 0
    assert "| TTFT |" in (tmp_path / "serve_bench.md").read_text()


def _server_rank_pid(srv, rank: int) -> int:
    """The pid of `srv`'s rank process (its children carry RANK and the run's secret in their environment; the
    module's other server is a child of this process too)."""
    import os
    mark = f"DATAFLOW_RUN_SECRET={srv.front.secret.hex()}".encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if mark in env and f"RANK={rank}".encode() in env:
            return int(pid)
    raise AssertionError(f"no rank {rank} process of this server")


def test_a_rank_that_dies_ends_open_streams_and_the_server_says_unavailable(tmp_path):
    """A rank process killed while a stream is open: the stream ends (no hang), /health answers 503 naming the
    failure, and new requests get a 503 in OpenAI's error shape."""
    import os
    import signal
    spec, _, _ = model(NAME)
    plan_dir = tmp_path / "plan"
    save_plan(compile_plan(spec, 2, attn_cap=16, block_size=4), plan_dir)
    with running_server(plan_dir, kv_blocks=128, peer_timeout=3.0) as (base, srv):
        prompt = _requests(1, seed=14, max_new=1)[0].prompt
        body = {"model": spec.name, "prompt": prompt, "max_tokens": 400, "stream": True, "ignore_eos": True}
        chunks = 0
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as res:
            assert res.status_code == 200
            try:
                for line in res.iter_lines():
                    if line.startswith("data: "):
                        chunks += 1
                        if chunks == 3:
                            os.kill(_server_rank_pid(srv, 1), signal.SIGKILL)
            except httpx.HTTPError:
                pass  # the stream was cut: that is one way for it to end
        assert 3 <= chunks < 400
        deadline = time.monotonic() + 60
        while httpx.get(f"{base}/health", timeout=10).status_code != 503:
            assert time.monotonic() < deadline, "the server still says healthy after a rank died"
            time.sleep(0.2)
        assert "rank" in httpx.get(f"{base}/health", timeout=10).json()["error"]
        res = httpx.post(f"{base}/v1/completions", json={"model": spec.name, "prompt": prompt}, timeout=30)
        assert res.status_code == 503 and res.json()["error"]["code"] == "unavailable"
        assert srv.front.outstanding == 0
