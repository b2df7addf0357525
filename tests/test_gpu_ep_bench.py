"""benchmarks/gpu_ep_bench.py's A/B bookkeeping and its results (benchmarks/ep_bench_report.py) (pure functions; the
bench itself runs on the GPU box and in its --smoke mode): environment variants, round labels and the medians over
rounds."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("gpu_ep_bench", Path(__file__).resolve().parents[1] / "benchmarks/gpu_ep_bench.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)
import ep_bench_report as report  # noqa: E402  (on sys.path once gpu_ep_bench is loaded)


def test_variants_parse_and_fail_clearly():
    """A RuntimeOptions field goes to the launch as DATAFLOW_OPTIONS (the rank processes' one override), any other
    key as the environment variable it names (a library's, such as NCCL_ALGO)."""
    assert bench.parse_variants(None) == [(None, {})]
    assert bench.parse_variants("host:dispatch=host;dev:dispatch=device,decode_wait_ms=0,X=1") == [
        ("host", {"DATAFLOW_OPTIONS": '{"dispatch":"host"}'}),
        ("dev", {"X": "1", "DATAFLOW_OPTIONS": '{"dispatch":"device","decode_wait_ms":0.0}'})]
    assert bench.parse_variants("ring:NCCL_ALGO=Ring") == [("ring", {"NCCL_ALGO": "Ring"})]
    for bad in ("lib", "lib:X", "a/b:X=1", ":X=1", "x:dispatch=both"):
        with pytest.raises(ValueError, match="--variants"):
            bench.parse_variants(bad)


def test_medians_over_rounds_use_same_round_ratios():
    def run(system, label, tps, ratio=None):
        r = {"system": system, "name": f"{system}/{label}/C8", "tokens_per_s": tps}
        if ratio is not None:
            r["ratio_vs_ag-ep"] = ratio
        return r
    results = {"runs": [run("ag-ep", "clean.r1", 100.0), run("s@a", "clean.r1", 50.0, 0.5),
                        run("ag-ep", "clean.r2", 200.0), run("s@a", "clean.r2", 80.0, 0.4),
                        run("ag-ep", "clean.r3", 150.0), run("s@a", "clean.r3", 90.0, 0.6)]}
    rows = {(r["system"], r["scenario"]): r for r in report.median_rows(results)}
    assert rows[("ag-ep", "clean")]["median"] == 150.0 and rows[("ag-ep", "clean")]["rounds"] == 3
    s = rows[("s@a", "clean")]
    assert (s["median"], s["lo"], s["hi"], s["ratio"]) == (80.0, 50.0, 90.0, 0.5)
    assert report._round_of("delay#2.r12") == 12 and report._round_of("clean") == 0
    assert any("rounds" in line for line in report.median_lines(results))
    # one round: no medians table
    assert report.median_lines({"runs": [run("ag-ep", "clean", 1.0)]}) == []


def test_delay_size_scenarios_validate_and_record_their_size(tmp_path, capsys):
    assert bench.unknown_names(["streaming-defrag", "ag-ep"], ["clean", "delay", "delay-5ms", "delay-0.5ms",
                                                               "delay-10ms", "compute-hog", "nvlink-hog"]) == []
    assert bench.unknown_names(["ag-ep"], ["delay-0ms", "delay-5us", "delay-5", "hog"]) == [
        "delay-0ms", "delay-5us", "delay-5", "hog"]
    assert bench.delay_us_of("delay", 2000.0) == 2000.0 and bench.delay_us_of("delay-5ms", 2000.0) == 5000.0
    assert bench.delay_us_of("delay-0.5ms", 2000.0) == 500.0 and bench.delay_us_of("clean", 2000.0) is None
    with pytest.raises(SystemExit):
        bench.main(["--out", str(tmp_path), "--smoke", "--scenarios", "clean,delay-5us"])
    err = capsys.readouterr().err
    assert "delay-5us" in err and "delay-<N>ms" in err and "delay (+--burst-us)" in err


def test_ratios_tables_and_medians_with_delay_size_labels():
    """Labels such as delay-0.5ms, delay-10ms#2 and their .rN round suffixes keep their own rows, their
    vs-clean ratio (against the same round's clean) and their streaming/ag-ep ratio."""
    def run(system, label, tps):
        return {"system": system, "name": f"{system}/{label}/C8", "tokens_per_s": tps, "unfinished": 0}
    labels = {"clean": 100.0, "delay-0.5ms": 90.0, "delay-10ms": 50.0, "delay-10ms#2": 40.0}
    runs = []
    for rnd in (1, 2):
        for label, tps in labels.items():
            runs += [run("ag-ep", f"{label}.r{rnd}", tps * rnd), run("streaming-defrag", f"{label}.r{rnd}", 2 * tps * rnd)]
    results = {"runs": runs}
    report.ratios(results)
    by = {r["name"]: r for r in runs}
    for rnd in (1, 2):
        assert report._round_of(f"delay-0.5ms.r{rnd}") == rnd and report._round_of(f"delay-10ms#2.r{rnd}") == rnd
        for label, tps in labels.items():
            for system in ("ag-ep", "streaming-defrag"):
                assert by[f"{system}/{label}.r{rnd}/C8"]["vs_clean"] == pytest.approx(tps / 100.0), (system, label)
            assert by[f"streaming-defrag/{label}.r{rnd}/C8"]["ratio_vs_ag-ep"] == pytest.approx(2.0)
    rows = {(r[0].strip(), r[1].strip()): r for r in (line.strip("|").split("|") for line in report.table_lines(results)[2:])}
    assert rows[("streaming-defrag", "delay-0.5ms.r1")][4].strip() == "0.90"
    assert rows[("ag-ep", "delay-10ms#2.r2")][4].strip() == "0.40"
    med = {(m["system"], m["scenario"]): m for m in report.median_rows(results)}
    assert set(s for _, s in med) == set(labels)
    assert med[("streaming-defrag", "delay-0.5ms")]["rounds"] == 2 and med[("streaming-defrag", "delay-0.5ms")]["ratio"] == 2.0
    assert med[("ag-ep", "delay-10ms#2")]["median"] == pytest.approx(60.0)


def test_delay_links_name_rank_pairs_both_ways(tmp_path, capsys):
    assert bench.parse_links(None, 4) is None and bench.parse_links("", 4) is None
    assert bench.parse_links("0-1, 2-3", 4) == [(0, 1), (1, 0), (2, 3), (3, 2)]
    for bad in ("0-4", "1-1", "0", "a-b"):
        with pytest.raises(ValueError, match="delay-links"):
            bench.parse_links(bad, 4)
    with pytest.raises(SystemExit):
        bench.main(["--out", str(tmp_path), "--smoke", "--ranks", "2", "--delay-links", "0-2"])
    assert "two different ranks in 0..1" in capsys.readouterr().err


def test_requests_follow_the_chosen_prompt_length_distribution():
    """--lengths: GSM8K prompts (a question, median ~60 tokens) are far shorter than ShareGPT's; both clipped."""
    import types
    spec = types.SimpleNamespace(vocab_size=1000)
    share = bench.make_requests(spec, 400, 0, 1024, 4, 8)
    gsm = bench.make_requests(spec, 400, 0, 1024, 4, 8, lengths="gsm8k")
    mean = lambda rs: sum(len(r.prompt) for r in rs) / len(rs)  # noqa: E731
    assert mean(gsm) < 0.5 * mean(share)
    assert max(len(r.prompt) for r in share + gsm) <= 1024 and all(4 <= r.max_new_tokens <= 8 for r in gsm)
