"""Scheduling policies on hand-built queue views: each rule, its tie-breaking, and its parameters."""
from __future__ import annotations

import pytest

from runtime.core.scheduler import HOLD, Aging, Defrag, FLFS, MTFS, StageView, make_policy, parse_policy

# chain attn0 -> exp0 -> attn1 -> exp1 -> sample -> attn0
NEXT = [1, 2, 3, 4, 0]


def views(depths, runnable=None, waits=None):
    runnable = runnable or [d > 0 for d in depths]
    waits = waits or [0.0] * len(depths)
    return [StageView(float(d), r, w) for d, r, w in zip(depths, runnable, waits)]


def test_nothing_runnable_is_none():
    for name in ("flfs", "mtfs", "defrag", "aging"):
        assert make_policy(name).choose(views([0, 0, 0, 0, 0]), NEXT) is None


def test_flfs_first_runnable_in_chain_order():
    assert FLFS().choose(views([0, 3, 9, 0, 1]), NEXT).stage == 1
    # a non-runnable (e.g. prefill chunk waiting for its predecessor) queue is skipped
    assert FLFS().choose(views([5, 3, 9, 0, 1], runnable=[False, True, True, False, True]), NEXT).stage == 1


def test_mtfs_deepest_ties_to_lowest_index():
    d = MTFS().choose(views([2, 7, 7, 0, 1]), NEXT)
    assert d.stage == 1 and d.scores == {0: 2.0, 1: 7.0, 2: 7.0, 4: 1.0}


def test_defrag_score_formula_and_history():
    p = Defrag(delta=0.5, lookahead=2, history=2)
    q1 = [1, 4, 0, 2, 0]
    d1 = p.choose(views(q1), NEXT)
    # no history yet: score(s) = Q(s) + 0.5 Q(s+1) + 0.25 Q(s+2)
    assert d1.scores == {0: 1 + 0.5 * 4 + 0.25 * 0, 1: 4 + 0.5 * 0 + 0.25 * 2, 3: 2 + 0 + 0.25 * 1}
    assert d1.stage == 1
    q2 = [0, 0, 6, 0, 3]
    d2 = p.choose(views(q2), NEXT)
    h = [(a + b) / 2 for a, b in zip(q1, q1)]  # history holds only q1 so far
    assert d2.scores[2] == pytest.approx(6 + 0.5 * (0 + h[3]) + 0.25 * (3 + h[4]))
    assert d2.scores[4] == pytest.approx(3 + 0.5 * (0 + h[0]) + 0.25 * (0 + h[1]))


def test_defrag_wraps_around_the_chain():
    p = Defrag(delta=0.8, lookahead=1, history=1)
    d = p.choose(views([10, 0, 0, 0, 1]), NEXT)
    assert d.scores[4] == pytest.approx(1 + 0.8 * 10)  # sample looks ahead into attn(0)


def test_defrag_ties_to_lowest_index():
    d = Defrag(lookahead=0).choose(views([0, 5, 0, 5, 0]), NEXT)
    assert d.stage == 1


def test_aging_overdue_stage_wins_outright():
    p = Aging(bound=0.01, urgent_fraction=0.5)
    v = views([1, 100, 0, 50, 0], waits=[0.006, 0.0001, 0, 0.001, 0])
    assert p.choose(v, NEXT).stage == 0  # waited 6 ms >= 5 ms: picked despite the tiny queue
    v = views([1, 100, 0, 50, 0], waits=[0.006, 0.0001, 0, 0.009, 0])
    assert p.choose(v, NEXT).stage == 3  # two overdue: the most overdue first


def test_aging_below_trigger_adds_a_growing_term():
    p, q = Aging(bound=1.0, aging_weight=10.0, urgent_fraction=1.0), Defrag()
    v = views([1, 0, 0, 3, 0], waits=[0.4, 0, 0, 0.0, 0])
    base = q.choose(v, NEXT).scores
    got = p.choose(v, NEXT).scores
    assert got[0] == pytest.approx(base[0] + 10.0 * 0.4) and got[3] == pytest.approx(base[3])


def test_parameters_are_exposed_and_validated():
    assert make_policy("aging", bound=0.2, delta=0.9).params() == {
        "bound": 0.2, "aging_weight": 64.0, "urgent_fraction": 0.5, "delta": 0.9, "lookahead": 4, "history": 4}
    assert make_policy("defrag").params() == {"delta": 0.8, "lookahead": 4, "history": 4}
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("fifo")
    with pytest.raises(ValueError, match="takes"):
        make_policy("mtfs", delta=0.5)
    with pytest.raises(ValueError):
        Defrag(delta=1.5)
    with pytest.raises(ValueError):
        Aging(bound=0)


def held(depths, incoming, waits=None):
    v = views(depths, waits=waits)
    for x, inc in zip(v, incoming):
        x.incoming = float(inc)
    return v


