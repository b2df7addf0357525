"""Benchmark metrics from per-token timestamps, and the report files: JSON, Markdown, PNG plots.

Every system in a comparison (streaming engine, barrier baselines; wall or virtual clock) hands over
the same raw record, a `RunRecord`: when each request arrived and when each of its output tokens
was produced, the batches it ran, sampled queue depths, and bytes per link. All metrics are computed
here from that record, by one piece of code, so no system can be measured more kindly than another.

Definitions (the paper's where it gives one):
- throughput: output tokens / (last token time - first arrival); the peak window is the best
  `peak_window_s` span of token times (the paper: 60 s) and falls back to the whole run if shorter;
- ITL: gaps between consecutive output tokens of one request; TTFT: first token - arrival;
  latency: last token - arrival;
- batch size per stage kind: mean/max rows of the batches each kind ran;
- max queueing delay: the longest any token waited in a queue (reported by the runtime).

Repeats: a matrix measured N times (`repeats` in the bench config) has N runs per (system/policy,
scenario); the report's numbers for that cell are the median over its runs of every metric (tok/s,
ITL, TTFT, batch sizes, ...; the worst for `unfinished`), its tok/s per run are kept in
`tokens_per_s_repeats`, and ratios / loss vs clean are taken between medians.
"""
from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

from runtime.observability.metrics import BatchRecord  # the runs' own batch records (rank, kind, rows, times)


@dataclass
class RequestRecord:
    id: str
    arrival: float
    token_times: list[float]            # one per output token, in order
    prompt_len: int = 0
    admit: Optional[float] = None       # when it got its KV (home rank); None if unknown


@dataclass
class QueueSample:
    t: float
    rank: int
    stage: int                          # index into the stage chain attn(0), expert(0), attn(1), ...
    depth: int


