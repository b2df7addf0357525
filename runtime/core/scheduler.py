"""Scheduling policies: which mu-queue a rank runs next.

Every policy sees the same per-stage view (depth in tokens, whether an item is runnable, how long the
oldest item has waited) and returns a `Decision` with the score of every runnable candidate, so a
trace shows why it chose what it chose. Policies are small objects, one per rank (the defragmenting
ones keep a depth history), and can be swapped between decisions (`Engine.set_policy`).

- flfs    first layer first: the first runnable stage in chain order.
- mtfs    most tokens first: the deepest runnable queue.
- defrag  score(s) = Q(s) + sum_{j=1..W} delta^j (Q(s_j) + H(s_j)), s_j the j-th stage after s on
          the wrapping chain, H the mean of the last `history` depth snapshots.
- aging   defrag + `aging_weight` * wait(s) / bound, and a hard rule: a stage whose oldest item has
          waited `urgent_fraction * bound` or longer wins outright (the most overdue first). With the
          hard rule an overdue item is served within one batch per other overdue stage, so as long
          as the rank is not overloaded past that, no item waits longer than `bound`; defrag alone
          has no such bound (the paper only argues forward progress).
Ties go to the lowest stage index in every policy, so decisions are deterministic.

Wave hold (every policy, off by default: `hold_fill` > 0 turns it on). The engine tells each stage how
many tokens are on their way to it soon (`StageView.incoming`: a home's tokens in open merges of the
layer before, an owner's rows announced by the homes that dispatched the rest of their wave). A stage
is *ready* when it holds at least `hold_fill` of its known wave (depth >= hold_fill * (depth +
incoming)), nothing is announced, or its oldest item has waited `hold_us`. The policy's candidates
are tried best score first and the first ready one runs; when none is, the decision is HOLD and the
rank waits (for a message, or until the first bound expires) instead of running a fragment. Why: a
work-conserving rank runs whatever arrived the moment it looks, so with per-batch host costs of
0.2-1.5 ms the waves of four homes break into batches of a few rows (5 rows per expert batch on 4
CPU processes where the barrier runs 46; benchmarks/results/cpu_bench.md). The bound keeps every
item's extra wait <= hold_us, and a policy string can carry the parameters: "defrag:hold_fill=0.9,hold_us=3000".
`hold_step` > 0 makes the bound adaptive: that fraction of the rank's measured token step
("defrag:hold_fill=1,hold_step=0.5"; hold_us is the bound until the first step is measured).
`hold_ahead=1` also announces each home's wave one layer ahead: with its dispatch to expert(l) a home
tells every owner the rows the same tokens will bring to expert(l+1), so an owner holds the wave of one
home at expert(l+1) for another home's wave that is on its way. Two homes' waves that reach a layer at
different times then merge into one expert batch instead of running one each (on 2 x H200 at C=256 an
expert stage ran ~1.8 batches per layer-step: one per home). The announcement is an estimate (this layer's
rows per owner): an owner that the same tokens' rows at l+1 then skip is told so (expert_dispatch.MSG_NONE); else it
held every batch of that stage to the bound until the home sent it rows of l+1 again (benchmarks/NOTES.md §38).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from runtime.core.score_kernel import defrag_scores, warm_up


@dataclass(slots=True)
class StageView:
    depth: float  # Q(s), tokens
    runnable: bool  # at least one item can be batched now
    wait: float  # seconds the oldest queued item has waited (0 when empty)
    incoming: float = 0.0  # tokens known to be on their way to this stage soon (wave hold)


class StageViews(list):
    """The engine's views (a StageView per stage) with what it knew while making them: `depths` (every stage's depth,
    a list nothing writes to: the defragmenting policies keep it as their snapshot), `runnable` (the runnable stage
    ids, ascending) and `active` (the non-empty ones, ascending), so a policy does not rebuild them from ~73 views per
    decision."""
    __slots__ = ("depths", "runnable", "active")


HOLD = -1  # Decision.stage when every candidate is held: run nothing for up to `hold_s`
# Up to this many runnable stages (the usual case: one or two) the defragmenting score is computed in Python, only for
# them; more go to the compiled kernel, which scores the whole chain. Same float operations in the same order either
# way, so the same bits. The kernel's call with its arrays costs ~5 us here and 22-28 us on the H200 hosts,
# a stage's score in Python ~1 us here.
_PY_CANDIDATES = 4
_HOLD_RESOLUTION_S = 1e-6


@dataclass(slots=True)
class Decision:
    stage: int
    scores: dict[int, float]  # runnable stage -> score
    hold_s: float = 0.0  # stage == HOLD: seconds until the first held stage's bound expires


def _best(scores: dict[int, float]) -> int:
    # max score, ties to the lowest stage index
    return next(iter(scores)) if len(scores) == 1 else min(scores, key=lambda s: (-scores[s], s))


class Policy:
    """What every policy shares: the wave hold (module docstring). Subclasses score the runnable
    stages and call `_decide`. The engine reads hold_fill, hold_step and hold_ahead and calls observe_step and
    repeat_idle on every policy: a policy object that is not a subclass must have them too."""

    name = "?"
    hold_fill, hold_us, hold_step, hold_ahead = 0.0, 2000.0, 0.0, 0  # (the wave hold off, as __init__'s defaults)

    def __init__(self, hold_fill: float = 0.0, hold_us: float = 2000.0, hold_step: float = 0.0,
                 hold_ahead: int = 0) -> None:
        if not 0 <= hold_fill <= 1 or hold_us < 0 or hold_step < 0 or hold_ahead not in (0, 1):
            raise ValueError(f"{self.name} needs 0 <= hold_fill <= 1, hold_us >= 0, hold_step >= 0 and hold_ahead "
                             f"0 or 1; got hold_fill={hold_fill}, hold_us={hold_us}, hold_step={hold_step}, "
                             f"hold_ahead={hold_ahead}")
        self.hold_fill, self.hold_us, self.hold_step = hold_fill, hold_us, hold_step
        self.hold_ahead = int(hold_ahead) if hold_fill > 0 else 0  # announcements only matter to a hold
        self._step_s: Optional[float] = None  # moving average of this rank's token step (observe_step)

    def params(self) -> dict:
        if self.hold_fill <= 0:
            return {}
        return {"hold_fill": self.hold_fill, "hold_us": self.hold_us,
                **({"hold_step": self.hold_step} if self.hold_step > 0 else {}),
                **({"hold_ahead": self.hold_ahead} if self.hold_ahead else {})}

    def observe_step(self, step_s: float) -> None:
        """The engine reports the mean time between consecutive tokens of the requests it just sampled.
        With hold_step > 0 the hold's bound is hold_step x its moving average (hold_us until the first
        report): a wave takes a fraction of a token step to come together, and that step is ~60 ms on
        4 CPU processes, ~40-80 ms on the H200s at C=256 and a few ms in the simulator with H200 costs,
        where the best fixed bounds were 40 ms, 30 ms and ~1 ms."""
        self._step_s = step_s if self._step_s is None else 0.9 * self._step_s + 0.1 * step_s

    def repeat_idle(self) -> None:
        """The engine skipped a decision that would find nothing runnable again on an unchanged state (Engine.next_batch);
        a policy whose state advances per decision does that advance here, so skipping it changes no later decision."""

    def hold_bound_s(self) -> float:
        if self.hold_step > 0 and self._step_s is not None:
            return self.hold_step * self._step_s
        return self.hold_us * 1e-6

    def _decide(self, scores: dict[int, float], views: list[StageView]) -> Optional[Decision]:
        """The best-scoring ready candidate, or HOLD."""
        if not scores:
            return None
        if self.hold_fill <= 0:
            return Decision(_best(scores), scores)
        # A HOLD lasts >= 1 us: a shorter one can vanish in the float rounding of a virtual clock's
        # now + hold_s, and the clock would never reach the bound.
        bound = self.hold_bound_s()
        order = sorted(scores, key=lambda s: (-scores[s], s))
        for s in order:
            v = views[s]
            if v.incoming <= 0 or v.depth >= self.hold_fill * (v.depth + v.incoming) or v.wait >= bound:
                return Decision(s, scores)
        return Decision(HOLD, scores, max(_HOLD_RESOLUTION_S, min(bound - views[s].wait for s in order)))


class FLFS(Policy):
    name = "flfs"

    def choose(self, views: list[StageView], next_of: list[int]) -> Optional[Decision]:
        if self.hold_fill > 0:  # every runnable stage is a candidate, in chain order
            n = len(views)
            return self._decide({s: float(n - s) for s, v in enumerate(views) if v.runnable}, views)
        for s, v in enumerate(views):
            if v.runnable:
                return Decision(s, {s: 1.0})
        return None


class MTFS(Policy):
    name = "mtfs"

    def choose(self, views: list[StageView], next_of: list[int]) -> Optional[Decision]:
        return self._decide({s: v.depth for s, v in enumerate(views) if v.runnable}, views)


class Defrag(Policy):
    name = "defrag"

    def __init__(self, delta: float = 0.8, lookahead: int = 4, history: int = 4,
                 history_weight: float = 1.0, hold_fill: float = 0.0, hold_us: float = 2000.0,
                 hold_step: float = 0.0, hold_ahead: int = 0) -> None:
        super().__init__(hold_fill, hold_us, hold_step, hold_ahead)
        if not 0 <= delta <= 1 or lookahead < 0 or history < 1 or history_weight < 0:
            raise ValueError(f"defrag needs 0 <= delta <= 1, lookahead >= 0, history >= 1, history_weight >= 0; "
                             f"got delta={delta}, lookahead={lookahead}, history={history}, "
                             f"history_weight={history_weight}")
        self.delta, self.lookahead, self.history = delta, lookahead, history
        # Weight of H in the score: 1 is the paper's. With Q(e) ~ H(e) the stage in front of a steady
        # queue always outscores it (1 + 2 delta X > X); 0 drops H (benchmarks/results/cpu_bench.md).
        self.history_weight = history_weight
        warm_up()  # the kernel's one-time load happens here, before any run's clock starts
        self._ring: Optional[list[list[float]]] = None  # [history][stages] last queue-depth snapshots
        self._filled = self._next_slot = self._idle = 0  # _idle: skipped decisions since the last snapshot (repeat_idle)
        self._next_of_src: Optional[list[int]] = None
        self._next_of: Optional[np.ndarray] = None

    def params(self) -> dict:
        out = {"delta": self.delta, "lookahead": self.lookahead, "history": self.history}
        if self.history_weight != 1.0:
            out["history_weight"] = self.history_weight
        return {**out, **super().params()}

    def scores(self, views: list[StageView], next_of: list[int]) -> dict[int, float]:
        n = len(views)
        q, cand = (views.depths, views.runnable) if type(views) is StageViews else \
            ([v.depth for v in views], [s for s, v in enumerate(views) if v.runnable])
        if self._ring is None or len(self._ring[0]) != n:
            self._ring = [[0.0] * n for _ in range(self.history)]
            self._filled, self._next_slot = 0, 0
        # The mean over the ring does not depend on the snapshots' order, so a ring buffer serves.
        if len(cand) <= _PY_CANDIDATES:  # score_kernel.defrag_scores's operations in its order (H: the mean of the
            # filled snapshots, summed in slot order), inline: no call per candidate
            out, filled, delta, hw = {}, self._filled, self.delta, self.history_weight
            snapshots = self._ring[:filled]
            for s in cand:
                score, t, w = q[s], s, 1.0
                for _ in range(self.lookahead):
                    t = next_of[t]
                    w *= delta
                    acc = 0.0
                    for snap in snapshots:
                        acc += snap[t]
                    score += w * (q[t] + hw * (acc / filled if filled else 0.0))
                out[s] = score
        else:
            if self._next_of_src is not next_of:  # the engine passes one list for its whole life
                self._next_of_src, self._next_of = next_of, np.asarray(next_of, dtype=np.int64)
            runnable = np.zeros(n, dtype=np.bool_)
            runnable[cand] = True
            scored = np.empty(n)
            defrag_scores(np.array(q, dtype=np.float64), np.array(self._ring, dtype=np.float64), self._filled,
                          runnable, self._next_of, self.delta, self.lookahead, self.history_weight, scored)
            out = dict(zip(cand, scored[cand].tolist()))
        # H is the *recent past*: snapshot after scoring so the current depth is not counted twice.
        self._ring[self._next_slot] = q
        self._next_slot = (self._next_slot + 1) % self.history
        self._filled, self._idle = min(self._filled + 1, self.history), 0
        return out

    def choose(self, views: list[StageView], next_of: list[int]) -> Optional[Decision]:
        scores = self.scores(views, next_of)  # (without a hold: _decide's first answer, one call fewer)
        return Decision(_best(scores), scores) if scores and self.hold_fill <= 0 else self._decide(scores, views)

    def repeat_idle(self, n: int = 1) -> None:
        """The snapshots `n` skipped decisions would have taken: the depths are those of the last one (no queue
        changed). After `history` of them every slot holds that one, so more only turn the slot."""
        if self._ring is None or not self._filled:
            return
        h = self.history
        if self._idle < h:  # (after h of them every slot holds the last snapshot: nothing more to copy)
            last = self._ring[(self._next_slot - 1) % h]
            for i in range(min(n, h)):
                self._ring[(self._next_slot + i) % h] = last
            self._idle += n
        self._next_slot, self._filled = (self._next_slot + n) % h, min(self._filled + n, h)


class Aging(Defrag):
    name = "aging"

    def __init__(self, bound: float = 0.05, aging_weight: float = 64.0, urgent_fraction: float = 0.5,
                 delta: float = 0.8, lookahead: int = 4, history: int = 4, history_weight: float = 1.0,
                 hold_fill: float = 0.0, hold_us: float = 2000.0, hold_step: float = 0.0,
                 hold_ahead: int = 0) -> None:
        super().__init__(delta, lookahead, history, history_weight, hold_fill, hold_us, hold_step, hold_ahead)
        if bound <= 0 or aging_weight < 0 or not 0 < urgent_fraction <= 1:
            raise ValueError(f"aging needs bound > 0, aging_weight >= 0, 0 < urgent_fraction <= 1; got "
                             f"bound={bound}, aging_weight={aging_weight}, urgent_fraction={urgent_fraction}")
        self.bound, self.aging_weight, self.urgent_fraction = bound, aging_weight, urgent_fraction

    def params(self) -> dict:
        return {"bound": self.bound, "aging_weight": self.aging_weight, "urgent_fraction": self.urgent_fraction,
                **super().params()}

    def choose(self, views: list[StageView], next_of: list[int]) -> Optional[Decision]:
        scores = self.scores(views, next_of)
        if not scores:
            return None
        urgent = {s: views[s].wait for s in scores if views[s].wait >= self.urgent_fraction * self.bound}
        for s in scores:
            scores[s] += self.aging_weight * views[s].wait / self.bound
        if urgent:  # overdue beats everything, hold included
            return Decision(_best(urgent), scores)
        return self._decide(scores, views)


POLICIES = {"flfs": FLFS, "mtfs": MTFS, "defrag": Defrag, "aging": Aging}


def parse_policy(text: str) -> tuple[str, dict]:
    """"defrag" or "defrag:hold_fill=0.9,hold_us=3000" -> (name, params); values are numbers. ";" also
    separates parameters (for comma-separated lists of policies or systems on a command line)."""
    name, _, rest = text.partition(":")
    params = {}
    for part in filter(None, (p.strip() for p in rest.replace(";", ",").split(","))):
        key, eq, value = part.partition("=")
        try:
            params[key.strip()] = float(value)
        except ValueError:
            raise ValueError(f"policy {text!r}: parameters are KEY=NUMBER, got {part!r}") from None
        if not eq:
            raise ValueError(f"policy {text!r}: parameters are KEY=NUMBER, got {part!r}")
    return name.strip(), params


def make_policy(name: str, **params):
    """A fresh policy object from a name or a "name:key=value,..." string (parse_policy); unknown names
    or parameters raise ValueError naming the valid ones."""
    name, inline = parse_policy(name)
    params = {**inline, **params}
    for key in ("lookahead", "history", "hold_ahead"):  # integers in the policy, numbers in a policy string
        if isinstance(params.get(key), float) and params[key].is_integer():
            params[key] = int(params[key])
    cls = POLICIES.get(name)
    if cls is None:
        raise ValueError(f"unknown policy {name!r}; valid: {', '.join(POLICIES)}")
    try:
        return cls(**params)
    except TypeError:
        import inspect
        valid = [p for p in inspect.signature(cls).parameters]
        raise ValueError(f"policy {name!r} takes {', '.join(valid) or 'no parameters'}; got {', '.join(params)}") from None
