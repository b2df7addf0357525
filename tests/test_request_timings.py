"""Per-request latencies in every output line and the run's TTFT / TPOT / ITL percentiles (runtime/observability/metrics.py)."""
from __future__ import annotations

import json

import pytest

from runtime.observability.metrics import RequestStats, request_timings, summarize
from runtime.core.requests import Request
from runtime.drivers.workload import output_line


def _req(arrival: float, times: list[float]) -> Request:
    r = Request(0, "a", [1, 2], len(times), arrival=arrival)
    r.output, r.token_times, r.finish_reason = list(range(len(times))), times, "length"
    return r


def test_a_requests_line_carries_its_latencies():
    r = _req(1.0, [1.5, 1.6, 1.8, 1.9])  # first token 0.5 s after arrival; gaps 0.1, 0.2, 0.1
    t = request_timings(r)
    assert t["ttft_s"] == pytest.approx(0.5) and t["tpot_s"] == pytest.approx(0.4 / 3)
    assert t["itl_p50_s"] == pytest.approx(0.1) and t["itl_p99_s"] == pytest.approx(0.2)
    line = json.loads(output_line(r))
    assert line["ttft_s"] == pytest.approx(0.5) and line["output_token_ids"] == [0, 1, 2, 3]
    one = json.loads(output_line(_req(0.0, [0.25])))  # one token: no TPOT, no gaps
    assert one["ttft_s"] == 0.25 and one["tpot_s"] is None and one["itl_p99_s"] is None


def test_the_summary_has_ttft_tpot_and_itl_percentiles():
    reqs = [_req(0.0, [0.1 * (i + 1) + 0.01 * k for k in range(5)]) for i in range(10)]
    m = summarize(reqs, [], elapsed=2.0, stats=RequestStats.of(reqs))
    assert m["p50_ttft_s"] == pytest.approx(0.5) and m["p99_ttft_s"] == pytest.approx(1.0)
    assert m["p50_tpot_s"] == pytest.approx(0.01) and m["p50_itl_s"] == pytest.approx(0.01)
    assert m["max_itl_s"] == pytest.approx(0.01) and m["tokens"] == 50
