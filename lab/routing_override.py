"""Routing decisions that replace the model's router: replayed traces and synthetic skew.

A random-weight model routes almost uniformly, which hides exactly the effect under study (hot
experts make some ranks stragglers). The paper replays routing recorded from the real model; for
random weights we also offer seeded synthetic skew. Every router here has one signature,

    router(layer, x[T,H], seq_ids[T], positions[T]) -> (expert_ids[T,k] int64, weights[T,k] float32)

the same contract as `models.layers.route` plus the token keys, and its answer for a token depends
only on (request, position, layer) (and the seed), never on which other tokens share the batch. That
is what makes the streaming engine and the barrier baselines, which batch tokens differently, see
identical routing, and lets their output tokens be compared.

- `ModelRouter`: the model's own router (models.layers.route) behind this signature.
- `ZipfRouting`: per layer, expert popularity follows Zipf(s) over a seeded permutation of experts;
  every `drift_every` steps the popularity ranking rotates by `drift_stride`, so the hot experts move
  and no static placement can be tuned to them. Top-k experts are drawn without replacement
  (Gumbel-top-k with hashed per-token noise), weights are a softmax over the chosen scores.
- `RoutingTrace` / `RoutingRecorder`: replay a recorded trace keyed by (request, position, layer);
  record one from any router, as JSONL (readable) or .npz (compact).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from operator import itemgetter
from pathlib import Path
from typing import Any, Callable, Hashable, Optional, Sequence

import numpy as np
import torch

from graph_ir.errors import UserError
from dataflow_kernels.dispatch import backend_for
from lab.zipf_kernel import warm_up as warm_up_kernel
from lab.zipf_kernel import zipf_topk
from lab.zipf_torch import zipf_route
from lab.zipf_triton import zipf_route_triton

Router = Callable[[int, Optional[torch.Tensor], Sequence[Hashable], Sequence[int]], tuple[torch.Tensor, torch.Tensor]]


class ModelRouter:
    """The model's learned router, adapted to the keyed signature (keys are ignored)."""

    def __init__(self, spec: Any, weights: Any):
        self.spec, self.weights = spec, weights

    def __call__(self, layer: int, x: Optional[torch.Tensor], seq_ids: Sequence[Hashable], positions: Sequence[int]):
        from models.layers import route  # imported here: models is optional for synthetic routing
        if x is None:
            raise ValueError("the model router needs the hidden states x")
        return route(self.spec, self.weights, layer, x)


# ---- synthetic skew ------------------------------------------------------------------------------

_SM_ADD, _SM_MUL1, _SM_MUL2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_U30, _U27, _U31 = np.uint64(30), np.uint64(27), np.uint64(31)


def _splitmix64_inplace(z: np.ndarray, tmp: Optional[np.ndarray] = None) -> np.ndarray:
    """SplitMix64 finalizer on a uint64 array, in place (array ops wrap mod 2^64 silently): a cheap,
    well-mixed hash of 64-bit keys.

    `tmp`, an array of z's shape, holds the shifted copies; without it each shift allocates one.
    """
    z += _SM_ADD
    z ^= np.right_shift(z, _U30, out=tmp)
    z *= _SM_MUL1
    z ^= np.right_shift(z, _U27, out=tmp)
    z *= _SM_MUL2
    z ^= np.right_shift(z, _U31, out=tmp)
    return z


_M64 = (1 << 64) - 1
# Up to this many tokens a batch's keys are hashed in Python ints (the same SplitMix64, masked to 64 bits: the same
# bits): ~1 us a token, where the numpy passes cost ~20 small-array calls a batch (~25 us at one row).
_PY_TOKENS = 8


def _splitmix64(z: int) -> int:
    """`_splitmix64_inplace` of one key, a Python int in 0 .. 2^64 - 1."""
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)



def _key64(value: Hashable) -> int:
    # Python's hash() of a str changes between processes (PYTHONHASHSEED); ranks in different
    # processes must agree, so hash the repr with a fixed function instead.
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=8).digest(), "little")


