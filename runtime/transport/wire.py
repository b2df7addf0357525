"""The wire format of the metadata phase: authenticated, versioned frames that carry data, never code.

Every ZeroMQ frame a rank sends is

    prefix (struct "<2sBBHq", 14 bytes): magic b"DF", VERSION, kind, src rank, seq
    body   (msgpack): [meta, shape, dtype]  (meta: a map of plain values; shape/dtype: the tensor phase 2 moves)
    tag    (16 bytes): keyed BLAKE2b over prefix + body, with the run's secret

Decoding checks, in this order and before anything is interpreted: the frame's size (at most `max_frame_bytes`;
ZeroMQ's MAXMSGSIZE drops a larger one before it is even buffered), the tag (constant-time compare), the prefix,
then msgpack with every container length bounded by the frame's size (a declared length cannot make it allocate
more than the frame holds), then the fields: kind, src in the world and not the receiver, the shape (at most
MAX_DIMS dimensions, each below 2**31, at most MAX_TENSOR_BYTES) and the dtype (DTYPES), and, for the message kinds
the runtime sends (MESSAGES), every meta key and its type. msgpack decodes maps, arrays, strings, bytes, numbers,
booleans and None, plus one extension, a numpy array of a whitelisted dtype (EXT_NDARRAY): no object is ever
constructed by name, so no frame can run code (pickle could: vLLM CVE-2025-30165, CVE-2024-11041).

A frame whose size, tag or prefix is wrong did not come from this run: `WireError(authenticated=False)`, which the
transport drops and counts. Anything wrong after the tag verified came from a peer holding the run's secret, so
it is that peer's bug: `WireError(authenticated=True)`, which the transport turns into a failure naming the peer.

msgpack arrays decode as tuples (use_list=False): the engine's run-form row tags `(first, count)` stay tuples, and a
receiver that keeps a sequence converts it (`list(meta["output"])`).
"""
from __future__ import annotations

import dataclasses
import hashlib
import hmac
import math
import struct
from collections import deque
from typing import Any, NamedTuple, Optional

import msgpack
import numpy as np

VERSION = 1
MAGIC = b"DF"
DATA, HEARTBEAT, BYE, ABORT = 0, 1, 2, 3
KINDS = (DATA, HEARTBEAT, BYE, ABORT)
TAG_BYTES = 16
SECRET_BYTES = 32
# A frame carries metadata only (tensors move in phase 2); the largest the runtime sends is a rank's end-of-workload
# report with its trace ring (runtime/observability/trace.py), a few MB. 64 MiB refuses a hostile 1.5 GB frame at the socket.
DEFAULT_MAX_FRAME_BYTES = 64 << 20
MAX_DIMS = 8
MAX_TENSOR_BYTES = 1 << 40
# torch dtype names a phase-2 tensor may have (str(torch.dtype) without "torch.").
DTYPES = frozenset({"float32", "float16", "bfloat16", "float64", "int8", "uint8", "int16", "int32", "int64", "bool",
                    "float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64"})
EXT_NDARRAY = 1
# numpy dtypes an EXT_NDARRAY may carry (dtype.str): ids, tags, token ids, times.
_ARRAY_DTYPES = frozenset({"<i8", "<i4", "<i2", "|i1", "|u1", "<u2", "<u4", "<u8", "<f4", "<f8", "|b1"})
_PREFIX = struct.Struct("<2sBBHq")
_SEQ_MIN = -1  # BYE / ABORT / HEARTBEAT carry -1


class WireError(ValueError):
    """A frame that cannot be accepted. `authenticated`: its tag verified (a peer of this run sent it), so
    the error is that peer's; otherwise it is a stray or hostile frame to drop."""

    def __init__(self, reason: str, authenticated: bool, src: Optional[int] = None):
        super().__init__(reason)
        self.authenticated = authenticated
        self.src = src


class Frame(NamedTuple):
    kind: int
    src: int
    seq: int
    meta: Any
    shape: Optional[tuple]
    dtype: Optional[str]