def test_wave_hold_runs_the_best_ready_stage_or_holds_until_the_first_bound():
    p = make_policy("mtfs:hold_fill=0.8,hold_us=1000")
    assert p.params() == {"hold_fill": 0.8, "hold_us": 1000.0}
    # stage 1 is deepest but holds 4 of a known wave of 10; stage 2 (3 of 3) is ready: it runs
    d = p.choose(held([0, 4, 3, 0, 0], [0, 6, 0, 0, 0]), NEXT)
    assert d.stage == 2
    # nothing ready: HOLD until the first bound expires (stage 1 waited 0.7 ms, stage 2 0.2 ms)
    d = p.choose(held([0, 4, 1, 0, 0], [0, 6, 9, 0, 0], waits=[0, 7e-4, 2e-4, 0, 0]), NEXT)
    assert d.stage == HOLD and d.hold_s == pytest.approx(3e-4)
    assert p.choose(held([0, 4, 0, 0, 0], [0, 6, 0, 0, 0], waits=[0, 1e-3 - 1e-12, 0, 0, 0]), NEXT).hold_s == 1e-6
    # the bound reached: the deepest runs although its wave is incomplete
    assert p.choose(held([0, 4, 1, 0, 0], [0, 6, 9, 0, 0], waits=[0, 1e-3, 0, 0, 0]), NEXT).stage == 1
    # enough of the wave here (8 of 10): runs
    assert p.choose(held([0, 8, 1, 0, 0], [0, 2, 9, 0, 0]), NEXT).stage == 1
    # off by default: incoming is ignored
    assert make_policy("mtfs").choose(held([0, 4, 1, 0, 0], [0, 6, 9, 0, 0]), NEXT).stage == 1


def test_wave_hold_bound_follows_the_measured_token_step():
    """hold_step: the bound is that fraction of the moving average of the step the engine reports;
    hold_us until the first report."""
    p = make_policy("defrag:hold_fill=1,hold_us=2000,hold_step=0.5")
    assert p.params()["hold_step"] == 0.5 and p.hold_bound_s() == pytest.approx(2e-3)
    p.observe_step(0.100)
    assert p.hold_bound_s() == pytest.approx(0.050)
    p.observe_step(0.200)  # moving average: 0.9 x 100 ms + 0.1 x 200 ms
    assert p.hold_bound_s() == pytest.approx(0.5 * 0.110)
    # a stage whose oldest item waited 40 ms is still held under a 55 ms bound, released past it
    assert p.choose(held([0, 4, 0, 0, 0], [0, 6, 0, 0, 0], waits=[0, 0.040, 0, 0, 0]), NEXT).stage == HOLD
    assert p.choose(held([0, 4, 0, 0, 0], [0, 6, 0, 0, 0], waits=[0, 0.0551, 0, 0, 0]), NEXT).stage == 1
    # without hold_step the reports change nothing
    q = make_policy("mtfs:hold_fill=1,hold_us=1000")
    q.observe_step(1.0)
    assert q.hold_bound_s() == pytest.approx(1e-3) and "hold_step" not in q.params()


def test_wave_hold_keeps_each_policy_order_and_aging_overdue_rule():
    # FLFS with hold: candidates in chain order, the first ready one runs
    assert make_policy("flfs:hold_fill=0.9").choose(held([2, 3, 0, 0, 1], [5, 0, 0, 0, 0]), NEXT).stage == 1
    # aging: an overdue stage runs even while its wave is held
    a = make_policy("aging", bound=0.01, hold_fill=1.0, hold_us=50_000)
    assert a.choose(held([1, 0, 0, 0, 3], [9, 0, 0, 0, 9], waits=[0.006, 0, 0, 0, 0.001]), NEXT).stage == 0


def test_policy_strings_parse_and_fail_clearly():
    assert parse_policy("defrag:hold_fill=0.9, hold_us=3000") == ("defrag", {"hold_fill": 0.9, "hold_us": 3000.0})
    assert make_policy("defrag:lookahead=3").params()["lookahead"] == 3
    assert parse_policy("mtfs:hold_fill=1;hold_us=500") == ("mtfs", {"hold_fill": 1.0, "hold_us": 500.0})
    with pytest.raises(ValueError, match="KEY=NUMBER"):
        parse_policy("defrag:hold_fill")
    with pytest.raises(ValueError, match="KEY=NUMBER"):
        parse_policy("defrag:hold_fill=lots")
    with pytest.raises(ValueError, match="hold_fill"):
        make_policy("defrag:hold_fill=2")
    assert make_policy("defrag:hold_fill=1,hold_ahead=1").params()["hold_ahead"] == 1
    assert make_policy("aging:hold_ahead=1").hold_ahead == 0  # no hold, nothing to announce for
    with pytest.raises(ValueError, match="hold_ahead"):
        make_policy("mtfs:hold_fill=1,hold_ahead=2")


def test_defrag_scores_the_same_bits_in_python_and_in_the_kernel(monkeypatch):
    """A few runnable stages are scored in Python, more by the compiled kernel (scheduler._PY_CANDIDATES): the same
    operations in the same order, so every score and every history step is bit-identical between the two."""
    import random

    from runtime.core import scheduler
    rng = random.Random(3)
    n = 13
    chain = [(i + 1) % n for i in range(n)]
    py = Defrag(delta=0.7, lookahead=3, history=3, history_weight=0.9)
    kernel = Defrag(delta=0.7, lookahead=3, history=3, history_weight=0.9)
    for step in range(60):
        vs = [StageView(rng.choice([0.0, rng.random() * 300, rng.randrange(50) / 3]), rng.random() < 0.3, 0.0)
              for _ in range(n)]
        a = py.scores(vs, chain)
        monkeypatch.setattr(scheduler, "_PY_CANDIDATES", -1)
        b = kernel.scores(vs, chain)
        monkeypatch.setattr(scheduler, "_PY_CANDIDATES", n)
        assert a == b, step
