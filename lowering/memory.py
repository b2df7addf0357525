"""Memory pass: per-rank budget (weights, graphs, workspace, KV cache) and the KV page count.

Every rank holds the replicated part (embedding, head, attention, routers, shared/dense MLPs:
attention is data-parallel) plus only the experts placed on it. What is left after weights, CUDA
graph memory and a batch workspace becomes KV cache, in pages of `block_size` tokens. A rank that
cannot hold the KV of `min_kv_tokens` tokens cannot serve a request, so the plan is refused with
the rank, the bytes needed and the bytes available.
A rank's experts are the expert nodes of the dataflow graph that run on it, replicas included.
With attention_ranks (disaggregation) every rank is still budgeted the replicated weights and a KV pool, because
that is what the runtime loads today; trimming attention weights and KV from expert-only ranks is later work.
"""
from __future__ import annotations

from collections import Counter

import networkx as nx

from graph_ir.errors import UserError
from graph_ir.spec import ModelSpec
from lowering import sizes
from lowering.plan import BatchCaps, KVPlan, RankMemory

GIB = 1024 ** 3
# `--replicas auto` spends at most this share of a rank's device memory on expert copies (lowering/placement.py).
AUTO_REPLICA_SHARE = 0.1


def host_memory_bytes() -> tuple[int, int]:
    """(available, total) bytes of this host's memory (Linux /proc/meminfo); (a huge number, same) where it cannot
    be read. The CPU plan's default device size and the CPU twin's run-time clamp (runtime/executors/kv_fit.py) use it."""
    try:
        with open("/proc/meminfo") as f:  # lines "MemTotal:  16318412 kB"
            info = {name: int(value.split()[0]) * 1024 for name, value in (line.split(":", 1) for line in f)}
        return info["MemAvailable"], info["MemTotal"]
    except (OSError, KeyError, ValueError, IndexError):
        return 1 << 62, 1 << 62


def default_cpu_memory_gib(ranks: int, cap_gib: float) -> float:
    """Memory each CPU rank may plan for: 80% of this host's available memory shared by the ranks `dataflow run`
    starts here, at most `cap_gib` each (in quarter GiB). The torch executor grows its KV pool page by page, so a
    plan that assumed more than the host has (16 GiB per rank on any host, before) let a long workload push the
    ranks into the kernel's OOM killer instead of waiting for pages."""
    available, _ = host_memory_bytes()
    share = 0.8 * available / max(ranks, 1) / GIB
    return max(0.25, min(cap_gib, int(share * 4) / 4))


def workspace_bytes(spec: ModelSpec, caps: BatchCaps) -> int:
    """Activations of the largest batch of any stage, twice (the batch running plus the next one
    being assembled), plus receive buffers of one full batch per stage kind."""
    b = sizes.dtype_bytes(spec)
    attn = caps.attn_tokens * max(sizes.attn_row_elems(spec, l) for l in range(spec.num_layers)) * b
    expert = caps.expert_rows * sizes.expert_row_elems(spec) * b
    sample = caps.attn_tokens * sizes.sample_row_bytes(spec)
    recv = (caps.attn_tokens * spec.experts.top_k + caps.expert_rows) * spec.hidden_size * b
    return 2 * max(attn, expert, sample) + recv


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def experts_per_rank(g: nx.DiGraph) -> Counter:
    """{rank: expert nodes running on it, over all layers}, copies included."""
    return Counter(r for (kind, _), data in g.nodes(data=True) if kind == "expert" for r in data["ranks"])