@dataclass
class QueueDepths:
    """Every stage's queue depth at each decision of a run, one row per decision: what a list of QueueSample says,
    kept compact. A QueueSample per stage per decision (74 stages for GPT-OSS-120B) was 20% of a 64-rank
    simulation's host time in session 24."""
    t: list[float] = field(default_factory=list)
    rank: list[int] = field(default_factory=list)
    depths: list[list] = field(default_factory=list)

    def add(self, t: float, rank: int, depths: list) -> None:
        self.t.append(t)
        self.rank.append(rank)
        self.depths.append(depths)

    def __len__(self) -> int:
        return sum(len(d) for d in self.depths)

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(t, rank, stage, depth) per sample, in the order the samples were taken (decision, then stage)."""
        n = np.array([len(d) for d in self.depths], dtype=np.int64)
        stage = np.concatenate([np.arange(k) for k in n]) if len(n) else np.zeros(0, dtype=np.int64)
        depth = np.array([x for d in self.depths for x in d], dtype=np.float64)
        return np.repeat(np.array(self.t), n), np.repeat(np.array(self.rank, dtype=np.int64), n), stage, depth


@dataclass
class RunRecord:
    system: str                         # "streaming", "ag-ep", "a2a-ep"
    policy: str                         # scheduler policy, "-" for barrier baselines
    scenario: str                       # "clean", "link-bursts", "slow-rank", ...
    requests: list[RequestRecord]
    batches: list[BatchRecord] = field(default_factory=list)
    queue_samples: list[QueueSample] | QueueDepths = field(default_factory=list)
    link_bytes: dict[str, int] = field(default_factory=dict)   # "src->dst" -> bytes
    max_queue_delay_s: Optional[float] = None
    stage_names: list[str] = field(default_factory=list)       # label of each stage index
    extra: dict = field(default_factory=dict)
    repeat: int = 0                     # which round of a repeated matrix (0 when measured once)

    @property
    def label(self) -> str:
        return self.system if self.policy in ("", "-") else f"{self.system}/{self.policy}"


def _pct(xs: np.ndarray, q: float) -> Optional[float]:
    return float(np.percentile(xs, q)) if xs.size else None


def _mean(xs: np.ndarray) -> Optional[float]:
    return float(xs.mean()) if xs.size else None


def peak_window_rate(times: Sequence[float], window_s: float) -> float:
    """Most tokens in any `window_s`-long span of the sorted `times`, per second."""
    ts = np.sort(np.asarray(times, dtype=np.float64))
    if ts.size == 0:
        return 0.0
    span = ts[-1] - ts[0]
    if span <= window_s:
        # Shorter than one window: the whole run is the only window there is.
        return float(ts.size / span) if span > 0 else float("inf")
    # Windows starting at a token time include every candidate optimum (the count only rises when
    # a window's left edge is at a token).
    ends = np.searchsorted(ts, ts + window_s, side="left")
    return float((ends - np.arange(ts.size)).max() / window_s)


def summarize(run: RunRecord, peak_window_s: float = 60.0) -> dict:
    """All metrics of one run as a flat JSON-ready dict."""
    reqs = run.requests
    all_times = np.array([t for r in reqs for t in r.token_times], dtype=np.float64)
    n_tok = int(all_times.size)
    t0 = min((r.arrival for r in reqs), default=0.0)
    t1 = float(all_times.max()) if n_tok else t0
    dur = t1 - t0
    itl = np.array([b - a for r in reqs for a, b in zip(r.token_times, r.token_times[1:])], dtype=np.float64)
    ttft = np.array([r.token_times[0] - r.arrival for r in reqs if r.token_times], dtype=np.float64)
    lat = np.array([r.token_times[-1] - r.arrival for r in reqs if r.token_times], dtype=np.float64)
    out = {
        "system": run.system, "policy": run.policy, "scenario": run.scenario, "label": run.label,
        "requests": len(reqs), "finished_requests": int(sum(1 for r in reqs if r.token_times)),
        "output_tokens": n_tok, "duration_s": dur,
        "tokens_per_s": n_tok / dur if dur > 0 else 0.0,
        "peak_tokens_per_s": peak_window_rate(all_times, peak_window_s) if n_tok else 0.0,
        "peak_window_s": peak_window_s,
        "itl_mean_ms": _ms(_mean(itl)), "itl_p50_ms": _ms(_pct(itl, 50)), "itl_p99_ms": _ms(_pct(itl, 99)),
        "ttft_mean_ms": _ms(_mean(ttft)), "ttft_p50_ms": _ms(_pct(ttft, 50)), "ttft_p99_ms": _ms(_pct(ttft, 99)),
        "latency_mean_s": _mean(lat), "latency_p50_s": _pct(lat, 50), "latency_p99_s": _pct(lat, 99),
        "max_queue_delay_ms": _ms(run.max_queue_delay_s),
        "batches": {}, "link_bytes": dict(sorted(run.link_bytes.items())),
        "total_link_bytes": int(sum(run.link_bytes.values())),
    }
    # Little's law: mean requests holding KV = sum of (finish - admission) / run duration.
    held = [r.token_times[-1] - r.admit for r in reqs if r.token_times and r.admit is not None and r.admit >= 0]
    out["mean_live_requests"] = float(sum(held) / dur) if held and dur > 0 else None
    busy = sum(b.t_end - b.t_start for b in run.batches)
    ranks = len({b.rank for b in run.batches})
    out["busy_fraction"] = float(busy / (dur * ranks)) if dur > 0 and ranks else None
    kinds = sorted({b.kind for b in run.batches})
    for k in kinds:
        sizes = np.array([b.rows for b in run.batches if b.kind == k], dtype=np.float64)
        out["batches"][k] = {"count": int(sizes.size), "mean_size": float(sizes.mean()), "max_size": int(sizes.max())}
    out.update(run.extra)
    return out


def _ms(x: Optional[float]) -> Optional[float]:
    return None if x is None else x * 1e3


def environment(device: str = "cpu", mode: str = "") -> dict:
    """Where a result was measured; printed with every report so a number never travels alone."""
    import torch
    env = {
        "host": platform.node(), "platform": platform.platform(), "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(), "device": device, "python": sys.version.split()[0], "torch": torch.__version__,
        "numpy": np.__version__,
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name(0)
    try:
        env["git_commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                           timeout=5, cwd=Path(__file__).resolve().parent).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        env["git_commit"] = None
    if mode:
        env["clock"] = mode
    return env


def median_over_repeats(summaries: list[dict]) -> list[dict]:
    """One summary per (label, scenario), in first-seen order: a cell measured once is passed through
    unchanged (the same dict); a cell measured N > 1 times becomes the median of every numeric field over
    its N summaries (nested dicts such as `batches` and `link_bytes` key by key), the most unfinished
    requests of any run, plus `repeats` = N and `tokens_per_s_repeats` = each run's tok/s in run order."""
    groups: dict[tuple, list[dict]] = {}
    for s in summaries:
        groups.setdefault((s["label"], s["scenario"]), []).append(s)
    out = []
    for group in groups.values():
        if len(group) == 1:
            out.append(group[0])
            continue
        m = _median_of(group)
        if any("unfinished" in g for g in group):
            m["unfinished"] = max(g.get("unfinished") or 0 for g in group)
        m["repeats"] = len(group)
        m["tokens_per_s_repeats"] = [g["tokens_per_s"] for g in group]
        out.append(m)
    return out


