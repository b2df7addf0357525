"""The wire form of a device-routed attention batch (DATAFLOW_DISPATCH=device; benchmarks/NOTES.md §24 item 7).

With a router inside the attention graph, the host learns a batch's routing only after a device -> host copy, and
the two-phase exchange's first phase needs the per-destination sizes: one GPU -> host -> GPU round trip per
attention batch, during which the rank's stream runs dry (NOTES §22 item 2). The device-routed dispatch sends the
whole batch instead, whose size the host knows before the graph runs: T token rows and their top-k expert ids,
to every rank holding experts of the layer, as ONE tensor [T, H + c]: the rows, then the ids as int32 viewed as
the rows' dtype (c = 2k columns for bf16/fp16, k for fp32). Each owner maps the ids to its own experts on the
device and returns all T*k slots' outputs, zero where it holds none (runtime/queues.RoutedItem); the home sums
the parts, and since exactly one part is non-zero at each slot (v + 0 = v exactly) the combine is bit-identical to
the host-routed dispatch.

That packed tensor (the batch's "payload") is the unit from end to end: the CUDA executor's attention graph writes
it into a static buffer (one clone on the host, CudaExecutor.routed_payload), the home sends it and queues it for
its own experts as is, an owner queues a received one as is, and the routed expert graph reads the rows and ids out
of it (one copy in). Each torch call saved is ~10-25 us on the H200 host (benchmarks/NOTES.md §27). `pack` makes
it where no graph did (the CPU executor, eager batches).
"""
from __future__ import annotations

import os

import torch
from torch import Tensor


def device_routed_from_env(auto: bool) -> bool:
    """Whether to use the device-routed dispatch. DATAFLOW_DISPATCH: auto (default: `auto`, the caller's default:
    the plan's choice, which `dataflow compile --dispatch auto` makes device on cuda and host on cpu), host (the
    routing comes to the host, each owner gets its routed rows) or device (the whole batch and its expert ids go to
    every owner, which selects its own slots on the device: no routing round trip). Device on a GPU because there
    the routing is made inside the attention graph and the host would wait for it (2 x H200, run 67: 1.12x against
    1.02x of all-gather EP clean, 3.56x against 1.99x under the compute hog; benchmarks/NOTES.md §26); host on the
    CPU, where the routing is on the host already and the whole batch would only add bytes. auto also picks host
    with DATAFLOW_ASYNC_ROUTE=1, an option of the host-routed dispatch."""
    v = os.environ.get("DATAFLOW_DISPATCH", "auto")
    if v not in ("auto", "host", "device"):
        raise ValueError(f"DATAFLOW_DISPATCH={v!r}: valid values are auto (default: the plan's, device on cuda, host on cpu), "
                         f"host (route on the host) and device (send whole batches with their expert ids; owners "
                         f"select on the device)")
    if v == "auto":
        return auto and os.environ.get("DATAFLOW_ASYNC_ROUTE", "0") != "1"
    return v == "device"


def id_columns(k: int, dtype: torch.dtype) -> int:
    """Columns of `dtype` that k int32 ids take at the end of a packed row (2k for bf16/fp16, k for fp32)."""
    size = torch.empty((), dtype=dtype).element_size()
    if size > 4:
        raise ValueError(f"device-routed dispatch packs expert ids into rows of at most 4 bytes, not {dtype}")
    return k * 4 // size


def pack(x: Tensor, ids: Tensor) -> Tensor:
    """[T, H + c]: x's rows, then the int32 ids viewed as x's dtype (ids: any integer-valued dtype on x's device)."""
    ids32 = ids.to(torch.int32)
    if x.element_size() > 4:
        raise ValueError(f"device-routed dispatch packs expert ids into rows of at most 4 bytes, not {x.dtype}")
    return torch.cat([x, ids32.view(x.dtype)], dim=1)


def unpack(t: Tensor, hidden: int) -> tuple[Tensor, Tensor]:
    """(rows [T, H], ids [T, k] int32) of a packed tensor (views where the layout allows)."""
    tail = t[:, hidden:]
    try:
        ids = tail.view(torch.int32)
    except RuntimeError:  # an odd hidden size leaves the ids' bytes unaligned in the row
        ids = tail.contiguous().view(torch.int32)
    return t[:, :hidden], ids


def ids_of(payload: Tensor, k: int) -> Tensor:
    """The [T, k] int32 expert ids of a payload of top-k routing (its rows' width need not be known)."""
    return unpack(payload, payload.shape[1] - id_columns(k, payload.dtype))[1]
