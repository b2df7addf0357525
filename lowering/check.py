"""Plan invariants. `compile_plan` runs this on every plan it returns; a failure here is a
compiler bug (AssertionError-like `PlanInvariantError`), never a user mistake."""
from __future__ import annotations

from graph_ir.graph import build_graph
from lowering.plan import MAX_RANKS, Plan
from lowering.queues import build_stages


class PlanInvariantError(AssertionError):
    pass


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise PlanInvariantError(what)


class _Count(str):
    """A count shown as is in a message ("1 entries"), not repr'd like a value."""


def _bad(field: str, got, valid: str) -> PlanInvariantError:
    shown = got if isinstance(got, _Count) else repr(got)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return PlanInvariantError(f"field '{field}': got {shown}; valid: {valid}")


def check_plan(plan: Plan) -> None:
    """Every invariant the compiler guarantees: the tables the runtime indexes first (each problem named by its
    field, its value and what is valid), then routes, memory and capture."""
    spec, R = plan.spec, plan.cluster.ranks
    if R > MAX_RANKS:
        raise _bad("cluster.ranks", R, f"1..{MAX_RANKS}")
    for name, table in (("ranks", plan.ranks), ("kv.num_blocks", plan.kv.num_blocks), ("memory", plan.memory),
                        ("capture.graphs_per_rank", plan.capture.graphs_per_rank),
                        ("capture.graph_memory_bytes", plan.capture.graph_memory_bytes)):
        if len(table) != R:
            raise _bad(name, _Count(f"{len(table)} entries"), f"one per rank: {R} entries (cluster.ranks is {R})")
    for i, (rp, m) in enumerate(zip(plan.ranks, plan.memory)):
        if rp.rank != i:
            raise _bad(f"ranks[{i}].rank", rp.rank, str(i))
        if m.rank != i:
            raise _bad(f"memory[{i}].rank", m.rank, str(i))
        if m.kv_blocks != plan.kv.num_blocks[i]:
            raise _bad(f"kv.num_blocks[{i}]", plan.kv.num_blocks[i], f"{m.kv_blocks} (memory[{i}].kv_blocks)")
    if plan.kv.dtype != spec.dtype:
        raise _bad("kv.dtype", plan.kv.dtype, f"{spec.dtype} (spec.dtype)")
    if len(plan.kv.bytes_per_token_per_layer) != spec.num_layers:
        raise _bad("kv.bytes_per_token_per_layer", _Count(f"{len(plan.kv.bytes_per_token_per_layer)} entries"),
                  f"one per layer: {spec.num_layers} entries (spec.num_layers)")

    # The chain: attn(0..L-1) in order with an expert stage after each MoE layer, then sample, which wraps to attn(0).
    stages = build_stages(build_graph(spec))
    if len(plan.stages) != len(stages):
        raise _bad("stages", _Count(f"{len(plan.stages)} stages"), f"{len(stages)} stages, the chain of spec's "
                  f"{spec.num_layers} layers ({len(spec.moe_layers)} MoE)")
    for i, (s, w) in enumerate(zip(plan.stages, stages)):
        for f in ("id", "kind", "layer", "next"):
            if getattr(s, f) != getattr(w, f):
                raise _bad(f"stages[{i}].{f}", getattr(s, f), f"{getattr(w, f)!r} (stage {i} of the chain is "
                          f"{w.kind} of layer {w.layer}, next {w.next})")

    # Placement: every expert of every MoE layer on exactly one valid rank; dense layers empty.
    E = spec.experts.num_experts
    er = plan.placement.expert_rank
    if len(er) != spec.num_layers:
        raise _bad("placement.expert_rank", _Count(f"{len(er)} layers"), f"{spec.num_layers} layers (spec.num_layers)")
    for layer, owners in enumerate(er):
        if not spec.is_moe_layer(layer):
            if owners:
                raise _bad(f"placement.expert_rank[{layer}]", owners, "[] (a dense layer has no experts)")
            continue
        if len(owners) != E:
            raise _bad(f"placement.expert_rank[{layer}]", _Count(f"{len(owners)} experts"),
                      f"one rank per expert: {E} entries (spec.experts.num_experts)")
        for e, r in enumerate(owners):
            if not 0 <= r < R:
                raise _bad(f"placement.expert_rank[{layer}][{e}]", r, f"a rank 0..{R - 1}")
    # Replicas: [] (none), or one list per layer ([] for dense) of one list per expert of distinct ranks, not its owner.
    reps = plan.placement.replicas
    if reps and len(reps) != spec.num_layers:
        raise _bad("placement.replicas", _Count(f"{len(reps)} layers"), f"{spec.num_layers} layers, or [] for none")
    for layer, row in enumerate(reps):
        if len(row) != len(er[layer]):
            raise _bad(f"placement.replicas[{layer}]", _Count(f"{len(row)} experts"), f"one list of ranks per expert:"
                       f" {len(er[layer])} entries" + ("" if er[layer] else " (a dense layer has no experts)"))
        for e, copies in enumerate(row):
            if len(set(copies)) != len(copies) or any(not 0 <= r < R or r == er[layer][e] for r in copies):
                raise _bad(f"placement.replicas[{layer}][{e}]", copies,
                           f"distinct ranks 0..{R - 1} other than the owner {er[layer][e]}")
    homes = plan.placement.homes(R)
    if homes != sorted(set(homes)) or not all(0 <= r < R for r in homes):
        raise _bad("placement.attention_ranks", plan.placement.attention_ranks,
                   f"ascending distinct ranks 0..{R - 1}, or [] for every rank")

    # Queues: one per stage per rank, mirroring the chain; expert lists partition the experts (and their copies).
    held_by: dict[tuple[int, int], list[int]] = {}  # (layer, rank) -> experts, once: experts_on per queue is O(E)
    for layer in spec.moe_layers:
        for e in range(E):
            for r in plan.placement.copies(layer, e):
                held_by.setdefault((layer, r), []).append(e)
    for i, rp in enumerate(plan.ranks):
        if len(rp.queues) != len(stages):
            raise _bad(f"ranks[{i}].queues", _Count(f"{len(rp.queues)} queues"), f"one per stage: {len(stages)}")
        for j, (q, s) in enumerate(zip(rp.queues, stages)):
            for f, sf in (("stage_id", "id"), ("kind", "kind"), ("layer", "layer"), ("next_stage", "next")):
                if getattr(q, f) != getattr(s, sf):
                    raise _bad(f"ranks[{i}].queues[{j}].{f}", getattr(q, f), f"{getattr(s, sf)!r} (stage {j} is "
                              f"{s.kind} of layer {s.layer})")
            expert = s.kind == "expert"
            cap = plan.caps.expert_rows if expert else plan.caps.attn_tokens
            if q.batch_cap != cap:
                raise _bad(f"ranks[{i}].queues[{j}].batch_cap", q.batch_cap,
                          f"{cap} (caps.{'expert_rows' if expert else 'attn_tokens'})")
            held = held_by.get((s.layer, i), []) if expert else []
            if q.experts != held:
                raise _bad(f"ranks[{i}].queues[{j}].experts", q.experts,
                          f"{held} (the experts placement.expert_rank[{s.layer}] puts on rank {i})")

    # Routes: exactly one per chain edge; cross-rank edges reach every holder / every home.
    _require([(r.src_stage, r.dst_stage) for r in plan.routes] == [(s.id, s.next) for s in stages],
             "routes do not cover the stage chain edge by edge")
    for route in plan.routes:
        s = stages[route.src_stage]
        holders = plan.placement.holders(s.layer) if route.kind != "local" else []
        if route.kind == "dispatch":
            _require(route.dst_ranks == holders and route.src_ranks == homes,
                     f"dispatch route of stage {s.id} misses ranks")
            _require(stages[route.dst_stage].kind == "expert", f"dispatch from stage {s.id} not into experts")
        elif route.kind == "combine":
            _require(route.src_ranks == holders and route.dst_ranks == homes,
                     f"combine route of stage {s.id} misses ranks")
        _require(route.max_message_bytes == (0 if route.kind == "local" else route.max_rows * route.row_bytes),
                 f"route {route.src_stage}->{route.dst_stage}: message bytes disagree with rows")

    # Memory: the parts add up and never exceed the device.
    for m in plan.memory:
        _require(m.weight_bytes == m.replicated_weight_bytes + m.expert_weight_bytes, f"rank {m.rank}: weights do not sum")
        _require(m.kv_capacity_tokens == m.kv_blocks * plan.kv.block_size, f"rank {m.rank}: KV tokens != blocks x block size")
        _require(m.kv_bytes == m.kv_capacity_tokens * plan.kv.bytes_per_token, f"rank {m.rank}: KV bytes disagree")
        used = m.weight_bytes + m.graph_bytes + m.workspace_bytes + m.kv_bytes
        _require(used + m.free_bytes == m.device_bytes and m.free_bytes >= 0, f"rank {m.rank}: memory does not sum")
    for kind, bks in plan.capture.buckets.items():
        cap = plan.caps.expert_rows if kind == "expert" else plan.caps.attn_tokens
        _require(bool(bks) and bks == sorted(set(bks)) and bks[-1] == cap,
                 f"{kind} buckets are not ascending up to the cap")


def check_loaded_plan(plan: Plan, source: str) -> None:
    """`check_plan` for a plan read from disk, as a UserError naming `source` (plan.json), the field, the value and
    what is valid: a hand-edited plan whose sections disagree fails here, not as an IndexError in every rank."""
    from graph_ir.errors import UserError

    try:
        check_plan(plan)
    except PlanInvariantError as err:
        raise UserError(f"{source}: {err}; the plan's sections disagree (edited by hand?): compile the model "
                        f"again") from None
