"""Human-readable plan summary (PLAN_DIR/plan.txt and the first lines `compile` prints)."""
from __future__ import annotations

from lowering.plan import Plan

GIB = 1024 ** 3


def compress_ids(ids: list[int]) -> str:
    """[0,1,2,5,7,8] -> '0-2,5,7-8': expert lists stay readable for 128 experts."""
    parts, start = [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[i - 1] + 1:  # a run ids[start..i-1] ends here
            parts.append(str(ids[start]) if start == i - 1 else f"{ids[start]}-{ids[i - 1]}")
            start = i
    return ",".join(parts) or "-"


def placement_text(plan: Plan) -> str:
    """'placement contiguous', then the expert replicas and the attention ranks where there are any."""
    p, moe = plan.placement, plan.spec.moe_layers
    copies = sum(len(c) for row in p.replicas for c in row)
    return (f"placement {p.policy}" + (f", {copies} expert replicas over {len(moe)} MoE layers" if copies else "")
            + (f", attention on ranks {compress_ids(p.attention_ranks)}" if p.attention_ranks else ""))


def plan_summary(plan: Plan) -> str:
    s, c = plan.spec, plan.cluster
    moe = s.moe_layers
    lines = [
        f"dataflow plan v{plan.version}: {s.name} ({s.family}) from {plan.source or '<spec>'}",
        f"cluster: {c.ranks} x {c.device}, {c.device_memory_gib:g} GiB each; dispatch {c.dispatch or 'by device'}",
        f"model: {s.num_layers} layers ({len(moe)} MoE, dense {s.dense_layers or 'none'}), hidden {s.hidden_size}, "
        f"{s.experts.num_experts} experts top-{s.experts.top_k}, attention {s.attention.kind}, {s.dtype}",
        f"stages: {len(plan.stages)} (attn x {s.num_layers}, expert x {len(moe)}, sample); "
        f"caps: attn {plan.caps.attn_tokens} tokens, expert {plan.caps.expert_rows} rows",
        f"{placement_text(plan)}, home policy {plan.placement.home_policy}",
        f"KV: block {plan.kv.block_size} tokens, {plan.kv.bytes_per_token} bytes/token",
        "per rank: experts (first MoE layer, replicas included) | weights GiB | KV tokens | KV blocks | graphs",
    ]
    first = moe[0]
    for m in plan.memory:
        lines.append(f"  rank {m.rank}: {compress_ids(plan.placement.experts_on(first, m.rank))} | "
                     f"{m.weight_bytes / GIB:.3f} | {m.kv_capacity_tokens} | {m.kv_blocks} | "
                     f"{plan.capture.graphs_per_rank[m.rank]}")
    return "\n".join(lines) + "\n"
