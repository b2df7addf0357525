"""A virtual-clock simulation split over processes (runtime/drivers/partitions.py): the same report as one process,
to the bit, and a clear failure (never a hang) when a process goes away."""
import json
import os
import pickle
import struct
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lab.network import Network, Topology
from lab.interference import LinkSchedule
from runtime.drivers.partitions import Failed, Partition, blocks


def _simulate(tmp_path: Path, processes: int, scenario: str = "slow-nic", extra: tuple = ()) -> tuple[dict, Path]:
    from lab.__main__ import app
    model = tmp_path / "tiny16.yaml"     # the tiny model with one expert per GPU at least
    model.write_text(Path("models/specs/tiny.yaml").read_text().replace("num_experts: 8", "num_experts: 16"))
    out = tmp_path / f"out{processes}{scenario}"
    res = CliRunner().invoke(app, ["simulate", str(model), "--ranks", "16", "-g", "2", "--requests-per-rank", "2",
                                   "--new-tokens", "6", "--systems", "streaming", "--scenario", scenario,
                                   "--processes", str(processes), "-o", str(out), *extra])
    assert res.exit_code == 0, res.output
    return json.loads((out / "report.json").read_text()), out


def _without_walls(doc):
    if isinstance(doc, dict):
        return {k: _without_walls(v) for k, v in doc.items() if "wall" not in k and k not in ("processes", "config")}
    if isinstance(doc, list):
        return [_without_walls(v) for v in doc]
    return doc


@pytest.mark.parametrize("processes", [2, 3])
def test_a_split_simulation_reports_what_one_process_reports(tmp_path, processes):
    one, out1 = _simulate(tmp_path, 1)
    split, out = _simulate(tmp_path, processes)
    assert [r["processes"] for r in one["results"]] == [1] and [r["processes"] for r in split["results"]] == [processes]
    assert _without_walls(split) == _without_walls(one)   # tokens, ITL, batches, link bytes, queue delays: every field
    # the queue-depth heatmap is drawn from every decision of every process, folded back in one process's order
    heat = [p.name for p in out1.iterdir() if p.suffix == ".png" and "queue" in p.name]
    assert heat and all((out / name).read_bytes() == (out1 / name).read_bytes() for name in heat)


def test_a_run_that_cannot_split_stays_in_one_process(tmp_path):
    # a slow rank scales batch costs: no shortest batch to size the windows by
    doc, _ = _simulate(tmp_path, 2, scenario="slow-rank")
    assert [r["processes"] for r in doc["results"]] == [1]


def test_blocks_are_whole_nodes():
    assert blocks(16, 2, 2) == [range(0, 8), range(8, 16)]
    assert blocks(20, 3, 4) == [range(0, 4), range(4, 12), range(12, 20)]   # 5 nodes of 4
    assert blocks(4, 8, 2) == [range(0, 2), range(2, 4)]                     # no more blocks than nodes


def test_the_link_model_in_two_halves_equals_it_whole():
    topo = Topology(2, 2e-6, 3600.0, 5e-6, 200.0)
    whole, halves = Network(topo, LinkSchedule(5e-6, 200.0, []), 8), Network(topo, LinkSchedule(5e-6, 200.0, []), 8)
    t = 0.0
    for i in range(200):   # many senders into few nodes: the receive ports queue
        src, dst, t = (i * 5) % 8, (i * 3 + 1) % 8, t + (i % 3) * 1e-7
        d = halves.depart(src, dst, 5760 * (1 + i % 4), t)
        got = halves.land(*d) - t if type(d) is tuple else d
        assert got == whole.delay(src, dst, 5760 * (1 + i % 4), t)


def _pair():
    """Partition 0 of two, with the pipes its peer would hold: (partition, peer's write end, peer's read end)."""
    pipes = {(0, 1): os.pipe(), (1, 0): os.pipe()}
    part = Partition(0, [range(0, 2), range(2, 4)], pipes, 1e-3, [])
    return part, pipes[(1, 0)][1], pipes[(0, 1)][0]


def test_a_peer_that_ends_without_a_word_fails_the_run_by_name():
    part, peer_w, peer_r = _pair()
    os.close(peer_w)
    with pytest.raises(RuntimeError, match="partition 1 ended without a word"):
        part.exchange({1: "hello"}, 0.5)
    os.close(peer_r)


def test_a_peer_that_failed_says_why():
    part, peer_w, peer_r = _pair()
    b = pickle.dumps(Failed("Traceback ...\nValueError: boom"))
    os.write(peer_w, struct.pack("<Q", len(b)) + b)
    with pytest.raises(RuntimeError, match="(?s)partition 1 failed:.*boom"):
        part.exchange({1: "hello"}, 0.5)
    os.close(peer_w)
    os.close(peer_r)


def test_a_process_that_fails_mid_run_fails_the_run_naming_it(tmp_path, monkeypatch):
    from runtime.core.engine import Engine
    complete, calls = Engine.complete, [0]

    def failing(self, batch):   # rank 15 is the second process's (16 ranks, 2 GPUs a node, 2 processes)
        if self.rank == 15:
            calls[0] += 1
            if calls[0] == 40:
                raise ValueError("boom in rank 15")
        return complete(self, batch)
    monkeypatch.setattr(Engine, "complete", failing)
    with pytest.raises(AssertionError) as err:
        _simulate(tmp_path, 2)
    assert "partition 1 failed" in str(err.value) and "boom in rank 15" in str(err.value)
