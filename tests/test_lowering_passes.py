"""The lowering pipeline over the dataflow graph (issue 33): its pass list, `--dump-after`, expert replicas and
disaggregated attention ranks on the compile side, and their checks on a plan read back from disk."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from dataflow import cli
from graph_ir.errors import UserError
from graph_ir.graph import LayerID
from graph_ir.spec import load_spec
from lowering import sizes
from lowering.pipeline import PASS_NAMES
from lowering.plan import compile_plan, load_plan, save_plan

SPECS = Path(__file__).resolve().parents[1] / "models" / "specs"


def spec(name="tiny-deepseek-v2"):  # layer 0 dense, 10 experts top-2 in layers 1-2
    return load_spec(SPECS / f"{name}.yaml")


def run(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "argv", ["dataflow", *args])
    monkeypatch.setenv("COLUMNS", "200")
    try:
        cli.main()
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def test_the_pipeline_runs_its_passes_in_order():
    assert PASS_NAMES == ["placement", "replicas", "stages", "queues", "capture", "routes", "memory"]


@pytest.mark.parametrize("name, needle", [
    ("placement", "E9@3"), ("replicas", "E0@0,1"), ("stages", '"kind":"sample"'), ("queues", '"queues":'),
    ("capture", '"buckets":'), ("routes", '"kind":"dispatch"'), ("memory", '"block_size":16')])
def test_dump_after_each_pass(tmp_path, monkeypatch, capsys, name, needle):
    code, out, err = run(monkeypatch, capsys, "compile", "tiny-deepseek-v2", "--ranks", "4", "--replicas", "1",
                         "-o", str(tmp_path / "p"), "--dump-after", name)
    assert code == 0, err
    dump = out.split(f"--- after {name}\n", 1)[1]
    assert needle in dump.split("\n--- ")[0].split("tiny-deepseek-v2 (")[0]
    assert len(dump.split("tiny-deepseek-v2 (")[0].splitlines()) <= 14  # short: a dozen lines at most


def test_dump_after_a_bad_pass_is_a_usage_error(tmp_path, monkeypatch, capsys):
    code, _, err = run(monkeypatch, capsys, "compile", "tiny", "--dump-after", "routing", "-o", str(tmp_path))
    assert code == 2 and "Traceback" not in err
    assert "option 'dump_after': got 'routing'; valid: placement, replicas, stages, queues" in err


def test_replicas_go_to_the_hottest_experts_on_the_least_loaded_ranks():
    s = spec()
    plan = compile_plan(s, 4, replicas=3, load_profile=[9, 1, 1, 1, 1, 1, 1, 1, 1, 5])
    p = plan.placement
    assert p.replicas[0] == []  # dense
    for layer in (1, 2):
        reps = p.replicas[layer]
        assert sum(map(len, reps)) == 3
        # expert 0 (load 9) gets copies until 9 / copies falls below expert 9's 5, then expert 9 gets one
        assert len(reps[0]) == 2 and len(reps[9]) == 1
        for e, copies in enumerate(reps):
            assert p.expert_rank[layer][e] not in copies and len(set(copies)) == len(copies)
        # queues, routes and memory all see the copies
        stage = next(st for st in plan.stages if st.kind == "expert" and st.layer == layer)
        for r in reps[0]:
            assert 0 in plan.ranks[r].queues[stage.id].experts
        dispatch = next(rt for rt in plan.routes if rt.src_stage == stage.id - 1)
        assert dispatch.dst_ranks == p.holders(layer)
    one = sizes.expert_params(s) * sizes.dtype_bytes(s)
    base = compile_plan(s, 4)
    for m, b in zip(plan.memory, base.memory):
        extra = sum(len(p.experts_on(l, m.rank)) - len(base.placement.experts_on(l, m.rank)) for l in (1, 2))
        assert m.expert_weight_bytes - b.expert_weight_bytes == extra * one
    assert sum(m.expert_weight_bytes for m in plan.memory) - sum(b.expert_weight_bytes for b in base.memory) == 6 * one


def test_replicas_without_a_profile_spread_over_the_owners_and_ranks_and_can_fill_every_rank():
    # 10 experts on 4 ranks (contiguous: 3, 2, 3, 2): the owners' first experts get the first copies
    p = compile_plan(spec(), 4, replicas=2).placement
    assert [len(c) for c in p.replicas[1]] == [1, 0, 0, 1] + [0] * 6
    even = compile_plan(spec(), 4, replicas=10).placement  # 20 copies in all: 5 experts per rank
    assert sorted(len(even.experts_on(1, r)) for r in range(4)) == [5, 5, 5, 5]
    full = compile_plan(spec(), 4, replicas=30).placement  # 10 experts x (4 - 1): every rank holds every expert
    assert all(full.experts_on(1, r) == list(range(10)) for r in range(4))


def test_replicas_auto_follows_the_load():
    assert compile_plan(spec(), 4, replicas="auto").placement.replicas == [[], [[]] * 10, [[]] * 10]  # uniform
    p = compile_plan(spec(), 4, replicas="auto", load_profile=[6] + [1] * 9).placement  # mean 1.5: 6 -> 3 copies
    assert [len(c) for c in p.replicas[1]] == [3] + [0] * 9


@pytest.mark.parametrize("kwargs, match", [
    (dict(replicas=-1), r"option 'replicas': got -1; valid: auto or an integer 0\.\.30"),
    (dict(replicas=31), r"got 31; valid: auto or an integer 0\.\.30"),
    (dict(replicas="many"), "got 'many'"),
    (dict(replicas=True), "got True"),
    (dict(replicas=11, attention_ranks=2), r"got 11; valid: auto or an integer 0\.\.10"),  # 2 expert ranks: 10 x 1
    (dict(attention_ranks=0), r"option 'attention_ranks': got 0; valid: an integer 1\.\.3"),
    (dict(attention_ranks=4), "got 4; valid: an integer 1..3"),
    (dict(replicas=1, device="cuda"), "--dispatch host"),
    (dict(load_profile=[1] * 10), "only used with placement 'profile' or --replicas"),
])
def test_bad_replica_and_attention_options(kwargs, match):
    with pytest.raises(UserError, match=match):
        compile_plan(spec(), 4, **kwargs)


def test_replicas_that_do_not_fit_are_refused_in_one_line():
    s = load_spec(SPECS / "mixtral-8x7b.yaml")
    assert compile_plan(s, 8, device="cuda", device_memory_gib=24, dispatch="host")
    with pytest.raises(UserError, match=r"does not fit 8 x cuda .* or fewer --replicas\.$"):
        compile_plan(s, 8, device="cuda", device_memory_gib=24, dispatch="host", replicas=8)


def test_attention_ranks_home_requests_and_leave_the_experts_to_the_others(tmp_path, monkeypatch, capsys):
    plan = compile_plan(spec(), 4, attention_ranks=1, replicas=2)
    p = plan.placement
    assert p.attention_ranks == [0] and p.homes(4) == [0]
    for layer in (1, 2):
        assert set(p.expert_rank[layer]) == {1, 2, 3} and all(0 not in c for c in p.replicas[layer])
    dispatch = next(r for r in plan.routes if r.kind == "dispatch")
    assert dispatch.src_ranks == [0] and 0 not in dispatch.dst_ranks
    assert all(m.kv_blocks > 0 for m in plan.memory)  # every rank still budgets a KV pool (the runtime's today)
    code, out, err = run(monkeypatch, capsys, "compile", "tiny-deepseek-v2", "--ranks", "4", "--attention-ranks", "1",
                         "--dump-after", "placement", "-o", str(tmp_path / "p"))
    assert code == 0 and "and sample on ranks 0\n" in out and "attention on ranks 0" in out, err
    assert "attention on ranks 0" in (tmp_path / "p" / "plan.txt").read_text()


def test_a_plan_with_replicas_round_trips_and_a_bad_replica_is_refused(tmp_path):
    plan = compile_plan(spec(), 4, replicas=3, attention_ranks=1)
    path = save_plan(plan, tmp_path / "p")
    assert load_plan(tmp_path / "p") == plan
    assert "replicas" not in json.loads(save_plan(compile_plan(spec(), 4), tmp_path / "q").read_text())["placement"]
    data = json.loads(path.read_text())
    owner = data["placement"]["expert_rank"][1][0]
    for bad, field in ((owner, "placement.replicas[1][0]"), (9, "placement.replicas[1][0]")):
        edited = json.loads(path.read_text())
        edited["placement"]["replicas"][1][0] = [bad]
        path.write_text(json.dumps(edited))
        with pytest.raises(UserError, match=re.escape(f"plan.json: field '{field}': got [{bad}]; valid: distinct ranks "
                                                      f"0..3 other than the owner {owner}")):
            load_plan(tmp_path / "p")
    edited = json.loads(json.dumps(data))
    edited["placement"]["replicas"][0] = [[1]]  # dense layer 0
    path.write_text(json.dumps(edited))
    with pytest.raises(UserError, match=r"field 'placement.replicas\[0\]'.*a dense layer has no experts"):
        load_plan(tmp_path / "p")
    edited = json.loads(json.dumps(data))
    edited["placement"]["attention_ranks"] = [0, 0]
    path.write_text(json.dumps(edited))
    with pytest.raises(UserError, match=r"field 'placement.attention_ranks'"):
        load_plan(tmp_path / "p")


def test_inspect_draws_the_graph_after_placement(tmp_path, monkeypatch, capsys):
    save_plan(compile_plan(spec(), 4, replicas=1), tmp_path / "p")
    code, _, err = run(monkeypatch, capsys, "inspect", str(tmp_path / "p"), "--dot", str(tmp_path / "g.dot"),
                       "--rank", "1")
    dot = (tmp_path / "g.dot").read_text()
    assert code == 0 and "E0 L1 h1\\n@rank 0,1" in dot and "cluster_home1" in dot, err
    from graph_ir.graph import build_graph
    from dataflow import cmd_inspect
    monkeypatch.setattr(cmd_inspect, "MAX_DOT_NODES", 10)  # too many for every home: the compact graph instead
    assert cmd_inspect.write_dot(load_plan(tmp_path / "p"), tmp_path / "c.dot", None) == \
        build_graph(spec()).number_of_nodes()
    assert "cluster_homes" in (tmp_path / "c.dot").read_text()
    assert LayerID(1, -1, 0) == LayerID(1, expert=0)