# ---------------------------------------------------------------------------------------------- message schema
# The metadata of every message kind the runtime sends (meta["t"] -> key -> (type(s), required)). The engine's
# data messages (runtime/core/engine.py) and the rank processes' control protocol (runtime/drivers/control.py). "seq" is
# a msgpack array (a tuple here); "any" a plain value checked by its receiver. A message whose "t" is not listed
# (the lab's barrier baselines, benchmarks/transport_bench.py) gets the codec's guarantees only.
_INT, _NUM, _STR, _BYTES, _SEQ, _MAP, _ANY = (int,), (int, float), (str,), (bytes,), (tuple,), (dict,), None
_ROWS = (tuple, np.ndarray)  # merge tags: (first, count) or an int64 array (runtime/core/expert_wire.py)
MESSAGES: dict[str, dict[str, tuple]] = {
    # engine data (the tensor travels in phase 2)
    "x": {"t": (_STR, True), "layer": (_INT, True), "home": (_INT, True), "rows": (_ROWS, True), "e": (_BYTES, True),
          "more": (_NUM, True), "next": (_NUM, False), "d": (_INT, False)},
    "r": {"t": (_STR, True), "layer": (_INT, True), "home": (_INT, True), "rows": (_SEQ, True), "more": (_NUM, True),
          "d": (_INT, False)},
    "y": {"t": (_STR, True), "layer": (_INT, True), "rows": (_ROWS, True)},
    "n": {"t": (_STR, True), "layer": (_INT, True), "home": (_INT, True)},
    # rank-process control
    "ready": {"t": (_STR, True), "kv_blocks": (_INT, True), "w": (_INT, True)},
    "sync": {"t": (_STR, True), "now": (_NUM, True), "w": (_INT, True)},
    "synced": {"t": (_STR, True), "w": (_INT, True)},
    "adm": {"t": (_STR, True), "w": (_INT, True), "req": (_MAP, True)},
    "fin": {"t": (_STR, True), "w": (_INT, True), "rid": (_INT, True), "output": (_SEQ, True), "reason": (_STR, True),
            "t_admit": (_NUM, True), "t_finish": (_NUM, True), "token_times": (_SEQ, True),
            "tokens": (_INT, True)},
    "stop": {"t": (_STR, True), "w": (_INT, True)},
    # the serving front's channel (runtime/drivers/front_link.py)
    "fsub": {"t": (_STR, True), "req": (_MAP, True)},
    "fcan": {"t": (_STR, True), "rid": (_INT, True)},
    "fbye": {"t": (_STR, True)},
    "fready": {"t": (_STR, True), "ranks": (_INT, True)},
    "ftok": {"t": (_STR, True), "rid": (_SEQ, True), "toks": (_SEQ, True)},
    "ffin": {"t": (_STR, True), "rid": (_INT, True), "reason": (_STR, True), "n": (_INT, True),
             "error": (_STR, False)},
    "fstat": {"t": (_STR, True), "waiting": (_INT, True), "running": (_INT, True), "free_kv": (_SEQ, True),
              "tokens": (_INT, True), "queued": (_SEQ, True)},
    "cancel": {"t": (_STR, True), "w": (_INT, True), "rid": (_INT, True)},
    "done": {"t": (_STR, True), "w": (_INT, True), "metrics": (_MAP, True), "trace": (_ANY, True),
             "data_messages": (_INT, True), "dispatch": (_ANY, True), "listening": (_ANY, False),
             "dropped": (_INT, False), "startup": (_MAP, False)},
}
_CONTROL_META = {
    HEARTBEAT: {"p": (_INT, True), "w": (_INT, True), "k": (_INT, True), "q": (_INT, True)},
    ABORT: {"reason": (_STR, True), "culprit": (_ANY, True)},
}
MAX_REASON_CHARS = 4000


def _schema(fields: dict[str, tuple]) -> tuple[frozenset, dict]:
    """One message kind's (required keys, key -> types), arranged for a check per frame that costs about a
    microsecond."""
    return frozenset(k for k, (_, req) in fields.items() if req), {k: types for k, (types, _) in fields.items()}