def _median_of(ds: list[dict]) -> dict:
    keys = list(dict.fromkeys(k for d in ds for k in d))
    out = {}
    for k in keys:
        vals = [d[k] for d in ds if k in d and d[k] is not None]
        if not vals:
            out[k] = None
        elif all(isinstance(v, dict) for v in vals):
            out[k] = _median_of(vals)
        elif all(isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool) for v in vals):
            med = float(np.median(np.asarray(vals, dtype=np.float64)))
            out[k] = int(med) if all(isinstance(v, (int, np.integer)) for v in vals) and med.is_integer() else med
        else:
            out[k] = vals[0]   # names, labels: equal in every run of a cell
    return out


def compare(summaries: list[dict], baseline: str, clean: str = "clean") -> list[dict]:
    """Adds side-by-side ratios to each summary (in place, and returns them):
    `ratio_vs_baseline` = tokens/s over the baseline system's in the same scenario (first baseline
    run found there), `loss_vs_clean` = 1 - tokens/s over the same system/policy's clean run."""
    base = {}
    for s in summaries:
        if s["system"] == baseline and s["scenario"] not in base:
            base[s["scenario"]] = s
    clean_runs = {s["label"]: s for s in summaries if s["scenario"] == clean}
    for s in summaries:
        b = base.get(s["scenario"])
        s["ratio_vs_baseline"] = (s["tokens_per_s"] / b["tokens_per_s"]) if b and b["tokens_per_s"] > 0 else None
        s["peak_ratio_vs_baseline"] = (s["peak_tokens_per_s"] / b["peak_tokens_per_s"]) if b and b["peak_tokens_per_s"] > 0 else None
        c = clean_runs.get(s["label"])
        s["loss_vs_clean"] = (1.0 - s["tokens_per_s"] / c["tokens_per_s"]) if c and c["tokens_per_s"] > 0 else None
    return summaries


def _f(x: Optional[float], fmt: str = ".1f") -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, fmt)


