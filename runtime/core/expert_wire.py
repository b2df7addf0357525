"""The wire form of an expert message's row tags and expert ids (the metadata half of the two-phase
exchange; the rows themselves travel as the tensor).

A home dispatches one contiguous range of merge positions per destination (runtime/core/merge.py: tags are
positions in dispatch order), and an owner usually returns one home's rows of an expert batch as that same
range, so tags travel as `(first, count)` when they are a run and as an int64 array otherwise; expert ids
travel as the bytes of the narrowest unsigned type that holds the model's expert count. Pickling the two
int64 arrays cost ~10 us per message here and more on the H200 host (benchmarks/host_speed.py); the tuple
and the bytes cost ~1.5 us. decode_tags accepts both forms.
"""
from __future__ import annotations

import numpy as np


def encode_tags(tags: np.ndarray):
    """Tags in the run form when they are one (ascending by one), else the array."""
    n = len(tags)
    if n and int(tags[-1]) - int(tags[0]) == n - 1 and (n <= 2 or bool((np.diff(tags) == 1).all())):
        return (int(tags[0]), n)
    return tags


def decode_tags(wire) -> np.ndarray:
    """int64 tags from either form."""
    if type(wire) is tuple:
        first, n = wire
        return np.arange(first, first + n, dtype=np.int64)
    return np.asarray(wire, dtype=np.int64)


def id_dtype(num_experts: int) -> np.dtype:
    """The narrowest unsigned dtype holding every expert id of a model (both sides derive it from the plan)."""
    return np.dtype(np.uint8 if num_experts <= 1 << 8 else np.uint16 if num_experts <= 1 << 16 else np.uint32)


def encode_ids(ids: np.ndarray, dtype: np.dtype) -> bytes:
    return ids.astype(dtype).tobytes()


def decode_ids(wire: bytes, dtype: np.dtype) -> np.ndarray:
    """int64 expert ids from their bytes (wire.MESSAGES requires bytes for "e")."""
    return np.frombuffer(wire, dtype=dtype).astype(np.int64)
