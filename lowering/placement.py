"""Placement passes: which rank holds each routed expert of each MoE layer (its owner), which ranks hold copies of it
(replicas), and which ranks run attention and home requests; they annotate the dataflow graph's nodes with those ranks.

Attention is data-parallel: every rank runs it, or with `attention_ranks` K the ranks 0..K-1 do (disaggregation) and
the experts go on ranks K..R-1 only. Owner policies (over the expert ranks):
  contiguous   blocks of consecutive experts, sizes differing by at most one (the default;
               expert e goes to rank e*R//E, so R > E spreads the experts over the ranks)
  round_robin  expert e on rank e % R
  profile      greedy balanced bin packing of a measured per-expert load (largest load first
               onto the least-loaded rank), so hot experts do not pile up on one rank
"""
from __future__ import annotations

import math
from pathlib import Path
import heapq
from typing import Optional

import networkx as nx

from graph_ir.errors import UserError
from graph_ir.spec import ModelSpec
from lowering.plan import Placement


def contiguous(num_experts: int, ranks: int) -> list[int]:
    return [e * ranks // num_experts for e in range(num_experts)]


def balanced(load: list[float], ranks: int) -> list[int]:
    """Longest-processing-time greedy: experts by descending load onto the rank with the least
    load so far (ties: fewer experts, then lower rank). Deterministic for equal loads."""
    owner = [0] * len(load)
    rank_load = [0.0] * ranks
    rank_count = [0] * ranks
    for e in sorted(range(len(load)), key=lambda e: (-load[e], e)):
        r = min(range(ranks), key=lambda r: (rank_load[r], rank_count[r], r))
        owner[e] = r
        rank_load[r] += load[e]
        rank_count[r] += 1
    return owner


def read_load_profile(profile: str | Path | list | dict, spec: ModelSpec) -> list[list[float]]:
    """Per-layer per-expert load. Accepted shapes (JSON or YAML file, or the object itself):
    a list of E numbers (the same for every MoE layer), or a mapping {layer: [E numbers]}
    (MoE layers missing from it get a uniform load)."""
    source = "load profile"
    if isinstance(profile, (str, Path)):
        source = str(profile)
        path = Path(profile)
        if not path.is_file():
            raise UserError(f"{path}: no such load profile file (--load-profile)")
        from graph_ir.files import load_yaml, parse_json, read_text
        # One-line errors for binary / non-UTF-8 files, bad syntax and keys given twice.
        if path.suffix == ".json":
            profile = parse_json(read_text(path, "load profile file"), str(path), "a valid JSON load profile")
        else:
            profile = load_yaml(path, "load profile file", max_bytes=None)
    E = spec.experts.num_experts

    def check_row(row: object, where: str) -> list[float]:
        if not isinstance(row, list) or len(row) != E:
            got = f"{len(row)} entries" if isinstance(row, list) else repr(row)[:60]
            raise UserError(f"{source}: field '{where}': expected a list of {E} per-expert loads, got {got}")
        out = []
        for i, x in enumerate(row):
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not 0 <= x < math.inf:
                raise UserError(f"{source}: field '{where}.{i}': load must be a number >= 0, got {x!r}"
                                + ("; valid: a finite number" if x == math.inf else ""))
            out.append(float(x))
        return out

    loads: list[list[float]] = [[] for _ in range(spec.num_layers)]
    if isinstance(profile, list):
        row = check_row(profile, "(top level)")
        for layer in spec.moe_layers:
            loads[layer] = list(row)
    elif isinstance(profile, dict):
        for key, row in profile.items():
            try:
                layer = int(key)
            except (TypeError, ValueError):
                raise UserError(f"{source}: field '{key}': expected a layer index, valid: "
                                f"MoE layers {spec.moe_layers}") from None
            if layer not in spec.moe_layers:
                raise UserError(f"{source}: field '{key}': layer {layer} is not an MoE layer; "
                                f"valid: {spec.moe_layers}")
            loads[layer] = check_row(row, str(key))
        for layer in spec.moe_layers:
            if not loads[layer]:
                loads[layer] = [1.0] * E
    else:
        raise UserError(f"{source}: expected a list of {E} per-expert loads or a mapping "
                        f"{{layer: [loads]}}, got {type(profile).__name__}")
    return loads


def annotate(g: nx.DiGraph, placement: Placement) -> nx.DiGraph:
    """Write the placement into the graph: an expert node runs on its copies (owner first), the others on the homes."""
    homes = placement.homes(g.graph["ranks"])
    for (kind, lid), data in g.nodes(data=True):
        data["ranks"] = placement.copies(lid.layer, lid.expert) if kind == "expert" else homes
    return g


def place_experts(g: nx.DiGraph) -> nx.DiGraph:
    """The placement pass: owners by the policy, on the expert ranks (all, or K..R-1 with attention_ranks K)."""
    spec, opt = g.graph["spec"], g.graph["options"]
    policy, load_profile, first = opt["placement"], opt["load_profile"], opt["attention_ranks"] or 0
    E, ranks = spec.experts.num_experts, g.graph["ranks"] - first
    load: Optional[list[list[float]]] = None
    if policy == "profile" and load_profile is None:
        raise UserError("option 'placement': 'profile' needs a per-expert load file (--load-profile FILE)")
    if policy not in ("contiguous", "round_robin", "profile"):
        raise UserError(f"option 'placement': got {policy!r}; valid: contiguous, round_robin, profile")
    if load_profile is not None and policy != "profile" and not opt["replicas"]:
        raise UserError(f"option 'load_profile': only used with placement 'profile' or --replicas, got placement "
                        f"{policy!r}")
    if load_profile is not None:
        load = read_load_profile(load_profile, spec)
    owners = {"contiguous": lambda layer: contiguous(E, ranks),
              "round_robin": lambda layer: [e % ranks for e in range(E)],  # expert e on rank e % R
              "profile": lambda layer: balanced(load[layer], ranks)}[policy]
    expert_rank = [[first + r for r in owners(layer)] if spec.is_moe_layer(layer) else []
                   for layer in range(spec.num_layers)]
    g.graph["placement"] = Placement(policy=policy, home_policy=opt["home_policy"], expert_rank=expert_rank,
                                     load=load, attention_ranks=list(range(first)))
    return annotate(g, g.graph["placement"])


def add_copies(owner: list[int], load: list[float], ranks: range, copies: int, limit: list[int],
               room: dict[int, int]) -> list[list[int]]:
    """`copies` replicas of one layer's experts (fewer where limits stop them), hottest first: the next copy goes to the expert with the most load per copy
    (ties: lower id) while it has fewer than limit[e] copies, onto the least loaded rank that does not hold it yet
    and has room left (room[r] copies, counted down; load = the summed load of the experts a rank holds, copies
    included; ties: fewer experts held, then lower rank). Two heaps keep this fast at 1,024 ranks."""
    held = {r: 0 for r in ranks}
    rank_load = {r: 0.0 for r in ranks}
    for e, r in enumerate(owner):
        held[r] += 1
        rank_load[r] += load[e]
    reps: list[list[int]] = [[] for _ in owner]
    # equal loads: the owners' first experts first, then their second ones...: in id order, the last owner's experts
    # came last, when every other rank was full (with a uniform load on 4 ranks, 8 copies gave rank 0 three, rank 3 one)
    seen: dict[int, int] = {}
    nth = {}
    for e, o in enumerate(owner):
        nth[e] = seen[o] = seen.get(o, -1) + 1
    experts = [(-load[e], nth[e], e) for e in range(len(owner)) if limit[e] > 0]
    free = [(rank_load[r], held[r], r) for r in ranks if room[r] > 0]
    heapq.heapify(experts)
    heapq.heapify(free)
    while experts and free and copies > 0:
        _, _, e = heapq.heappop(experts)
        skipped = []
        while free and (free[0][2] == owner[e] or free[0][2] in reps[e]):
            skipped.append(heapq.heappop(free))
        if free:
            _, _, r = heapq.heappop(free)
            reps[e].append(r)
            copies -= 1
            held[r], rank_load[r], room[r] = held[r] + 1, rank_load[r] + load[e], room[r] - 1
            if room[r] > 0:
                heapq.heappush(free, (rank_load[r], held[r], r))
            if len(reps[e]) < limit[e]:
                heapq.heappush(experts, (-load[e] / (1 + len(reps[e])), nth[e], e))
        for x in skipped:
            heapq.heappush(free, x)
    return [sorted(r) for r in reps]


def place_replicas(g: nx.DiGraph) -> nx.DiGraph:
    """The replicas pass (`--replicas N|auto`), on the expert ranks, by the load profile (uniform without one: then
    experts 0, 1, ... get the first copies, each on the rank holding the fewest experts, lowest first).
    N: N extra copies in every MoE layer, hottest experts first (add_copies), like vLLM's num_redundant_experts.
    auto: each expert gets ceil(load / mean load of its layer) - 1 copies, so that no copy serves more than a mean
    expert's share (a uniform load gets none), while a rank's copies fit memory.replica_room: at most
    AUTO_REPLICA_SHARE of its device memory and never below min_kv_tokens of KV; layers take their copies in order."""
    opt, p = g.graph["options"], g.graph["placement"]
    if not opt["replicas"]:
        return g
    spec, R = g.graph["spec"], g.graph["ranks"]
    ranks, E = range(opt["attention_ranks"] or 0, R), spec.experts.num_experts
    auto = opt["replicas"] == "auto"
    if auto:
        from lowering.memory import replica_room
        room = replica_room(g)
    replicas: list[list[list[int]]] = []
    for layer in range(spec.num_layers):
        if not spec.is_moe_layer(layer):
            replicas.append([])
            continue
        load = p.load[layer] if p.load else [1.0] * E
        if auto:
            mean = sum(load) / E
            limit = [min(len(ranks) - 1, math.ceil(x / mean) - 1) if mean else 0 for x in load]
        else:  # N <= E x (ranks - 1) was checked: every copy finds a rank
            limit, room = [len(ranks) - 1] * E, {r: opt["replicas"] for r in ranks}
        replicas.append(add_copies(p.expert_rank[layer], load, ranks, sum(limit) if auto else opt["replicas"],
                                   limit, room))
    g.graph["placement"] = p.model_copy(update={"replicas": replicas})
    return annotate(g, g.graph["placement"])