def _check_fields(meta: Any, schema: tuple[frozenset, dict], what: str) -> None:
    if type(meta) is not dict:
        raise ValueError(f"{what}: meta is a {type(meta).__name__}, not a map")
    required, types = schema
    if not required <= meta.keys() or not meta.keys() <= types.keys():
        missing, extra = required - meta.keys(), meta.keys() - types.keys()
        raise ValueError(f"{what}: meta lacks {sorted(missing)}" if missing else
                         f"{what}: unknown meta key(s) {sorted(map(str, extra))[:4]}")
    for key, value in meta.items():
        want = types[key]
        if want is not None and type(value) not in want:  # exact types: True is not an int here
            raise ValueError(f"{what}: meta[{key!r}] is a {type(value).__name__}, expected "
                             f"{' or '.join(t.__name__ for t in want)}")


_SCHEMAS = {t: _schema(fields) for t, fields in MESSAGES.items()}
_CONTROL_SCHEMAS = {kind: _schema(fields) for kind, fields in _CONTROL_META.items()}


def check_meta(kind: int, meta: Any) -> None:
    """Raise ValueError if `meta` does not fit its message kind's schema."""
    if kind == DATA:
        if type(meta) is not dict:
            raise ValueError("data meta must be a map with string keys")
        t = meta.get("t")
        schema = _SCHEMAS.get(t) if type(t) is str else None
        if schema is not None:
            _check_fields(meta, schema, f"message {t!r}")  # (its keys are all known strings then)
        elif any(type(k) is not str for k in meta):
            raise ValueError("data meta must be a map with string keys")
    elif kind in _CONTROL_SCHEMAS:
        _check_fields(meta, _CONTROL_SCHEMAS[kind], "heartbeat" if kind == HEARTBEAT else "abort notice")
        if kind == ABORT:
            culprit = meta["culprit"]
            if culprit is not None and type(culprit) is not int:
                raise ValueError(f"abort notice: culprit {culprit!r} is not a rank")
            if len(meta["reason"]) > MAX_REASON_CHARS:
                raise ValueError(f"abort notice: reason longer than {MAX_REASON_CHARS} characters")
    elif meta is not None:
        raise ValueError("a goodbye carries no meta")


# ---------------------------------------------------------------------------------------------- values
def _default(obj):
    """Values msgpack does not know natively: numpy arrays (an extension) and numpy scalars (plain numbers)."""
    if isinstance(obj, np.ndarray):
        arr = np.ascontiguousarray(obj)
        if arr.dtype.str not in _ARRAY_DTYPES or arr.ndim != 1:
            raise TypeError(f"cannot send a numpy array of dtype {arr.dtype} and {arr.ndim} dimensions")
        return msgpack.ExtType(EXT_NDARRAY, arr.dtype.str.encode() + arr.tobytes())
    if isinstance(obj, deque):  # a bounded record ring (runtime/observability/metrics.py): a plain array
        return list(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):  # a record: its fields, as a map
        return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    if isinstance(obj, (np.integer, np.floating, np.bool_)):
        return obj.item()  # the plain int / float / bool
    raise TypeError(f"cannot send a {type(obj).__name__} in a message (plain values and 1-d numpy arrays only)")


def _ext_hook(code: int, data: bytes):
    if code != EXT_NDARRAY or len(data) < 3 or data[:3].decode("latin-1") not in _ARRAY_DTYPES:
        raise ValueError(f"unknown msgpack extension {code}")
    dtype = np.dtype(data[:3].decode())
    if (len(data) - 3) % dtype.itemsize:
        raise ValueError("a numpy array's bytes are not a whole number of items")
    return np.frombuffer(data, dtype=dtype, offset=3)


