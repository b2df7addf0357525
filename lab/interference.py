"""Stragglers on demand: per-link delay/bandwidth schedules and slow-rank compute multipliers.

A comparison between barrier-free and barrier EP is only fair if both suffer the same disturbance.
So every schedule here is a pure function of (configuration, seed, link, time): two systems that send
the same bytes over the same link at the same time see the same delay, whatever else they do, and a
rerun with the same seed is identical. The transports (in-process delay injection, the virtual-clock
network) and the executors ask these objects; nothing here keeps state that a call mutates.

Link model, per message of `nbytes` from `src` to `dst` sent at time `t`:

    delay = latency + extra(t) + nbytes / min(bandwidth, caps(t)) + jitter(t)

where `extra` and `caps` come from on/off bursts and bandwidth traces that cover the link, and
`jitter` is lognormal noise that is constant within a short window (network noise is correlated in
time, and a window makes it the same for every system that sends in it). Messages to self cost 0.

Compute model: a batch that takes `d` seconds on a healthy rank takes `d * compute_scale(rank, t)`.
"""
from __future__ import annotations

import csv
import hashlib
import math
from bisect import bisect_right
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional, Sequence

from graph_ir.errors import UserError

ANY = -1  # wildcard rank in link selectors and traces ("*" in files)


def _covers(links: Optional[frozenset[tuple[int, int]]], src: int, dst: int) -> bool:
    if links is None:
        return True
    # some (s, d) with s in (ANY, src) and d in (ANY, dst): four lookups, not a scan of every pair (a scan per
    # message was 3% of a 256-rank simulation's host time, session 24)
    return (src, dst) in links or (ANY, dst) in links or (src, ANY) in links or (ANY, ANY) in links


def _links(spec: Optional[Iterable[Sequence[int]]]) -> Optional[frozenset[tuple[int, int]]]:
    if spec is None:
        return None
    out = frozenset((int(s), int(d)) for s, d in spec)
    if not out:
        raise UserError("a link selector must name at least one (src, dst) pair; omit it to mean every link")
    return out


@dataclass(frozen=True)
class Bursts:
    """On/off interference: during the first `duty` fraction of every `period` seconds (shifted by
    `phase`), the covered links get `extra_delay_s` more latency and at most `bandwidth_gbps`."""

    period_s: float
    duty: float
    extra_delay_s: float = 0.0
    bandwidth_gbps: Optional[float] = None
    phase_s: float = 0.0
    links: Optional[frozenset[tuple[int, int]]] = None   # None = every link; (src, dst), -1 = any
    # How the barrier baselines' ring collectives meet it. "hops": every ring message pays it, as on a delayed link.
    # "stall": a rank entering a dispatch all-gather or an all-reduce while a covered link of its own is in a burst
    # first waits `extra_delay_s` once, the step's count exchange and the rings' messages not at all: how
    # benchmarks/gpu_ep_bench.py emulates bursts for them (lab/dist_scenarios.py BurstDelays.collective), to replay
    # its recorded runs (benchmarks/results/sim_validation.md, session 25). Streaming's messages pay it either way.
    collectives: str = "hops"

    def __post_init__(self) -> None:
        if not self.period_s > 0:
            raise UserError(f"burst period must be > 0 s, got {self.period_s}")
        if not 0.0 <= self.duty <= 1.0:
            raise UserError(f"burst duty must be a fraction in [0, 1], got {self.duty}")
        if self.extra_delay_s < 0:
            raise UserError(f"burst extra delay must be >= 0 s, got {self.extra_delay_s}")
        if self.bandwidth_gbps is not None and not self.bandwidth_gbps > 0:
            raise UserError(f"burst bandwidth cap must be > 0 Gbit/s, got {self.bandwidth_gbps}")
        if self.collectives not in ("hops", "stall"):
            raise UserError(f"burst collectives must be hops or stall, got {self.collectives!r}")

    def active(self, t: float) -> bool:
        return ((t - self.phase_s) % self.period_s) < self.duty * self.period_s

    def effect(self, src: int, dst: int, t: float) -> tuple[float, Optional[float]]:
        if not _covers(self.links, src, dst) or not self.active(t):
            return 0.0, None
        return self.extra_delay_s, self.bandwidth_gbps


def _unit(seed: int, *key: float) -> float:
    """A uniform number in (0, 1) that is a pure function of (seed, key)."""
    h = hashlib.blake2b(repr((seed,) + key).encode(), digest_size=8).digest()
    return (int.from_bytes(h, "little") + 0.5) / 2.0**64


