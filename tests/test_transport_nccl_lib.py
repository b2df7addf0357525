"""runtime/transport/nccl_lib.py on a machine without NCCL: the loader's search and its error, the
dtype map and communicator teardown, and the ctypes
bindings themselves against a fake libnccl compiled here (same C signatures as nccl.h), so a wrong
argtype or a struct passed the wrong way shows up without a GPU. The real library is exercised by
test_transport_dist.py::test_cuda_exchange_direct_nccl (GPU machines only)."""
from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import subprocess
import threading
import time

import pytest
import torch

from runtime.transport import nccl_lib, tensor_links


@pytest.fixture
def fresh_loader(monkeypatch):
    """No cached library, no nccl_library option, and a soname the dynamic loader cannot find (so
    the test means the same on a GPU machine, where the real libnccl.so.2 would load)."""
    monkeypatch.setattr(nccl_lib, "_loaded", None)
    monkeypatch.setattr(nccl_lib, "SONAME", "libnccl-dataflow-test-missing.so.2")
    yield


def test_loader_error_names_every_path_tried(fresh_loader, monkeypatch, tmp_path):
    not_a_lib = tmp_path / "nvidia" / "nccl" / "lib" / "libnccl.so.2"
    not_a_lib.parent.mkdir(parents=True)
    not_a_lib.write_text("not an ELF file")
    missing = str(tmp_path / "torch" / "lib" / "libnccl.so.2")
    monkeypatch.setattr(nccl_lib, "candidate_paths", lambda: [str(not_a_lib), missing])
    with pytest.raises(RuntimeError) as info:
        nccl_lib.load()
    msg = str(info.value)
    assert f"{not_a_lib} (" in msg and f"{missing} (no such file)" in msg, msg
    assert "libnccl-dataflow-test-missing.so.2 (" in msg, msg  # the plain soname, tried last
    assert "option nccl_library" in msg, msg


def test_explicit_library_that_does_not_load_is_an_error_not_a_fallback(fresh_loader, monkeypatch, tmp_path,
                                                                        use_options):
    use_options(nccl_library=str(tmp_path / "nope.so"))
    monkeypatch.setattr(nccl_lib, "candidate_paths", lambda: pytest.fail("searched despite the explicit path"))
    with pytest.raises(RuntimeError, match=r"nccl_library=.*nope\.so"):
        nccl_lib.load()


def test_candidate_paths_scan_sys_path_and_torch_lib(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(tmp_path))
    paths = nccl_lib.candidate_paths()
    assert os.path.join(str(tmp_path), "nvidia", "nccl", "lib", "libnccl.so.2") in paths
    assert os.path.join(os.path.dirname(torch.__file__), "lib", "libnccl.so.2") in paths
    assert len({os.path.realpath(p) for p in paths}) == len(paths)  # no path tried twice


def test_dtype_map_matches_nccl_h():
    assert nccl_lib.NCCL_DTYPES == {
        torch.int8: 0, torch.uint8: 1, torch.int32: 2, torch.uint32: 3, torch.int64: 4, torch.uint64: 5,
        torch.float16: 6, torch.float32: 7, torch.float64: 8, torch.bfloat16: 9}
    # point-to-point moves bytes: an unnamed dtype goes as uint8, numel * element size of them
    assert nccl_lib.wire_count(torch.zeros(3, 5, dtype=torch.float32)) == (15, 7)
    assert nccl_lib.wire_count(torch.zeros(4, dtype=torch.int16)) == (8, 1)
    assert nccl_lib.wire_count(torch.zeros(4, dtype=torch.bool)) == (4, 1)
    assert nccl_lib.wire_count(torch.zeros(2, dtype=torch.complex64)) == (16, 1)


def test_decode_version_both_encodings():
    assert nccl_lib.decode_version(2708) == (2, 7, 8)  # X*1000+Y*100+Z up to 2.8
    assert nccl_lib.decode_version(22105) == (2, 21, 5)  # X*10000+Y*100+Z from 2.9


def test_close_comms_destroys_in_order_aborts_after_failure_and_never_hangs(capsys):
    calls = []

    class Comm:
        def __init__(self, name, hang=False):
            self.name, self.hang = name, hang

        def destroy(self):
            calls.append(("destroy", self.name))
            if self.hang:
                threading.Event().wait()  # a peer that never closes: the barrier inside never returns

        def abort(self):
            calls.append(("abort", self.name))

    links = tensor_links.TensorLinks.__new__(tensor_links.TensorLinks)
    links.rank = 0
    links.comms = [Comm("0->1"), Comm("1->0")]
    links.close(True, 1.0)
    assert calls == [("destroy", "0->1"), ("destroy", "1->0")] and links.comms == []
    assert links.teardown == "destroyed"
    calls.clear()
    links.comms = [Comm("0->1"), Comm("1->0")]
    links.close(False, 10.0)
    assert calls == [("abort", "0->1"), ("abort", "1->0")] and links.teardown == "aborted"
    links.comms = [Comm("0->1", hang=True)]
    t0 = time.monotonic()
    links.close(True, 0.2)
    assert time.monotonic() - t0 < 2.0
    assert "still running after 0.2 s" in capsys.readouterr().err
    assert links.teardown == "destroyed timed out"