# ---------------------------------------------------------------------------------------------- frames
class Codec:
    """Encodes and decodes one run's frames for one receiver (`rank` in a world of `world_size`)."""

    def __init__(self, secret: bytes, rank: int, world_size: int, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES):
        if len(secret) < 16:
            raise ValueError("the run secret must be at least 16 bytes")
        self._key = bytes(secret[:64])  # BLAKE2b takes keys of up to 64 bytes
        self.rank = rank
        self.world_size = world_size
        self.max_frame_bytes = max_frame_bytes
        self._packer = msgpack.Packer(default=_default, use_bin_type=True)

    def _tag(self, body: bytes) -> bytes:
        return hashlib.blake2b(body, key=self._key, digest_size=TAG_BYTES).digest()

    def encode(self, kind: int, seq: int, meta: Any = None, shape: Optional[tuple] = None,
               dtype: Optional[str] = None) -> bytes:
        body = _PREFIX.pack(MAGIC, VERSION, kind, self.rank, seq) + self._packer.pack((meta, shape, dtype))
        if len(body) + TAG_BYTES > self.max_frame_bytes:
            raise ValueError(f"rank {self.rank}: a message of {len(body) + TAG_BYTES} bytes exceeds the frame cap "
                             f"of {self.max_frame_bytes} bytes (meta {str(meta)[:120]})")
        return body + self._tag(body)

    def decode(self, raw: bytes) -> Frame:
        n = len(raw)
        if n > self.max_frame_bytes:
            raise WireError(f"frame of {n} bytes over the {self.max_frame_bytes}-byte cap", False)
        if n < _PREFIX.size + TAG_BYTES:
            raise WireError(f"frame of {n} bytes is shorter than any valid frame", False)
        body = memoryview(raw)[:n - TAG_BYTES]
        if not hmac.compare_digest(self._tag(body), raw[n - TAG_BYTES:]):
            raise WireError("frame failed authentication (not signed with this run's secret)", False)
        magic, version, kind, src, seq = _PREFIX.unpack_from(body)
        if magic != MAGIC or version != VERSION:
            raise WireError(f"frame of wire version {version} (this rank speaks {VERSION})", True)
        if not (0 <= src < self.world_size and src != self.rank):
            raise WireError(f"frame claims to come from rank {src} (world {self.world_size}, this is rank "
                            f"{self.rank})", True)
        try:
            if kind not in KINDS:
                raise ValueError(f"unknown frame kind {kind}")
            if seq < (0 if kind == DATA else _SEQ_MIN):
                raise ValueError(f"sequence number {seq}")
            limit = len(body)
            decoded = msgpack.unpackb(body[_PREFIX.size:], use_list=False, raw=False, strict_map_key=False,
                                      ext_hook=_ext_hook, max_str_len=limit,
                                      max_bin_len=limit, max_array_len=limit, max_map_len=limit, max_ext_len=limit)
            if type(decoded) is not tuple or len(decoded) != 3:
                raise ValueError("body is not [meta, shape, dtype]")
            meta, shape, dtype = decoded
            check_meta(kind, meta)
            if shape is not None or dtype is not None:
                _check_tensor(kind, shape, dtype)
        except WireError:
            raise
        except Exception as err:  # msgpack's own errors (ExtraData, FormatError, ValueError...) and ours
            raise WireError(f"malformed {_KIND_NAMES.get(kind, 'frame')} #{seq}: {type(err).__name__}: {err}",
                            True, src) from None
        return Frame(kind, src, seq, meta, shape, dtype)


_KIND_NAMES = {DATA: "message", HEARTBEAT: "heartbeat", BYE: "goodbye", ABORT: "abort notice"}


def _check_tensor(kind: int, shape, dtype) -> None:
    if kind != DATA:
        raise ValueError("only data messages carry a tensor")
    if type(shape) is not tuple or not 0 < len(shape) <= MAX_DIMS \
            or any(type(d) is not int or not 0 <= d < 1 << 31 for d in shape):
        raise ValueError(f"tensor shape {shape!r}")
    if type(dtype) is not str or dtype not in DTYPES:
        raise ValueError(f"tensor dtype {dtype!r}")
    if math.prod(shape) * 8 > MAX_TENSOR_BYTES:
        raise ValueError(f"tensor of shape {shape} is over {MAX_TENSOR_BYTES} bytes")


def new_secret() -> bytes:
    import secrets
    return secrets.token_bytes(SECRET_BYTES)