@dataclass(frozen=True)
class LognormalJitter:
    """Extra delay exp(N(log median, sigma^2)), redrawn every `window_s` seconds per link."""

    median_s: float
    sigma: float
    seed: int = 0
    window_s: float = 1e-3
    links: Optional[frozenset[tuple[int, int]]] = None

    def __post_init__(self) -> None:
        if self.median_s < 0 or self.sigma < 0 or not self.window_s > 0:
            raise UserError("jitter needs median_s >= 0, sigma >= 0 and window_s > 0 "
                            f"(got {self.median_s}, {self.sigma}, {self.window_s})")

    def effect(self, src: int, dst: int, t: float) -> tuple[float, Optional[float]]:
        if self.median_s == 0 or not _covers(self.links, src, dst):
            return 0.0, None
        u = _unit(self.seed, src, dst, math.floor(t / self.window_s))
        z = math.sqrt(2.0) * _erfinv(2.0 * u - 1.0)
        return self.median_s * math.exp(self.sigma * z), None


def _erfinv(y: float) -> float:
    # Inverse error function by Newton on math.erf, from Giles' single-precision start; the stdlib
    # has erf but no inverse, and scipy is not a dependency.
    w = -math.log((1.0 - y) * (1.0 + y))
    if w < 5.0:
        w -= 2.5
        p = 2.81022636e-08
        for c in (3.43273939e-07, -3.5233877e-06, -4.39150654e-06, 0.00021858087, -0.00125372503,
                  -0.00417768164, 0.246640727, 1.50140941):
            p = c + p * w
    else:
        w = math.sqrt(w) - 3.0
        p = -0.000200214257
        for c in (0.000100950558, 0.00134934322, -0.00367342844, 0.00573950773, -0.0076224613,
                  0.00943887047, 1.00167406, 2.83297682):
            p = c + p * w
    x = p * y
    for _ in range(2):
        x -= (math.erf(x) - y) / (2.0 / math.sqrt(math.pi) * math.exp(-x * x))
    return x


@dataclass(frozen=True)
class BandwidthTrace:
    """Per-link bandwidth over time from a trace: rows (t_start, src, dst, gbps) hold until the next
    row of the same link; before a link's first row, and for links not in the trace, no cap."""

    rows: tuple[tuple[float, int, int, float], ...]
    _index: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        by_link: dict[tuple[int, int], list[tuple[float, float]]] = {}
        for t, s, d, g in sorted(self.rows):
            if not g > 0:
                raise UserError(f"bandwidth trace row at t={t} for link {s}->{d}: gbps must be > 0, got {g}")
            by_link.setdefault((s, d), []).append((t, g))
        for link, pts in by_link.items():
            self._index[link] = ([p[0] for p in pts], [p[1] for p in pts])

    @classmethod
    def load(cls, path: str | Path) -> "BandwidthTrace":
        path = Path(path)
        if not path.exists():
            raise UserError(f"bandwidth trace {path} does not exist")
        rows = []
        with path.open(newline="") as f:
            reader = csv.DictReader(f)
            need = {"t_start", "src", "dst", "gbps"}
            if reader.fieldnames is None or not need <= set(reader.fieldnames):
                raise UserError(f"{path}: header must have columns {sorted(need)}, got {reader.fieldnames}")
            for n, r in enumerate(reader, 2):
                try:
                    rank = lambda v: ANY if v.strip() == "*" else int(v)  # noqa: E731
                    rows.append((float(r["t_start"]), rank(r["src"]), rank(r["dst"]), float(r["gbps"])))
                except ValueError as err:
                    raise UserError(f"{path}:{n}: {err}") from None
        return cls(tuple(rows))

    def effect(self, src: int, dst: int, t: float) -> tuple[float, Optional[float]]:
        cap = None
        for link in ((src, dst), (src, ANY), (ANY, dst), (ANY, ANY)):
            if link in self._index:
                times, gbps = self._index[link]
                i = bisect_right(times, t) - 1
                if i >= 0:
                    cap = gbps[i] if cap is None else min(cap, gbps[i])
        return 0.0, cap


Effect = Bursts | LognormalJitter | BandwidthTrace


def transfer_s(nbytes: int, gbps: float) -> float:
    """Seconds to put `nbytes` on a link of `gbps` Gbit/s (0 on an unbounded one)."""
    return nbytes * 8.0 / (gbps * 1e9) if math.isfinite(gbps) else 0.0


@dataclass(frozen=True)
class LinkSchedule:
    """Healthy link (latency, bandwidth) plus the disturbances layered on it."""

    latency_s: float = 0.0
    bandwidth_gbps: float = math.inf
    effects: tuple[Effect, ...] = ()

    def delay(self, src: int, dst: int, nbytes: int, t: float) -> float:
        """Seconds from `send` at time `t` until the message is fully at `dst`."""
        if src == dst:
            return 0.0
        extra, cap = self.disturbance(src, dst, t)
        return self.latency_s + extra + transfer_s(nbytes, min(self.bandwidth_gbps, cap))

    def disturbance(self, src: int, dst: int, t: float) -> tuple[float, float]:
        """(extra delay in s, bandwidth cap in Gbit/s, inf if none) the effects put on link src -> dst at `t`;
        lab/network.py lays them over a topology's links."""
        extra, cap = 0.0, math.inf
        for e in self.effects:
            d, c = e.effect(src, dst, t)
            extra += d
            if c is not None:
                cap = min(cap, c)
        return extra, cap

    @property
    def clean(self) -> bool:
        return not self.effects


