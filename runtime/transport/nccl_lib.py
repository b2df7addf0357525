"""The NCCL C library through ctypes: point-to-point send/recv without torch.distributed per message.

Why: inside a busy rank `dist.isend` costs ~120-130 us of host time per call and `dist.irecv`
~100-120 us (c10d's Work object, record_param_comms, its stream bookkeeping), while the NCCL call
underneath is ~10-20 us. The transport's tensor links (tensor_links.py) already own the streams, events
and ordering, so they call ncclSend/ncclRecv themselves: the only path for CUDA ranks.

Loading (`load()`): the library named by the option nccl_library if set (and only it: an explicit
choice that fails is an error, not a silent fallback); otherwise the copy torch's wheel uses
(nvidia/nccl/lib/libnccl.so.2 in an installed package), torch/lib, then "libnccl.so.2" through the
dynamic loader. The same file torch already loaded gives the same handle, so normally one NCCL lives
in the process. Every call that returns a non-success ncclResult_t raises RuntimeError naming the
call and NCCL's error string. Signatures and enum values: nccl.h of NCCL 2.x (send/recv: >= 2.7).
"""
from __future__ import annotations

import ctypes
import importlib.util
import os
import sys
from typing import Optional

import torch

from runtime import settings

SONAME = "libnccl.so.2"
MIN_VERSION = (2, 7, 0)  # ncclSend / ncclRecv

_result_t = ctypes.c_int
_comm_t = ctypes.c_void_p
_stream_t = ctypes.c_void_p


class NcclUniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * 128)]  # NCCL_UNIQUE_ID_BYTES


# ncclDataType_t (nccl.h, NCCL 2.x).
NCCL_DTYPES = {
    torch.int8: 0, torch.uint8: 1, torch.int32: 2, torch.uint32: 3, torch.int64: 4, torch.uint64: 5,
    torch.float16: 6, torch.float32: 7, torch.float64: 8, torch.bfloat16: 9,
}
_NCCL_UINT8 = 1


def wire_count(tensor: torch.Tensor) -> tuple[int, int]:
    """(count, ncclDataType_t) to move `tensor`. Point-to-point copies bytes, the type only sets the
    element size, so a dtype NCCL does not name (bool, int16, float8, complex) goes as uint8 bytes;
    sender and receiver apply the same rule to the same dtype, so their counts match."""
    code = NCCL_DTYPES.get(tensor.dtype)
    if code is None:
        return tensor.numel() * tensor.element_size(), _NCCL_UINT8
    return tensor.numel(), code


def decode_version(code: int) -> tuple[int, int, int]:
    # NCCL_VERSION(X,Y,Z): X*1000+Y*100+Z up to 2.8, X*10000+Y*100+Z from 2.9 on.
    if code >= 10000:
        return code // 10000, code % 10000 // 100, code % 100
    return code // 1000, code % 1000 // 100, code % 100


def candidate_paths() -> list[str]:
    """Where to look for the library, in order (the option nccl_library is handled by load())."""
    try:  # the nvidia-nccl-cu* wheel torch depends on; "nvidia" is a namespace package (find_spec: None if absent)
        locs = importlib.util.find_spec("nvidia.nccl").submodule_search_locations or []
    except (ImportError, ValueError, AttributeError):
        locs = []
    paths = [os.path.join(loc, "lib", SONAME) for loc in locs]
    # the same wheel when find_spec could not see it (e.g. no __init__ files)
    paths += [os.path.join(entry, "nvidia", "nccl", "lib", SONAME) for entry in sys.path if entry]
    paths.append(os.path.join(os.path.dirname(torch.__file__), "lib", SONAME))  # builds that bundle it
    real = [os.path.realpath(p) for p in paths]
    return [p for i, p in enumerate(paths) if real.index(real[i]) == i]  # each file once, as first named


