"""Placement pass: which rank holds each routed expert of each MoE layer.

Attention is data-parallel (every rank holds all of it), so only experts are placed.
Policies:
  contiguous   blocks of consecutive experts, sizes differing by at most one (the default;
               expert e goes to rank e*R//E, so R > E spreads the experts over the ranks)
  round_robin  expert e on rank e % R
  profile      greedy balanced bin packing of a measured per-expert load (largest load first
               onto the least-loaded rank), so hot experts do not pile up on one rank
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

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


def place_experts(spec: ModelSpec, ranks: int, policy: str = "contiguous",
                  load_profile: Optional[str | Path | list | dict] = None,
                  home_policy: str = "most_free_kv") -> Placement:
    E = spec.experts.num_experts
    load: Optional[list[list[float]]] = None
    if policy == "profile":
        if load_profile is None:
            raise UserError("option 'placement': 'profile' needs a per-expert load file (--load-profile FILE)")
        load = read_load_profile(load_profile, spec)
    elif policy in ("contiguous", "round_robin"):
        if load_profile is not None:
            raise UserError(f"option 'load_profile': only used with placement 'profile', got placement {policy!r}")
    else:
        raise UserError(f"option 'placement': got {policy!r}; valid: contiguous, round_robin, profile")
    owners = {"contiguous": lambda layer: contiguous(E, ranks),
              "round_robin": lambda layer: [e % ranks for e in range(E)],  # expert e on rank e % R
              "profile": lambda layer: balanced(load[layer], ranks)}[policy]
    expert_rank = [owners(layer) if spec.is_moe_layer(layer) else [] for layer in range(spec.num_layers)]
    return Placement(policy=policy, home_policy=home_policy, expert_rank=expert_rank, load=load)