def markdown_table(summaries: list[dict], baseline: str) -> str:
    reps = max((s.get("repeats") or 1 for s in summaries), default=1)
    tok = "tok/s" if reps == 1 else f"tok/s median of {reps} (min-max)"
    head = ("| system | scenario | " + tok + " | peak tok/s | x " + baseline + " | loss vs clean | ITL mean / p50 / p99 ms "
            "| TTFT p50 ms | mean batch (attn / expert) | max queue delay ms | live req | busy |")
    lines = [head, "|" + "---|" * 12]
    for s in summaries:
        b = s.get("batches", {})
        attn = b.get("attn", {}).get("mean_size", s.get("attn_mean_batch"))
        exp = b.get("expert", {}).get("mean_size", s.get("expert_mean_batch"))
        loss = s.get("loss_vs_clean")
        tps = _f(s["tokens_per_s"])
        if s.get("tokens_per_s_repeats"):   # median (min-max over the repeats)
            reps = s["tokens_per_s_repeats"]
            tps += f" ({min(reps):.1f}-{max(reps):.1f})"
        lines.append(
            f"| {s['label']} | {s['scenario']} | {tps} | {_f(s['peak_tokens_per_s'])} "
            f"| {_f(s.get('ratio_vs_baseline'), '.2f')} | {'-' if loss is None else f'{loss * 100:+.1f}%'} "
            f"| {_f(s['itl_mean_ms'], '.2f')} / {_f(s['itl_p50_ms'], '.2f')} / {_f(s['itl_p99_ms'], '.2f')} "
            f"| {_f(s['ttft_p50_ms'], '.2f')} | {_f(attn)} / {_f(exp)} | {_f(s['max_queue_delay_ms'], '.2f')} "
            f"| {_f(s.get('mean_live_requests'))} | {_f(s.get('busy_fraction'), '.2f')} |")
    return "\n".join(lines) + "\n"


def environment_markdown(env: dict) -> str:
    return "\n".join(f"- {k}: `{v}`" for k, v in env.items()) + "\n"


# ---- plots ---------------------------------------------------------------------------------------

def _plt():
    import matplotlib
    matplotlib.use("Agg")  # files only: benchmarks run headless
    import matplotlib.pyplot as plt
    return plt