class NcclLib:
    """One loaded libnccl with the functions the transport needs bound (argtypes set, so a wrong
    Python argument fails in ctypes instead of corrupting the call)."""

    def __init__(self, path: str):
        self.path = path
        lib = ctypes.CDLL(path)  # CDLL releases the GIL during each call
        P = ctypes.POINTER

        def bind(name, restype, *argtypes):
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = restype, list(argtypes)
            if restype is _result_t:  # a call that does not return ncclSuccess raises (see _errcheck)
                fn.errcheck = self._errcheck
            return fn

        self._get_error_string = bind("ncclGetErrorString", ctypes.c_char_p, _result_t)
        self._get_version = bind("ncclGetVersion", _result_t, P(ctypes.c_int))
        self._get_unique_id = bind("ncclGetUniqueId", _result_t, P(NcclUniqueId))
        self._comm_init_rank = bind("ncclCommInitRank", _result_t, P(_comm_t), ctypes.c_int, NcclUniqueId, ctypes.c_int)
        # send / recv (ptr, count, ncclDataType_t, peer, comm, stream), comm_destroy / comm_abort (comm)
        self.send = bind("ncclSend", _result_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                         _comm_t, _stream_t)
        self.recv = bind("ncclRecv", _result_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                         _comm_t, _stream_t)
        self.comm_destroy = bind("ncclCommDestroy", _result_t, _comm_t)
        self.comm_abort = bind("ncclCommAbort", _result_t, _comm_t)
        self._comm_get_async_error = bind("ncclCommGetAsyncError", _result_t, _comm_t, P(_result_t))
        v = ctypes.c_int()
        self._get_version(ctypes.byref(v))
        self.version = decode_version(v.value)
        if self.version < MIN_VERSION:
            raise RuntimeError(f"{path}: NCCL {'.'.join(map(str, self.version))} has no ncclSend/ncclRecv "
                               f"(needs >= {'.'.join(map(str, MIN_VERSION))})")

    def error_string(self, result: int) -> str:
        text = self._get_error_string(result)
        return text.decode(errors="replace") if text else f"ncclResult_t {result}"

    def _errcheck(self, result: int, fn, args) -> int:
        """ctypes' check after every call of a bound function: RuntimeError naming the call and NCCL's error."""
        if result != 0:
            call = fn.__name__ + (f"(nranks={args[1]}, rank={args[3]})" if fn.__name__ == "ncclCommInitRank" else "")
            raise RuntimeError(f"{call} failed: {self.error_string(result)} (ncclResult_t {result})")
        return result

    def unique_id(self) -> bytes:
        uid = NcclUniqueId()
        self._get_unique_id(ctypes.byref(uid))
        return bytes(uid.internal)

    def comm_init_rank(self, nranks: int, unique_id: bytes, rank: int) -> ctypes.c_void_p:
        """Blocking and collective: returns once all `nranks` ranks called it with the same id."""
        if len(unique_id) != ctypes.sizeof(NcclUniqueId):
            raise ValueError(f"an ncclUniqueId is {ctypes.sizeof(NcclUniqueId)} bytes, got {len(unique_id)}")
        comm = _comm_t()
        self._comm_init_rank(ctypes.byref(comm), nranks, NcclUniqueId.from_buffer_copy(unique_id), rank)
        return comm

    def comm_async_error(self, comm) -> int:
        err = _result_t()
        self._comm_get_async_error(comm, ctypes.byref(err))
        return err.value


_loaded: Optional[NcclLib] = None


def load() -> NcclLib:
    """The process's NcclLib (loaded once). RuntimeError listing every path tried when none loads."""
    global _loaded
    if _loaded is not None:
        return _loaded
    explicit = settings.current().nccl_library
    if explicit:
        try:
            _loaded = NcclLib(explicit)
        except (OSError, AttributeError, RuntimeError) as err:
            raise RuntimeError(f"cannot load NCCL from nccl_library={explicit}: {err}") from err
        return _loaded
    tried = []
    for path in candidate_paths() + [SONAME]:
        if path != SONAME and not os.path.exists(path):
            tried.append(f"{path} (no such file)")
            continue
        try:
            _loaded = NcclLib(path)
            return _loaded
        except (OSError, AttributeError, RuntimeError) as err:
            tried.append(f"{path} ({err})")
    raise RuntimeError(f"cannot load the NCCL library ({SONAME}); tried: " + "; ".join(tried) +
                       ". Set the option nccl_library to its path.")


class NcclPairComm:
    """A 2-rank NCCL communicator for one directed pair of the transport: the sender is rank 0, the
    receiver rank 1, so each side's peer is the other rank. Created with the owning rank's CUDA device
    current (NCCL binds a communicator to the device current at ncclCommInitRank). One communicator
    used from one stream runs its operations in posting order, which is the transport's FIFO."""

    def __init__(self, lib: NcclLib, unique_id: bytes, rank: int, device: torch.device, name: str = ""):
        self.lib = lib
        self.rank = rank
        self.peer = 1 - rank
        self.name = name
        with torch.cuda.device(device):
            self.comm = lib.comm_init_rank(2, unique_id, rank)

    def send(self, tensor: torch.Tensor, stream: torch.cuda.Stream) -> None:
        count, dtype = wire_count(tensor)
        self.lib.send(tensor.data_ptr(), count, dtype, self.peer, self.comm, stream.cuda_stream)

    def recv(self, tensor: torch.Tensor, stream: torch.cuda.Stream) -> None:
        count, dtype = wire_count(tensor)
        self.lib.recv(tensor.data_ptr(), count, dtype, self.peer, self.comm, stream.cuda_stream)

    def error(self) -> Optional[str]:
        """NCCL's asynchronous error on this communicator (a failed transfer), or None."""
        if self.comm is None:  # already destroyed or aborted
            return None
        code = self.lib.comm_async_error(self.comm)
        return None if code in (0, 7) else self.lib.error_string(code)  # 7: ncclInProgress, not an error

    def destroy(self) -> None:
        """Clean teardown. Waits for this communicator's outstanding operations and, on one host, for
        the peer's destroy of the same communicator (an intra-node barrier inside NCCL)."""
        comm, self.comm = self.comm, None
        if comm is not None:
            self.lib.comm_destroy(comm)

    def abort(self) -> None:
        """Teardown after a failure: stops outstanding operations, waits for nobody."""
        comm, self.comm = self.comm, None
        if comm is not None:
            self.lib.comm_abort(comm)
