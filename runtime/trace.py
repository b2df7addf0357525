"""Chrome/Perfetto trace of a run: per-rank timeline of batches, plus every scheduler decision.

Open the JSON in https://ui.perfetto.dev or chrome://tracing. One process row per rank; batches are
complete ("X") events named by their stage, decisions instant ("i") events whose args hold the
candidate scores, the chosen stage and the batch size. Times are microseconds of the run's clock
(wall or virtual).
"""
from __future__ import annotations

import json
from pathlib import Path


class TraceRecorder:
    def __init__(self) -> None:
        self.events: list[dict] = []
        self.decisions: list[dict] = []  # the same decisions, as plain records for tests/inspection

    def batch(self, rank: int, name: str, t_start: float, t_end: float, args: dict) -> None:
        self.events.append({"name": name, "ph": "X", "pid": rank, "tid": 0, "ts": t_start * 1e6,
                            "dur": max(t_end - t_start, 0.0) * 1e6, "args": args})

    def decision(self, rank: int, t: float, policy: str, stage: int, name: str, scores: dict[int, float],
                 rows: int) -> None:
        rec = {"t": t, "rank": rank, "policy": policy, "stage": stage, "stage_name": name,
               "scores": {str(s): round(v, 6) for s, v in scores.items()}, "batch_rows": rows}
        self.decisions.append(rec)
        self.events.append({"name": f"pick {name}", "ph": "i", "s": "t", "pid": rank, "tid": 1, "ts": t * 1e6,
                            "args": rec})

    def to_chrome(self, world_size: int) -> dict:
        meta = []
        for r in range(world_size):
            meta.append({"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r}"}})
            meta.append({"name": "thread_name", "ph": "M", "pid": r, "tid": 0, "args": {"name": "batches"}})
            meta.append({"name": "thread_name", "ph": "M", "pid": r, "tid": 1, "args": {"name": "scheduler"}})
        return {"traceEvents": meta + self.events, "displayTimeUnit": "ms"}

    def write(self, path: str | Path, world_size: int) -> None:
        Path(path).write_text(json.dumps(self.to_chrome(world_size)))
