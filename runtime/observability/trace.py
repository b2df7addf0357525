"""Chrome/Perfetto trace of a run: per-rank timeline of batches, plus every scheduler decision.

Open the JSON in https://ui.perfetto.dev or chrome://tracing. One process row per rank; batches are
complete ("X") events named by their stage, decisions instant ("i") events whose args hold the
candidate scores, the chosen stage and the batch size. Times are microseconds of the run's clock
(wall or virtual).

Bounded: a recorder keeps the latest `keep_batches` batches (TRACE_BATCHES per rank by default; their events and
decisions), a ring in memory, so tracing a long run costs flat memory and a bounded end-of-run report; the trace
file covers the run's last stretch and says so (`otherData`). Older records are dropped in one go whenever a list
reaches twice its bound (so between 1x and 2x are held).
"""
from __future__ import annotations

import json
from pathlib import Path

TRACE_BATCHES = 4096  # batches (and decisions) a rank's trace keeps, the latest


class TraceRecorder:
    def __init__(self, keep_batches: int = TRACE_BATCHES) -> None:
        self.keep_batches = keep_batches
        self.events: list[dict] = []
        self.decisions: list[dict] = []  # the same decisions, as plain records for tests/inspection
        self.dropped_events = 0  # dropped from this recorder's ring (events of other processes not counted)

    def _add_event(self, ev: dict) -> None:
        self.events.append(ev)
        if len(self.events) > 4 * self.keep_batches:  # a batch and a decision per batch: 2 events
            drop = len(self.events) - 2 * self.keep_batches
            del self.events[:drop]
            self.dropped_events += drop

    def batch(self, rank: int, name: str, t_start: float, t_end: float, args: dict) -> None:
        self._add_event({"name": name, "ph": "X", "pid": rank, "tid": 0, "ts": t_start * 1e6,
                         "dur": max(t_end - t_start, 0.0) * 1e6, "args": args})

    def decision(self, rank: int, t: float, policy: str, stage: int, name: str, scores: dict[int, float],
                 rows: int) -> None:
        rec = {"t": t, "rank": rank, "policy": policy, "stage": stage, "stage_name": name,
               "scores": {str(s): round(v, 6) for s, v in scores.items()}, "batch_rows": rows}
        self.decisions.append(rec)
        if len(self.decisions) > 2 * self.keep_batches:
            del self.decisions[:len(self.decisions) - self.keep_batches]
        self._add_event({"name": f"pick {name}", "ph": "i", "s": "t", "pid": rank, "tid": 1, "ts": t * 1e6,
                         "args": rec})

    def to_chrome(self, world_size: int) -> dict:
        meta = [{"name": name, "ph": "M", "pid": r, **tid, "args": {"name": label}} for r in range(world_size)
                for name, tid, label in (("process_name", {}, f"rank {r}"), ("thread_name", {"tid": 0}, "batches"),
                                         ("thread_name", {"tid": 1}, "scheduler"))]
        keep = self.keep_batches
        other = {"ring": f"the latest batches only: {keep} to {2 * keep} per recorder (one per rank process; one for "
                         f"all ranks of an in-process run) (runtime/observability/trace.py)"}
        if self.dropped_events:
            other["dropped_events"] = self.dropped_events
        return {"traceEvents": meta + list(self.events), "displayTimeUnit": "ms", "otherData": other}

    def write(self, path: str | Path, world_size: int) -> None:
        Path(path).write_text(json.dumps(self.to_chrome(world_size)))