# ------------------------------------------------------------------ the bindings, against a fake libnccl
FAKE_NCCL_C = r"""
#include <stddef.h>
#include <string.h>
typedef struct { char internal[128]; } ncclUniqueId;
int fail_next = 0, async_error = 0, destroyed = 0, aborted = 0;
int init_nranks = -1, init_rank = -1; char init_id[128];
int op_kind = 0, op_dtype = -1, op_peer = -1; const void* op_ptr; size_t op_count; void* op_comm; void* op_stream;
static int comms[2];
int ncclGetVersion(int* v) { *v = FAKE_VERSION; return 0; }
int ncclGetUniqueId(ncclUniqueId* id) { for (int i = 0; i < 128; i++) id->internal[i] = (char)(i * 7 + 1); return 0; }
int ncclCommInitRank(void** comm, int nranks, ncclUniqueId id, int rank) {
  memcpy(init_id, id.internal, 128); init_nranks = nranks; init_rank = rank; *comm = &comms[rank]; return 0; }
static int op(int kind, const void* p, size_t c, int d, int peer, void* comm, void* st) {
  if (fail_next) { int r = fail_next; fail_next = 0; return r; }
  op_kind = kind; op_ptr = p; op_count = c; op_dtype = d; op_peer = peer; op_comm = comm; op_stream = st; return 0; }
int ncclSend(const void* p, size_t c, int d, int peer, void* comm, void* st) { return op(1, p, c, d, peer, comm, st); }
int ncclRecv(void* p, size_t c, int d, int peer, void* comm, void* st) { return op(2, p, c, d, peer, comm, st); }
int ncclGroupStart(void) { return 0; }
int ncclGroupEnd(void) { return 0; }
int ncclCommDestroy(void* c) { destroyed++; return 0; }
int ncclCommAbort(void* c) { aborted++; return 0; }
int ncclCommGetAsyncError(void* c, int* e) { *e = async_error; return 0; }
const char* ncclGetErrorString(int r) { return r == 6 ? "remote process exited or there was a network error" : "other"; }
"""


def _build_fake(tmp_path, version: int) -> str:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the fake libnccl")
    src = tmp_path / "fake_nccl.c"
    src.write_text(FAKE_NCCL_C)
    out = tmp_path / f"libnccl-fake-{version}.so"
    subprocess.run([cc, "-shared", "-fPIC", f"-DFAKE_VERSION={version}", "-o", str(out), str(src)], check=True)
    return str(out)


class _FakeStream:
    cuda_stream = 0x5EED


def test_bindings_against_a_fake_libnccl(tmp_path, monkeypatch, fresh_loader, use_options):
    path = _build_fake(tmp_path, 22105)
    use_options(nccl_library=path)
    lib = nccl_lib.load()
    assert lib.version == (2, 21, 5) and nccl_lib.load() is lib
    c = ctypes.CDLL(path)  # the same handle: its globals are the fake's record of the last call
    uid = lib.unique_id()
    assert uid == bytes((i * 7 + 1) & 0xFF for i in range(128))
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())  # no GPU here
    pair = nccl_lib.NcclPairComm(lib, uid, 1, torch.device("cuda", 0), name="0->1")
    assert (ctypes.c_int.in_dll(c, "init_nranks").value, ctypes.c_int.in_dll(c, "init_rank").value) == (2, 1)
    assert bytes((ctypes.c_char * 128).in_dll(c, "init_id")) == uid  # the struct went by value, intact
    comm_addr = pair.comm.value

    def last_op():
        return (ctypes.c_int.in_dll(c, "op_kind").value, ctypes.c_void_p.in_dll(c, "op_ptr").value,
                ctypes.c_size_t.in_dll(c, "op_count").value, ctypes.c_int.in_dll(c, "op_dtype").value,
                ctypes.c_int.in_dll(c, "op_peer").value, ctypes.c_void_p.in_dll(c, "op_comm").value,
                ctypes.c_void_p.in_dll(c, "op_stream").value)

    t = torch.zeros(3, 4, dtype=torch.bfloat16)
    pair.send(t, _FakeStream())
    assert last_op() == (1, t.data_ptr(), 12, 9, 0, comm_addr, 0x5EED)
    r = torch.zeros(5, dtype=torch.int16)
    pair.recv(r, _FakeStream())
    assert last_op() == (2, r.data_ptr(), 10, 1, 0, comm_addr, 0x5EED)

    ctypes.c_int.in_dll(c, "fail_next").value = 6
    with pytest.raises(RuntimeError, match=r"ncclRecv failed: remote process exited .*ncclResult_t 6"):
        pair.recv(r, _FakeStream())
    assert pair.error() is None
    ctypes.c_int.in_dll(c, "async_error").value = 6
    assert "remote process exited" in pair.error()
    ctypes.c_int.in_dll(c, "async_error").value = 0

    pair.destroy()
    pair.destroy()  # idempotent
    assert ctypes.c_int.in_dll(c, "destroyed").value == 1
    other = nccl_lib.NcclPairComm(lib, uid, 0, torch.device("cuda", 0))
    assert other.peer == 1
    other.abort()
    assert ctypes.c_int.in_dll(c, "aborted").value == 1


def test_too_old_library_is_refused(tmp_path):
    path = _build_fake(tmp_path, 2604)  # NCCL 2.6.4: no ncclSend/ncclRecv yet
    with pytest.raises(RuntimeError, match=r"NCCL 2\.6\.4 has no ncclSend"):
        nccl_lib.NcclLib(path)