@dataclass
class ZipfRouting:
    """Seeded Zipf-skewed routing with drifting hot experts (see the module docstring).

    One call is a few numpy passes over the batch's T keys and one compiled loop over its [T, E]
    scores (zipf_kernel.py), no Python per row beyond
    one dict lookup per token for its request's key (blake2b runs once per request, then cached):
    the router sits on every system's hot path, once per attention batch.
    """

    num_experts: int
    top_k: int
    s: float = 1.0
    drift_every: int = 0          # steps between rotations of the popularity ranking; 0 = never
    drift_stride: int = 1         # how many ranks the ranking moves per rotation
    seed: int = 0
    _req_keys: dict = field(default_factory=dict, init=False, repr=False)
    _orders: dict = field(default_factory=dict, init=False, repr=False)
    _tables: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _bases: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _dev_tables: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _seeded: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # request -> sm(key ^ seed)
    _no_shift: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # T -> zeros (no drift)

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise UserError(f"top_k must be in 1..num_experts ({self.num_experts}), got {self.top_k}")
        if self.s < 0:
            raise UserError(f"Zipf exponent s must be >= 0 (0 = uniform), got {self.s}")
        if self.drift_every < 0:
            raise UserError(f"drift_every must be >= 0 (0 disables drift), got {self.drift_every}")
        ranks = np.arange(1, self.num_experts + 1, dtype=np.float64)
        self._log_zipf = -self.s * np.log(ranks)          # log-popularity of rank r (unnormalised)
        self._seed64 = np.uint64(self.seed & 0xFFFFFFFFFFFFFFFF)
        warm_up_kernel()

    def __setstate__(self, state: dict) -> None:
        # A rank process gets the router pickled: load its kernel there too, before the run's clock starts (without
        # this the barrier ranks paid the ~0.3 s load inside their first timed attention batch, ~5% of a CPU bench
        # cell; session 27, benchmarks/results/sim_validation.md).
        self.__dict__.update(state)
        warm_up_kernel()

    def _order(self, layer: int) -> np.ndarray:
        """Experts sorted from hottest to coldest on `layer` before any drift (seeded per layer)."""
        if layer not in self._orders:
            rng = np.random.default_rng(np.random.SeedSequence(self.seed, spawn_key=(1, layer)))
            self._orders[layer] = rng.permutation(self.num_experts)
        return self._orders[layer]

    def _table(self, layer: int) -> np.ndarray:
        """[E shifts, E experts] log-popularity on `layer` for every rotation of the ranking (built once).

        Rotation `shift` puts expert order[(r + shift) % E] at popularity rank r, so slot j of the
        order holds rank (j - shift) % E; the rows are copies of entries of _log_zipf.
        """
        t = self._tables.get(layer)
        if t is None:
            E = self.num_experts
            rank_of_slot = (np.arange(E)[None, :] - np.arange(E)[:, None]) % E    # [shift, slot]
            t = np.empty((E, E))
            t[:, self._order(layer)] = self._log_zipf[rank_of_slot]
            self._tables[layer] = t
        return t

    def _shifts(self, steps: np.ndarray) -> np.ndarray:
        epoch = steps // self.drift_every if self.drift_every else np.zeros_like(steps)
        return (epoch * self.drift_stride) % self.num_experts

    def popularity(self, layer: int, step: int = 0) -> np.ndarray:
        """Probability that one draw picks each expert, at `step` (for tests and plots)."""
        logp = self._log_popularity(layer, np.array([step]))[0]
        p = np.exp(logp - logp.max())
        return p / p.sum()

    def _log_popularity(self, layer: int, steps: np.ndarray) -> np.ndarray:
        return self._table(layer)[self._shifts(np.asarray(steps, dtype=np.int64))]

    def _request_keys(self, seq_ids: Sequence[Hashable], T: int) -> np.ndarray:
        cache = self._req_keys
        try:
            return np.fromiter(map(cache.__getitem__, seq_ids), dtype=np.uint64, count=T)
        except KeyError:                      # a request seen for the first time: hash it once
            for r in seq_ids:
                if r not in cache:
                    cache[r] = _key64(r)
            return np.fromiter(map(cache.__getitem__, seq_ids), dtype=np.uint64, count=T)

    # ---- the same draw on the device (zipf_torch.py): a router that runs inside the attention graph
    def request_base(self, seq_id: Hashable) -> int:
        """sm(request key ^ seed), the per-request part of every draw, as the int64 with its bits
        (hashed once per request; CudaExecutor keeps it per device table row)."""
        b = self._bases.get(seq_id)
        if b is None:
            z = self._request_keys((seq_id,), 1) ^ self._seed64  # the host draw's cached request key
            b = self._bases[seq_id] = int(_splitmix64_inplace(z).view(np.int64)[0])
        return b

    def route_torch(self, layer: int, base0: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """__call__'s answer as torch ops on base0's device (request bases [T], positions [T] int64):
        capturable, so CudaExecutor can route inside its attention graph."""
        key = (layer, base0.device)
        t = self._dev_tables.get(key)
        if t is None:
            t = self._dev_tables[key] = torch.from_numpy(self._table(layer)).to(base0.device)
        # One Triton launch on the GPU (zipf_triton.py), its torch twin elsewhere: same bits.
        draw = zipf_route_triton if backend_for(base0, pos) == "triton" else zipf_route
        return draw(base0, pos, layer, t, self.top_k, drift_every=self.drift_every, drift_stride=self.drift_stride)

    def __call__(self, layer: int, x: Optional[torch.Tensor], seq_ids: Sequence[Hashable],
                 positions: Sequence[int], steps: Optional[Sequence[int]] = None):
        idx, w = self.arrays(layer, x, seq_ids, positions, steps)
        return torch.from_numpy(idx), torch.from_numpy(w)

    def arrays(self, layer: int, x: Optional[torch.Tensor], seq_ids: Sequence[Hashable],
               positions: Sequence[int], steps: Optional[Sequence[int]] = None) -> tuple[np.ndarray, np.ndarray]:
        """__call__'s answer as numpy arrays (int64 ids, float32 weights): what the host-routed dispatch takes
        (KeyedRoutingExecutor.route_arrays: no tensors made here and read back as arrays, three torch calls less)."""
        T, k = len(seq_ids), self.top_k
        # One 64-bit key per token, then per (token, expert) a uniform in (0, 1) from its hash:
        #   base = sm(sm(sm(req ^ seed) ^ pos) ^ layer),  h = sm(base ^ expert),
        #   u = ((h >> 11) + 0.5) / 2^53,  score = logp - log(-log(u))      (sm = SplitMix64),
        # and Gumbel-top-k of the scores, compiled (lab/zipf_kernel.py: same bits as
        # the numpy passes it replaced).
        if T <= _PY_TOKENS:
            base, shifts = self._small_keys(layer, seq_ids, positions, steps, T)
        else:
            pos = np.ascontiguousarray(np.asarray(positions, dtype=np.int64).reshape(T))
            step = pos if steps is None else np.asarray(steps, dtype=np.int64).reshape(T)
            base = self._request_keys(seq_ids, T)                 # a fresh array: ours to overwrite
            base ^= self._seed64
            _splitmix64_inplace(base)
            base ^= pos.view(np.uint64)                            # == astype(uint64): two's complement
            _splitmix64_inplace(base)
            base ^= np.uint64(layer)
            _splitmix64_inplace(base)
            shifts = self._shifts(step)
        idx = np.empty((T, k), dtype=np.int64)
        w = np.empty((T, k))
        zipf_topk(base, self._table(layer), shifts, k, idx, w)
        return idx, w.astype(np.float32)

    def _small_keys(self, layer: int, seq_ids: Sequence[Hashable], positions: Sequence[int],
                    steps: Optional[Sequence[int]], T: int) -> tuple[np.ndarray, np.ndarray]:
        """(base, shifts) of a few tokens, computed in Python ints: the numpy path's values bit for bit (a position's
        uint64 is its two's complement; numpy's integer // and % floor as Python's do)."""
        seeded = self._seeded
        base = []
        for r, p in zip(seq_ids, positions):
            b = seeded.get(r)
            if b is None:
                b = seeded[r] = _splitmix64(int(self._request_keys((r,), 1)[0]) ^ (self.seed & _M64))
            base.append(_splitmix64(_splitmix64(b ^ (int(p) & _M64)) ^ layer))
        if self.drift_every:
            E, de, ds = self.num_experts, self.drift_every, self.drift_stride
            shifts = np.array([(int(s) // de * ds) % E for s in (positions if steps is None else steps)], dtype=np.int64)
        else:
            shifts = self._no_shift.get(T)
            if shifts is None:
                shifts = self._no_shift[T] = np.zeros(T, dtype=np.int64)
        return np.array(base, dtype=np.uint64), shifts


# ---- replay and record ---------------------------------------------------------------------------

Key = tuple[str, int, int]  # (request id as str, position, layer)


def _key(req: Hashable, pos: int, layer: int) -> Key:
    # Request ids are compared as strings so a trace written with int ids replays for str ids too.
    return (str(req), int(pos), int(layer))


class RoutingTrace:
    """A recorded routing trace, replayed as a router. Missing keys are an error (or fall back)."""

    def __init__(self, entries: dict[Key, tuple[np.ndarray, np.ndarray]], fallback: Optional[Router] = None):
        self.entries = entries
        self.fallback = fallback
        ks = {len(ids) for ids, _ in entries.values()}
        if len(ks) > 1:
            raise UserError(f"routing trace mixes top-k widths {sorted(ks)}")
        self.top_k = ks.pop() if ks else 0

    def __len__(self) -> int:
        return len(self.entries)

    def __call__(self, layer: int, x: Optional[torch.Tensor], seq_ids: Sequence[Hashable], positions: Sequence[int]):
        rows = [self.entries.get(_key(r, p, layer)) for r, p in zip(seq_ids, positions)]
        missing = [i for i, row in enumerate(rows) if row is None]
        if missing:
            if self.fallback is None:
                i = missing[0]
                raise UserError(f"routing trace has no entry for request {seq_ids[i]!r}, position {positions[i]}, "
                                f"layer {layer} ({len(missing)} of {len(rows)} tokens missing); record the trace with "
                                "the same workload and seed, or allow the model router as fallback")
            sub_x = x[missing] if x is not None else None
            ids_f, w_f = self.fallback(layer, sub_x, [seq_ids[i] for i in missing], [positions[i] for i in missing])
            for j, i in enumerate(missing):
                rows[i] = (ids_f[j].numpy(), w_f[j].numpy())
        ids = torch.from_numpy(np.stack([r[0] for r in rows]).astype(np.int64)) if rows else torch.empty(0, self.top_k, dtype=torch.int64)
        w = torch.from_numpy(np.stack([r[1] for r in rows]).astype(np.float32)) if rows else torch.empty(0, self.top_k)
        return ids, w

    @classmethod
    def load(cls, path: str | Path, fallback: Optional[Router] = None) -> "RoutingTrace":
        path = Path(path)
        if not path.exists():
            raise UserError(f"routing trace {path} does not exist")
        entries: dict[Key, tuple[np.ndarray, np.ndarray]] = {}
        if path.suffix == ".npz":
            with np.load(path, allow_pickle=False) as z:
                for r, p, l, ids, w in zip(z["request"], z["position"], z["layer"], z["experts"], z["weights"]):
                    entries[_key(r, p, l)] = (ids.astype(np.int64), w.astype(np.float32))
        else:
            with path.open() as f:
                for n, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        d = json.loads(line)
                        entries[_key(d["request"], d["position"], d["layer"])] = (
                            np.asarray(d["experts"], dtype=np.int64), np.asarray(d["weights"], dtype=np.float32))
                    except (json.JSONDecodeError, KeyError, TypeError) as err:
                        raise UserError(f"{path}:{n}: not a routing record ({err}); expected "
                                        '{"request", "position", "layer", "experts", "weights"}') from None
        return cls(entries, fallback)


class RoutingRecorder:
    """Wraps a router and remembers every decision it makes; `save` writes a replayable trace."""

    def __init__(self, router: Router):
        self.router = router
        self.entries: dict[Key, tuple[np.ndarray, np.ndarray]] = {}

    def __call__(self, layer: int, x: Optional[torch.Tensor], seq_ids: Sequence[Hashable], positions: Sequence[int]):
        ids, w = self.router(layer, x, seq_ids, positions)
        for r, p, i_row, w_row in zip(seq_ids, positions, ids.numpy(), w.numpy()):
            self.entries[_key(r, p, layer)] = (i_row.copy(), w_row.copy())
        return ids, w

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        keys = sorted(self.entries)  # sorted: the same decisions always produce the same file
        if path.suffix == ".npz":
            k = max((len(self.entries[key][0]) for key in keys), default=0)
            np.savez_compressed(
                path,
                request=np.array([key[0] for key in keys], dtype=str),
                position=np.array([key[1] for key in keys], dtype=np.int64),
                layer=np.array([key[2] for key in keys], dtype=np.int32),
                experts=np.stack([self.entries[key][0] for key in keys]) if keys else np.zeros((0, k), np.int64),
                weights=np.stack([self.entries[key][1] for key in keys]) if keys else np.zeros((0, k), np.float32))
        else:
            with path.open("w") as f:
                for key in keys:
                    ids, w = self.entries[key]
                    # float32 -> Python float is exact, and json writes the shortest repr that
                    # round-trips, so a replayed weight equals the recorded one bit for bit.
                    f.write(json.dumps({"request": key[0], "position": key[1], "layer": key[2],
                                        "experts": ids.tolist(), "weights": [float(v) for v in w]}) + "\n")
        return path


def routed(executor: Any, router: Router) -> Any:
    """`executor` routing MoE layers by `router`: inside the executor's attention graph as a learned router
    runs where both can (CudaExecutor and a router with `route_torch`, such as ZipfRouting; one Triton kernel
    on the GPU, zipf_triton.py), otherwise by KeyedRoutingExecutor on the host per attention batch. The
    answers are the same either way (bit for bit). The graph since session 7 (benchmarks/NOTES.md §22): a
    learned router's answer exists only once the device ran the batch, so a streaming rank must wait for it
    before it can dispatch, and the host path, which knows the routing without the device, spared streaming
    exactly that round trip (3.0x against 2.0x under a compute hog, runs 49-50). Runs 1-48 used the host path
    unless they say otherwise; the switch back to it (DATAFLOW_KEYED_ROUTER=host) is gone since issue 30."""
    if hasattr(executor, "use_keyed_router") and hasattr(router, "route_torch"):
        executor.use_keyed_router(router)
        return executor
    return KeyedRoutingExecutor(executor, router)


@dataclass(frozen=True)
class RoutedBy:
    """`RunOptions(executor_wrapper=RoutedBy(router))`: every rank's executor routed by `router` (`routed`).
    Picklable, so the rank processes of a multi-process run wrap theirs the same way."""

    router: Router

    def __call__(self, executor: Any) -> Any:
        return routed(executor, self.router)


class KeyedRoutingExecutor:
    """An executor whose `route(layer, x)` asks a keyed router instead of the model's.

    The engines call `attention(layer, h, positions, segments, kv)` and then `route(layer, x)` on the
    rows that attention returned; this wrapper remembers the (request, position) of each row from the
    attention call, so a replayed or synthetic router can be plugged into any engine without the
    engine knowing. Everything else is delegated to the wrapped executor unchanged.
    """

    def __init__(self, inner: Any, router: Router):
        self._inner = inner
        self._router = router
        self._keys: Optional[tuple[list, list[int]]] = None
        self._arrays = getattr(router, "arrays", None)  # the router's numpy form (ZipfRouting.arrays), if it has one

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._inner, name)
        if getattr(value, "__self__", None) is self._inner:  # a method of the executor's: kept here, so the engine's
            self.__dict__[name] = value                       # next calls of it (per batch) skip this lookup
        return value

    def attention(self, layer: int, h, positions, segments, kv):
        if len(segments) == len(positions):  # decode: one row per segment
            seq_ids = list(map(itemgetter(0), segments))
        else:
            seq_ids = [None] * len(positions)
            for seq, start, n in segments:
                seq_ids[start:start + n] = [seq] * n
        self._keys = (seq_ids, list(positions))
        return self._inner.attention(layer, h, positions, segments, kv)

    def route(self, layer: int, x):
        return self._ask(self._router, layer, x)

    # The routing the engine's dispatches send is this wrapper's (route()), never the inner executor's graph's:
    # the host-routed dispatch takes route()'s ids and weights (as numpy arrays where the router makes them so),
    # the device-routed one packs them with the rows.
    def route_arrays(self, layer: int, x):
        return self._ask(self._arrays or self._router, layer, x)

    def _ask(self, router: Callable, layer: int, x):
        if self._keys is None or len(self._keys[0]) != x.shape[0]:
            raise RuntimeError("KeyedRoutingExecutor.route needs the rows of the preceding attention call")
        seq_ids, positions = self._keys
        return router(layer, x, seq_ids, positions)

    def routed_payload(self, layer: int, x):
        from runtime.core.routed_rows import pack
        ids, weights = self.route(layer, x)
        return pack(x, ids.to(x.device), weights.to(x.device))