def plot_throughput(summaries: list[dict], path: Path, baseline: str) -> Path:
    plt = _plt()
    scenarios = list(dict.fromkeys(s["scenario"] for s in summaries))
    labels = list(dict.fromkeys(s["label"] for s in summaries))
    by = {(s["scenario"], s["label"]): s for s in summaries}
    width = 0.8 / max(len(labels), 1)
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(scenarios) * max(1, len(labels)) / 2), 4))
    for i, lab in enumerate(labels):
        xs, ys, ratios = [], [], []
        for j, sc in enumerate(scenarios):
            s = by.get((sc, lab))
            if s is None:
                continue
            xs.append(j + (i - (len(labels) - 1) / 2) * width)
            ys.append(s["tokens_per_s"])
            ratios.append(s.get("ratio_vs_baseline"))
        bars = ax.bar(xs, ys, width, label=lab)
        for bar, r in zip(bars, ratios):
            if r is not None:
                ax.annotate(f"{r:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                            ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(scenarios)), scenarios)
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"Throughput (labels: ratio to {baseline} in the same scenario)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_itl_cdf(runs: list[RunRecord], path: Path) -> Path:
    plt = _plt()
    scenarios = list(dict.fromkeys(r.scenario for r in runs))
    fig, axes = plt.subplots(1, len(scenarios), figsize=(4.5 * len(scenarios), 3.6), squeeze=False)
    for ax, sc in zip(axes[0], scenarios):
        pooled: dict[str, list[float]] = {}   # one curve per label: the repeats of a cell pooled
        for r in runs:
            if r.scenario == sc:
                pooled.setdefault(r.label, []).extend(
                    b - a for q in r.requests for a, b in zip(q.token_times, q.token_times[1:]))
        for label, gaps in pooled.items():
            itl = np.sort(gaps) * 1e3
            if itl.size:
                ax.plot(itl, np.arange(1, itl.size + 1) / itl.size, label=label)
        ax.set_xscale("log")
        ax.set_xlabel("inter-token latency (ms)")
        ax.set_ylabel("CDF")
        ax.set_title(sc)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def queue_depth_grid(run: RunRecord, bins: int = 100) -> tuple[np.ndarray, np.ndarray]:
    """Time x stage matrix of queue depth summed over ranks, averaged within each time bin."""
    if not run.queue_samples:
        return np.zeros((0, 0)), np.zeros(0)
    if isinstance(run.queue_samples, QueueDepths):
        t, rk, st, d = run.queue_samples.arrays()
    else:
        t = np.array([q.t for q in run.queue_samples])
        st = np.array([q.stage for q in run.queue_samples])
        d = np.array([q.depth for q in run.queue_samples], dtype=np.float64)
        rk = np.array([q.rank for q in run.queue_samples])
    n_stage = int(st.max()) + 1
    edges = np.linspace(t.min(), t.max() + 1e-12, bins + 1)
    b = np.clip(np.searchsorted(edges, t, side="right") - 1, 0, bins - 1)
    # Mean over the samples of each (bin, stage, rank), then sum over ranks: ranks sample at
    # different rates, and one rank sampled twice must not count double.
    acc = np.zeros((bins, n_stage, int(rk.max()) + 1))
    cnt = np.zeros_like(acc)
    np.add.at(acc, (b, st, rk), d)
    np.add.at(cnt, (b, st, rk), 1)
    grid = np.where(cnt > 0, acc / np.maximum(cnt, 1), 0.0).sum(axis=2)
    return grid.T, edges


def plot_heatmaps(runs: list[RunRecord], path: Path) -> Optional[Path]:
    runs = [r for r in runs if r.queue_samples]
    if not runs:
        return None
    plt = _plt()
    fig, axes = plt.subplots(len(runs), 1, figsize=(9, 2.6 * len(runs)), squeeze=False)
    for ax, r in zip(axes[:, 0], runs):
        grid, edges = queue_depth_grid(r)
        im = ax.imshow(grid, aspect="auto", origin="lower", interpolation="nearest", cmap="viridis",
                       extent=(edges[0], edges[-1], -0.5, grid.shape[0] - 0.5))
        ax.set_title(f"{r.label} / {r.scenario}: queue depth (tokens, all ranks)")
        ax.set_xlabel("time (s)")
        ax.set_ylabel("stage (attn(0), expert(0), ...)")
        fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(out_dir: str | Path, runs: list[RunRecord], baseline: str, env: dict,
                 peak_window_s: float = 60.0, config: Optional[dict] = None, title: str = "lab bench",
                 heatmap_runs: Optional[list[RunRecord]] = None,
                 targets: Optional[Callable[[list[dict]], list[dict]]] = None) -> dict:
    """Write report.json, report.md and the PNGs into `out_dir`; returns the JSON document."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summaries = compare(median_over_repeats([summarize(r, peak_window_s) for r in runs]), baseline)
    files = {"throughput": plot_throughput(summaries, out / "throughput.png", baseline).name,
             "itl_cdf": plot_itl_cdf(runs, out / "itl_cdf.png").name}
    hm = plot_heatmaps(heatmap_runs if heatmap_runs is not None else runs, out / "queue_heatmap.png")
    if hm is not None:
        files["queue_heatmap"] = hm.name
    doc = {"title": title, "baseline": baseline, "environment": env, "config": config or {},
           "results": summaries, "files": files}
    if targets is not None:
        doc["targets"] = targets(summaries)
    (out / "report.json").write_text(json.dumps(doc, indent=2, default=_json_default) + "\n")
    md = [f"# {title}\n", "## Results\n", markdown_table(summaries, baseline),
          "\n## Environment\n", environment_markdown(env)]
    if doc.get("targets"):
        md += ["\n## Targets (measured, not asserted)\n"] + [
            f"- {'MET' if t['met'] else 'NOT MET'}: {t['target']}: {_target_value(t['value'])}\n" for t in doc["targets"]]
    if config:
        md += ["\n## Configuration\n", "```json\n" + json.dumps(config, indent=2, default=_json_default) + "\n```\n"]
    md += ["\n## Plots\n"] + [f"![{k}]({v})\n" for k, v in files.items()]
    (out / "report.md").write_text("".join(md))
    return doc


def _target_value(v) -> str:
    if isinstance(v, float):
        return f"{v:.3f}"
    return json.dumps(v, default=_json_default) if v is not None else "-"


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, Path):
        return str(o)
    if hasattr(o, "__dataclass_fields__"):
        return asdict(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")
