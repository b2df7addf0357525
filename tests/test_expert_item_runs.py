"""An expert queue item keeps the merge tags of a dispatch as the wire's run `(first, n)` (runtime/core/queues.py
ExpertItem): a cap that cuts it leaves two runs with the rows an array of the same tags would give."""
from __future__ import annotations

import numpy as np
import torch

from runtime.core.expert_wire import decode_tags
from runtime.core.queues import ExpertItem, MuQueue


def _item(n, t, first, run):
    tags = (first, n) if run else np.arange(first, first + n, dtype=np.int64)
    return ExpertItem(0, 0, torch.arange(first, first + n, dtype=torch.float32)[:, None], tags,
                      np.arange(first, first + n) % 3, t, n)


def test_a_run_splits_into_the_runs_of_the_array_split():
    for m in (1, 3, 4):
        head, rest = _item(5, 0.0, 100, True).split(m)
        want_head, want_rest = _item(5, 0.0, 100, False).split(m)
        assert head.tag == (100, m) and rest.tag == (100 + m, 5 - m)
        assert decode_tags(head.tag).tolist() == want_head.tag.tolist()
        assert decode_tags(rest.tag).tolist() == want_rest.tag.tolist()
        assert torch.equal(rest.x, want_rest.x) and rest.expert.tolist() == want_rest.expert.tolist()


def test_a_queue_of_runs_takes_the_rows_a_queue_of_arrays_takes():
    got = {}
    for run in (True, False):
        q = MuQueue(1, "expert", 0, cap=5, token_weight=1 / 4)
        for first, n, t in ((0, 3, 0.0), (3, 4, 0.1), (7, 2, 0.2)):
            q.push(_item(n, t, first, run))
        got[run] = [[decode_tags(it.tag).tolist() for it in q.take()] for _ in range(2)]
    assert got[True] == got[False] == [[[0, 1, 2], [3, 4]], [[5, 6], [7, 8]]]