@dataclass(frozen=True)
class SlowRank:
    """Rank `rank` computes `factor` times slower, always or during on/off bursts."""

    rank: int
    factor: float
    period_s: Optional[float] = None   # None: slow all the time
    duty: float = 1.0
    phase_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.factor > 0:
            raise UserError(f"slow-rank factor must be > 0, got {self.factor}")
        if self.period_s is not None and not self.period_s > 0:
            raise UserError(f"slow-rank period must be > 0 s, got {self.period_s}")

    def scale(self, rank: int, t: float) -> float:
        if rank != self.rank:
            return 1.0
        if self.period_s is not None and ((t - self.phase_s) % self.period_s) >= self.duty * self.period_s:
            return 1.0
        return self.factor


@dataclass(frozen=True)
class Interference:
    """What one scenario does to the cluster: link schedule + slow ranks. `Interference()` is clean."""

    link: LinkSchedule = LinkSchedule()
    slow: tuple[SlowRank, ...] = ()
    name: str = "clean"

    def delay(self, src: int, dst: int, nbytes: int, t: float) -> float:
        return self.link.delay(src, dst, nbytes, t)

    def compute_scale(self, rank: int, t: float) -> float:
        s = 1.0
        for sr in self.slow:
            s *= sr.scale(rank, t)
        return s


def from_config(cfg: dict, name: str = "scenario", base_dir: Path | None = None) -> Interference:
    """Build a scenario from a plain dict (one entry of a bench YAML's `scenarios`):

        latency_us: 50          # healthy link latency
        bandwidth_gbps: 100     # healthy link bandwidth
        bursts:   [{period_ms, duty, extra_delay_us, bandwidth_gbps, phase_ms, links: [[0, 1]], collectives}]
        jitter:   {median_us, sigma, seed, window_ms, links}
        trace:    path/to/bandwidth.csv   (t_start, src, dst, gbps; '*' = any rank)
        slow_ranks: [{rank, factor, period_ms, duty, phase_ms}]
    """
    known = {"latency_us", "bandwidth_gbps", "bursts", "jitter", "trace", "slow_ranks"}
    unknown = set(cfg) - known
    if unknown:
        raise UserError(f"scenario {name!r}: unknown field(s) {sorted(unknown)}; valid: {sorted(known)}")
    effects: list[Effect] = []
    for b in cfg.get("bursts", []) or []:
        _check_keys(b, {"period_ms", "duty", "extra_delay_us", "bandwidth_gbps", "phase_ms", "links", "collectives"},
                    name, "bursts")
        effects.append(Bursts(period_s=b["period_ms"] * 1e-3, duty=b["duty"],
                              extra_delay_s=b.get("extra_delay_us", 0.0) * 1e-6,
                              bandwidth_gbps=b.get("bandwidth_gbps"), phase_s=b.get("phase_ms", 0.0) * 1e-3,
                              links=_links(b.get("links")), collectives=b.get("collectives", "hops")))
    if cfg.get("jitter"):
        j = cfg["jitter"]
        _check_keys(j, {"median_us", "sigma", "seed", "window_ms", "links"}, name, "jitter")
        effects.append(LognormalJitter(median_s=j["median_us"] * 1e-6, sigma=j.get("sigma", 0.5), seed=j.get("seed", 0),
                                       window_s=j.get("window_ms", 1.0) * 1e-3, links=_links(j.get("links"))))
    if cfg.get("trace"):
        p = Path(cfg["trace"])
        effects.append(BandwidthTrace.load(p if p.is_absolute() or base_dir is None else base_dir / p))
    slow = []
    for s in cfg.get("slow_ranks", []) or []:
        _check_keys(s, {"rank", "factor", "period_ms", "duty", "phase_ms"}, name, "slow_ranks")
        slow.append(SlowRank(rank=s["rank"], factor=s["factor"],
                             period_s=s["period_ms"] * 1e-3 if s.get("period_ms") else None,
                             duty=s.get("duty", 1.0), phase_s=s.get("phase_ms", 0.0) * 1e-3))
    link = LinkSchedule(latency_s=cfg.get("latency_us", 0.0) * 1e-6,
                        bandwidth_gbps=cfg.get("bandwidth_gbps", math.inf), effects=tuple(effects))
    return Interference(link=link, slow=tuple(slow), name=name)


def _check_keys(d: dict, allowed: set[str], scenario: str, section: str) -> None:
    if not isinstance(d, dict):
        raise UserError(f"scenario {scenario!r}: each {section} entry must be a mapping, got {d!r}")
    bad = set(d) - allowed
    if bad:
        raise UserError(f"scenario {scenario!r}, {section}: unknown field(s) {sorted(bad)}; valid: {sorted(allowed)}")
