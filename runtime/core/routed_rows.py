"""The wire form of a device-routed attention batch (the `dispatch` option's device form).

With a router inside the attention graph, the host learns a batch's routing only after a device -> host copy, and
the two-phase exchange's first phase needs the per-destination sizes: one GPU -> host -> GPU round trip per
attention batch, during which the rank's stream runs dry. The device-routed dispatch sends the
whole batch instead, whose size the host knows before the graph runs: T token rows with their top-k expert ids and
routing weights, to every rank holding experts of the layer, as ONE tensor [T, H + c] (the batch's "payload"): the
rows, then the ids as int32 and the weights as fp32, both viewed as the rows' dtype (c = 4k columns for bf16/fp16,
2k for fp32).

Each holder runs the slots of its own experts on the device and returns, per token, the weighted sum of its slots'
outputs in slot order (fp32, then the rows' dtype; zero where it holds none of the token's experts): T rows back,
not T*k. The home's merge sees the holders as the "slots" of a token (runtime/core/merge.py, `holders`) and its combine
adds their partial sums, in holder order, to the residual: h_res + (p_0 + p_1 + ... + shared). That is the same
sum as the host-routed dispatch's in another order of additions (not bit-identical to it; equal on one holder), and
with bf16 rows each partial sum is rounded once more before it travels. In exchange the combine's bytes on the link
are 1/k of every slot's.

The payload is the unit from end to end: the CUDA executor's attention graph writes it into a static buffer (one
clone on the host, CudaExecutor.routed_payload), the home sends it and queues it for its own experts as is, an
owner queues a received one as is, and the routed expert graph reads rows, ids and weights out of it (one copy in).
Each torch call saved is ~10-25 us on the H200 host. `pack` makes it where no graph did (the CPU executor, eager
batches).
"""
from __future__ import annotations

import torch
from torch import Tensor

from runtime import settings


def use_device_routing(plan_default: bool) -> bool:
    """Whether to use the device-routed dispatch: the `dispatch` option (runtime/settings.py) when it names one,
    else `plan_default` (the plan's choice, which `dataflow compile --dispatch auto` makes device on cuda and host
    on cpu). Device on a GPU because there the routing is made inside the attention graph and the host would wait
    for it (on 2 x H200 1.12x against 1.02x of all-gather EP clean, 3.56x against 1.99x under a compute hog); host
    on the CPU, where the routing is on the host already and the whole batch would only add bytes."""
    choice = settings.current().dispatch
    return plan_default if choice == "auto" else choice == "device"


def payload_columns(k: int, dtype: torch.dtype) -> int:
    """Columns of `dtype` that k int32 ids and k fp32 weights take at the end of a payload row (4k for bf16/fp16,
    2k for fp32)."""
    size = torch.empty((), dtype=dtype).element_size()
    if size > 4:
        raise ValueError(f"device-routed dispatch packs expert ids into rows of at most 4 bytes, not {dtype}")
    return 2 * k * 4 // size


def pack_tail(ids: Tensor, weights: Tensor, dtype: torch.dtype) -> Tensor:
    """[T, c]: the int32 ids, then the fp32 weights, viewed as `dtype` (a payload row's last c columns; ids any
    integer-valued dtype, weights any float dtype)."""
    payload_columns(1, dtype)  # (the dtype check)
    return torch.cat([ids.to(torch.int32).view(torch.float32), weights.to(torch.float32)], dim=1).view(dtype)


def pack(x: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
    """[T, H + c]: x's rows, then pack_tail's columns (ids and weights on x's device)."""
    return torch.cat([x, pack_tail(ids, weights, x.dtype)], dim=1)


def unpack(t: Tensor, hidden: int) -> tuple[Tensor, Tensor, Tensor]:
    """(rows [T, H], ids [T, k] int32, weights [T, k] fp32) of a payload (views where the layout allows)."""
    tail = t[:, hidden:]
    try:
        tail = tail.view(torch.int32)
    except RuntimeError:  # an odd hidden size leaves the tail's bytes unaligned in the row
        tail = tail.contiguous().view(torch.int32)
    k = tail.shape[1] // 2
    return t[:, :hidden], tail[:, :k], tail[:, k:].view(torch.float32)


def ids_of(payload: Tensor, k: int) -> Tensor:
    """The [T, k] int32 expert ids of a payload of top-k routing (its rows' width need not be known)."""
    return unpack(payload, payload.shape[1] - payload_columns(k, payload.dtype))[1]