def replica_room(g: nx.DiGraph) -> dict[int, int]:
    """{rank: how many more expert copies it may hold} for `--replicas auto`: copies take at most AUTO_REPLICA_SHARE
    of the device memory, and leave the KV of min_kv_tokens after the weights, the largest rank's CUDA graph memory
    (a rank's first expert adds expert graphs) and the workspace."""
    from lowering.capture import plan_capture
    spec, cluster, opt = g.graph["spec"], g.graph["cluster"], g.graph["options"]
    b, device = sizes.dtype_bytes(spec), int(cluster.device_memory_gib * GIB)
    one_expert = sizes.expert_params(spec) * b
    fixed = sizes.replicated_params(spec) * b + max(plan_capture(g).graph_memory_bytes) \
        + workspace_bytes(spec, g.graph["caps"]) + opt["min_kv_tokens"] * sizes.kv_bytes_per_token_layer(spec) * spec.num_layers
    held = experts_per_rank(g)
    return {r: max(0, min(int(AUTO_REPLICA_SHARE * device), device - fixed - held[r] * one_expert) // one_expert)
            for r in range(cluster.ranks)}


def plan_memory(g: nx.DiGraph) -> tuple[KVPlan, list[RankMemory]]:
    """Options `max_kv_tokens` caps the pages per rank (e.g. a CPU run that should not reserve the whole
    budget); None fills what is left."""
    spec, caps, cluster, capture = g.graph["spec"], g.graph["caps"], g.graph["cluster"], g.graph["capture"]
    opt = g.graph["options"]
    block_size, min_kv_tokens, max_kv_tokens = opt["block_size"], opt["min_kv_tokens"], opt["max_kv_tokens"]
    b = sizes.dtype_bytes(spec)
    device = int(cluster.device_memory_gib * GIB)
    replicated = sizes.replicated_params(spec) * b
    one_expert = sizes.expert_params(spec) * b
    kv_layer = sizes.kv_bytes_per_token_layer(spec)
    kv_token = kv_layer * spec.num_layers
    work = workspace_bytes(spec, caps)
    # Round the minimum up to whole pages: the runtime allocates KV in pages.
    min_tokens = -(-min_kv_tokens // block_size) * block_size

    out: list[RankMemory] = []
    short: list[tuple[int, int, str]] = []  # (need, rank, breakdown) of ranks that do not fit
    held = experts_per_rank(g)
    for r in range(cluster.ranks):
        experts = held[r] * one_expert
        weights = replicated + experts
        graph = capture.graph_memory_bytes[r]
        left = device - weights - graph - work
        blocks = max(left, 0) // (kv_token * block_size)
        if max_kv_tokens is not None:
            blocks = min(blocks, -(-max_kv_tokens // block_size))
        if blocks * block_size < min_tokens:
            need = weights + graph + work + min_tokens * kv_token
            short.append((need, r, f"weights {_gib(weights)} (replicated {_gib(replicated)} + experts "
                                   f"{_gib(experts)}), CUDA graphs {_gib(graph)}, workspace {_gib(work)}, "
                                   f"KV for {min_tokens} tokens {_gib(min_tokens * kv_token)}"))
        kv = blocks * block_size * kv_token
        out.append(RankMemory(rank=r, device_bytes=device, replicated_weight_bytes=replicated,
                              expert_weight_bytes=experts, weight_bytes=weights, graph_bytes=graph,
                              workspace_bytes=work, kv_bytes=kv, kv_capacity_tokens=blocks * block_size,
                              kv_blocks=blocks, free_bytes=left - kv if left > 0 else 0))
    if short:
        need, r, breakdown = max(short)
        others = sorted(x[1] for x in short if x[1] != r)
        also = f" (ranks {', '.join(map(str, others[:8]))}{', ...' if len(others) > 8 else ''} are short too)" \
            if others else ""
        # Only experts are spread over ranks: if the replicated part alone does not fit, ranks cannot help.
        fixed = replicated + work + min_tokens * kv_token + max(capture.graph_memory_bytes)
        hint = ("Use more ranks (--ranks) to spread the experts, or give more memory (--device-memory GiB)"
                + (", or fewer --replicas." if g.graph["placement"].replicas else ".")
                if fixed < device else
                f"More ranks cannot help: the part every rank holds (attention, embeddings, KV, workspace) "
                f"already needs {_gib(fixed)}; give more memory (--device-memory GiB) or lower --min-kv-tokens.")
        raise UserError(f"model '{spec.name}' does not fit {cluster.ranks} x {cluster.device} "
                        f"({cluster.device_memory_gib:g} GiB each): rank {r} needs {need} bytes ({_gib(need)}: "
                        f"{breakdown}) but has {device} bytes ({_gib(device)}){also}. {hint}")
    kv = KVPlan(block_size=block_size, dtype=spec.dtype, bytes_per_token=kv_token,
                bytes_per_token_per_layer=[kv_layer] * spec.num_layers,
                num_blocks=[m.kv_blocks for m in out])
    return kv, out
