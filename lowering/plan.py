"""The Plan: the versioned JSON contract between `dataflow compile` and `dataflow run`.

`compile_plan(spec, ranks, ...)` builds the dataflow graph (graph_ir/graph.py), runs the lowering passes over it
(lowering/pipeline.py: each pass is one function of the graph) and returns a `Plan`; `save_plan` writes it as PLAN_DIR/plan.json with the
ModelSpec embedded, so a plan directory alone is enough to run. `load_plan` refuses files written
by another plan version rather than guessing, because the runtime trusts every field.

Conventions the runtime relies on:
- `plan.stages` is the stage chain attn(0), expert(0), attn(1), ..., sample; stage ids are list
  indices, identical on every rank; dense layers have no expert stage; `sample.next` is attn(0).
- the sample stage has `layer == spec.num_layers` (it comes after the last layer).
- `plan.placement.expert_rank[layer][e]` is the rank that holds expert e of that layer
  (`[]` for dense layers).
- `plan.ranks[r].queues[s]` is rank r's mu-queue for stage s (one per stage on every rank, even
  when r holds no expert of that layer: its `experts` list is then empty).
- `plan.kv.num_blocks[r]` is the number of KV pages of `plan.kv.block_size` tokens on rank r.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, PositiveInt, ValidationError

from graph_ir.errors import UserError
from graph_ir.spec import ModelSpec

PLAN_VERSION = 1
PLAN_FILE = "plan.json"
SUMMARY_FILE = "plan.txt"

# Tokens per attention batch. Not the paper's 256: a home's decode wave runs as one batch per layer only while it fits
# the cap, and a rank's host cost is per batch, so a wave split in two costs ~30-40% of the tokens/s (2 x H200, 20B-L8:
# C=512 at cap 256 ran 31.7k tok/s against ~44k at cap 512 or 1024), while a cap above the load
# costs nothing (a batch takes the capture bucket of its own size: C=256 ran 31.0k at cap 256 and 31.5k at cap 1024,
# C=512 42.7k and 44.6k, medians of 3 alternating rounds). So the default is large
# and the wave follows the load up to it. What it costs: the buckets above 256 (graphs, static buffers, the
# device-routed expert cap ranks x cap x top-k), on 2 x H200 2.5% of the KV pool at GPT-OSS-20B, 14% at 120B.
DEFAULT_ATTN_CAP = 1024
DEFAULT_EXPERT_CAP = 1024
# Published StreamEP numbers (see shared/docs/streamep.md): CUDA graph buckets.
PUBLISHED_ATTN_BUCKETS = [1, 8, 40, 72, 104, 128, 192, 256]
PUBLISHED_EXPERT_BUCKETS = [128, 256, 512, 1024]
DEFAULT_BLOCK_SIZE = 16
# cuda: what the plan may hand out on one H200. torch reports 139.8 GiB total; the CUDA context
# (~0.5 GiB), NCCL's buffers (~0.5 GiB for a few peers, NVLS off), cuBLAS/Triton workspaces, the
# caching allocator's rounding and eager batches' activations need the rest, so 132 GiB leaves
# ~7.8 GiB (5.6%) of slack. (140 made every rank of a small model OOM while zeroing its KV pool.)
# The runtime still checks the real free memory and clamps the KV pool (runtime/executors/kv_fit.py).
# cpu: the most a rank plans for; the default is what this host has available, shared by its ranks
# (lowering/memory.py default_cpu_memory_gib).
DEFAULT_DEVICE_MEMORY_GIB = {"cpu": 16.0, "cuda": 132.0}
# Every rank must hold the KV of at least one request this long (the paper's contexts are <= 2048),
# otherwise the plan "fits" but cannot serve anything.
DEFAULT_MIN_KV_TOKENS = 2048
# The queue tables and routes grow with ranks; beyond this a plan is not something we can test.
MAX_RANKS = 1024
# A CPU rank is a whole OS process (its own torch runtime, ~0.3-0.5 GB resident, and a gloo + ZeroMQ link to every
# other rank): 64 of them already fill a large host, so a CPU plan with more ranks could never run (1,000 were
# OOM-killed). Larger clusters are GPU plans (--device cuda), up to MAX_RANKS.
MAX_CPU_RANKS = 64
# GiB per device: no device has more (an H200 has 141 GB, a big host a few TB); anything above is a typo (or inf).
MAX_DEVICE_MEMORY_GIB = 16384.0

StageKind = Literal["attn", "expert", "sample"]
PlacementPolicy = Literal["contiguous", "round_robin", "profile"]
HomePolicy = Literal["most_free_kv", "round_robin"]
Device = Literal["cpu", "cuda"]
# How a home sends an attention batch to the expert holders (runtime/core/routed_rows.py): host = the routing comes to
# the host and each holder gets the rows routed to it; device = the whole batch with its expert ids and weights goes
# to every holder, which runs its own slots on the device and returns per-token partial sums (no routing round trip
# through the host).
Dispatch = Literal["host", "device"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class Cluster(_Model):
    ranks: int = Field(gt=0)
    device: Device = "cpu"
    device_memory_gib: float = Field(gt=0)
    # compile's choice (auto: device on cuda, host on cpu); None in plans written before it was recorded (the
    # runtime then picks by the executor's device). The `dispatch` option (runtime/settings.py) overrides it at run time.
    dispatch: Optional[Dispatch] = None


class Stage(_Model):
    """One link of the stage chain. `layer` is the model layer (num_layers for the sampler)."""

    id: NonNegativeInt
    kind: StageKind
    layer: NonNegativeInt
    next: NonNegativeInt


class BatchCaps(_Model):
    attn_tokens: int = Field(DEFAULT_ATTN_CAP, gt=0)  # tokens per attention / sample batch
    expert_rows: int = Field(DEFAULT_EXPERT_CAP, gt=0)  # routed (token, expert) rows per expert batch


class Placement(_Model):
    policy: PlacementPolicy = "contiguous"
    home_policy: HomePolicy = "most_free_kv"
    # expert_rank[layer][e] = rank holding expert e of that layer; [] for dense layers.
    expert_rank: list[list[NonNegativeInt]]
    # Per-expert load read from --load-profile (by `profile` placement and replicas; None without one), per layer.
    load: Optional[list[list[float]]] = None
    # Expert replicas (issue 33): replicas[layer][e] = the ranks holding a copy of expert e besides its owner
    # expert_rank[layer][e]. Every copy computes the same function, so the runtime may send a row to any of them.
    # Empty, and absent from plan.json, when no expert is replicated.
    replicas: list[list[list[NonNegativeInt]]] = Field(default_factory=list, exclude_if=lambda v: not v)
    # Disaggregated attention (issue 33): the ranks that run attention and home requests; the others hold experts
    # only. Empty, and absent from plan.json, when every rank does.
    attention_ranks: list[NonNegativeInt] = Field(default_factory=list, exclude_if=lambda v: not v)

    def copies(self, layer: int, e: int) -> list[int]:
        """The ranks holding expert e of `layer`: its owner first, then its replicas."""
        return [self.expert_rank[layer][e], *(self.replicas[layer][e] if self.replicas else ())]

    def experts_on(self, layer: int, rank: int) -> list[int]:
        """The experts of `layer` that `rank` holds, replicas included, ascending."""
        reps = self.replicas[layer] if self.replicas else ()
        return [e for e, r in enumerate(self.expert_rank[layer]) if r == rank or (reps and rank in reps[e])]

    def homes(self, ranks: int) -> list[int]:
        """The ranks that run attention and home requests."""
        return list(self.attention_ranks) or list(range(ranks))

    def held_by(self, rank: int) -> list[list[int]]:
        """Per layer, the experts `rank` holds ([] for dense layers): the `experts=` argument of
        models.weights' builders, so a rank process builds only its own experts."""
        return [self.experts_on(l, rank) for l in range(len(self.expert_rank))]

    def holders(self, layer: int) -> list[int]:
        """Ranks that hold at least one expert of `layer` (a replica counts), ascending."""
        reps = self.replicas[layer] if self.replicas else ()
        return sorted(set(self.expert_rank[layer]).union(*reps))


class QueueEntry(_Model):
    """One mu-queue of a rank: where tokens of one stage wait, and where they go next."""

    stage_id: NonNegativeInt
    kind: StageKind
    layer: NonNegativeInt
    next_stage: NonNegativeInt
    batch_cap: PositiveInt  # tokens (attn/sample) or routed rows (expert)
    experts: list[NonNegativeInt] = Field(default_factory=list)  # expert ids of `layer` held by this rank


class RankPlan(_Model):
    rank: NonNegativeInt
    queues: list[QueueEntry]


class KVPlan(_Model):
    block_size: int = Field(gt=0)
    dtype: str
    bytes_per_token: PositiveInt  # all layers together
    bytes_per_token_per_layer: list[NonNegativeInt]
    num_blocks: list[PositiveInt]  # per rank


class CapturePool(_Model):
    """One memory pool / set of static buffers shared by the graphs of every listed layer at one bucket."""

    kind: StageKind
    bucket: PositiveInt
    layers: list[NonNegativeInt]
    static_buffer_bytes: NonNegativeInt


class CapturePlan(_Model):
    enabled: bool  # CUDA graphs are captured only on cuda; the plan is still computed for inspection
    buckets: dict[str, list[int]]  # per stage kind, ascending, last one == that kind's batch cap
    pools: list[CapturePool]
    graphs_per_rank: list[NonNegativeInt]
    graph_memory_bytes: list[NonNegativeInt]  # per rank, estimate (0 when not enabled)


RoutePattern = Literal["all_to_holders", "holders_to_all", "self"]


class Route(_Model):
    """What crosses the wire on one stage edge.

    pattern: all_to_holders  every rank (a home) -> each rank holding an expert of the layer
             holders_to_all  each expert holder -> every home rank
             self            stays on the home rank (no message; max_message_bytes == 0)
    Pairs with src == dst are delivered locally by the runtime, never through the transport.
    """

    src_stage: NonNegativeInt
    dst_stage: NonNegativeInt
    kind: Literal["dispatch", "combine", "local"]
    pattern: RoutePattern
    src_ranks: list[NonNegativeInt]
    dst_ranks: list[NonNegativeInt]
    carries: str
    row_bytes: NonNegativeInt  # one hidden-state row
    max_rows: NonNegativeInt
    max_message_bytes: NonNegativeInt

    def pairs(self) -> list[tuple[int, int]]:
        if self.pattern == "self":
            return [(r, r) for r in self.src_ranks]
        return [(s, d) for s in self.src_ranks for d in self.dst_ranks]


class RankMemory(_Model):
    rank: NonNegativeInt
    device_bytes: PositiveInt
    replicated_weight_bytes: NonNegativeInt  # embed, head, attention, routers, shared/dense MLPs: on every rank
    expert_weight_bytes: NonNegativeInt  # only the experts placed here
    weight_bytes: NonNegativeInt
    graph_bytes: NonNegativeInt
    workspace_bytes: NonNegativeInt
    kv_bytes: NonNegativeInt
    kv_capacity_tokens: NonNegativeInt
    kv_blocks: NonNegativeInt  # kv.num_blocks (positive in a plan) repeats it
    free_bytes: NonNegativeInt  # what is left after all of the above


class Plan(_Model):
    version: int = PLAN_VERSION
    spec: ModelSpec
    source: str = ""  # where the spec came from (file, shipped name, checkpoint dir)
    cluster: Cluster
    caps: BatchCaps
    stages: list[Stage]
    placement: Placement
    ranks: list[RankPlan]
    kv: KVPlan
    capture: CapturePlan
    routes: list[Route]
    memory: list[RankMemory]


def _options_error(name: str, value: Any, valid: str) -> UserError:
    return UserError(f"option '{name}': got {value!r}; valid: {valid}")


def compile_plan(spec: ModelSpec, ranks: int, device: str = "cpu", *,
                 device_memory_gib: Optional[float] = None,
                 placement: str = "contiguous",
                 load_profile: Optional[str | Path | list | dict] = None,
                 home_policy: str = "most_free_kv",
                 block_size: int = DEFAULT_BLOCK_SIZE,
                 attn_cap: int = DEFAULT_ATTN_CAP,
                 expert_cap: Optional[int] = None,
                 min_kv_tokens: int = DEFAULT_MIN_KV_TOKENS,
                 max_kv_tokens: Optional[int] = None,
                 dispatch: str = "auto",
                 replicas: int | str = 0,
                 attention_ranks: Optional[int] = None,
                 dump_after: Optional[str] = None,
                 source: str = "") -> Plan:
    """Lower `spec` onto `ranks` ranks of `device`. User mistakes raise UserError; the result is
    validated by `check_plan` before it is returned.
    replicas: extra expert copies per MoE layer, or "auto" (lowering/placement.py place_replicas says how many);
    attention_ranks K: ranks 0..K-1 run attention and home requests, the experts go on ranks K..R-1;
    dump_after: print the graph or plan section after that pass (lowering/pipeline.py PASS_NAMES)."""
    # Imported here so each pass module can import the plan models without a cycle.
    from graph_ir.graph import build_graph
    from lowering.check import check_plan
    from lowering.pipeline import PASS_NAMES, run_pipeline

    if isinstance(ranks, bool) or not isinstance(ranks, int) or not 1 <= ranks <= MAX_RANKS:
        raise _options_error("ranks", ranks, f"an integer 1..{MAX_RANKS}")
    if device not in DEFAULT_DEVICE_MEMORY_GIB:
        raise _options_error("device", device, "cpu, cuda")
    if device == "cpu" and ranks > MAX_CPU_RANKS:
        raise _options_error("ranks", ranks, f"an integer 1..{MAX_CPU_RANKS} for device cpu (every CPU rank is a "
                                             f"process with its own torch runtime); larger clusters: --device cuda")
    if dispatch not in ("auto", "host", "device"):
        raise _options_error("dispatch", dispatch, "auto (device on cuda, host on cpu), host, device")
    if dispatch == "auto":
        dispatch = "device" if device == "cuda" else "host"
    if dump_after is not None and dump_after not in PASS_NAMES:
        raise _options_error("dump_after", dump_after, ", ".join(PASS_NAMES))
    if attention_ranks is not None and (isinstance(attention_ranks, bool) or not isinstance(attention_ranks, int)
                                        or not 1 <= attention_ranks < ranks):
        raise _options_error("attention_ranks", attention_ranks, f"an integer 1..{ranks - 1} (fewer than the "
                             f"{ranks} ranks: the others hold the experts)" if ranks > 1 else "none on 1 rank")
    if isinstance(replicas, str) and replicas.isdigit():
        replicas = int(replicas)
    most = spec.experts.num_experts * (ranks - (attention_ranks or 0) - 1)  # every expert rank holds every expert
    if replicas != "auto" and (isinstance(replicas, bool) or not isinstance(replicas, int) or not 0 <= replicas <= most):
        raise _options_error("replicas", replicas, f"auto or an integer 0..{most} (experts x (expert ranks - 1))")
    if replicas and dispatch == "device":
        raise UserError(f"option 'replicas': got {replicas!r} with the device-routed dispatch (the default on cuda), "
                        f"whose kernels take each expert's rows on its one owner; valid: --dispatch host with "
                        f"replicas, or --replicas 0")
    if expert_cap is None:  # see default_expert_cap
        expert_cap = default_expert_cap(spec, ranks, attn_cap, dispatch)
    if home_policy not in ("most_free_kv", "round_robin"):
        raise _options_error("home_policy", home_policy, "most_free_kv, round_robin")
    for name, value in (("block_size", block_size), ("attn_cap", attn_cap), ("expert_cap", expert_cap),
                        ("min_kv_tokens", min_kv_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise _options_error(name, value, "a positive integer")
    if max_kv_tokens is not None and (isinstance(max_kv_tokens, bool) or not isinstance(max_kv_tokens, int)
                                      or max_kv_tokens < min_kv_tokens):
        raise _options_error("max_kv_tokens", max_kv_tokens, f"an integer >= min_kv_tokens ({min_kv_tokens})")
    if device_memory_gib is None:
        from lowering.memory import default_cpu_memory_gib
        device_memory_gib = DEFAULT_DEVICE_MEMORY_GIB[device]
        if device == "cpu":  # the ranks run on this host: what it has, shared (at most the nominal 16 GiB each)
            device_memory_gib = default_cpu_memory_gib(ranks, device_memory_gib)
    if isinstance(device_memory_gib, bool) or not isinstance(device_memory_gib, (int, float)) \
            or not 0 < device_memory_gib <= MAX_DEVICE_MEMORY_GIB:
        raise _options_error("device_memory_gib", device_memory_gib,
                             f"a positive number of GiB up to {MAX_DEVICE_MEMORY_GIB:g}")

    if device == "cpu" and "dtype" not in spec.model_fields_set and spec.dtype != "float32":
        # A spec that leaves dtype open runs in fp32 on a CPU plan: CPU matmuls in bf16 ran 4.6x slower than fp32
        # (tiny-gpt-oss, 2 ranks). An explicit `dtype:` is kept as written.
        spec = spec.model_copy(update={"dtype": "float32"})
    cluster = Cluster(ranks=ranks, device=device, device_memory_gib=float(device_memory_gib), dispatch=dispatch)
    caps = BatchCaps(attn_tokens=attn_cap, expert_rows=expert_cap)
    g = build_graph(spec)
    g.graph.update(ranks=ranks, spec=spec, cluster=cluster, caps=caps, options=dict(
        placement=placement, load_profile=load_profile, home_policy=home_policy, replicas=replicas,
        attention_ranks=attention_ranks, block_size=block_size, min_kv_tokens=min_kv_tokens,
        max_kv_tokens=max_kv_tokens))
    out = run_pipeline(g, dump_after).graph
    kv, memory = out["memory"]
    plan = Plan(spec=spec, source=source, cluster=cluster, caps=caps, stages=out["stages"],
                placement=out["placement"], ranks=out["queues"], kv=kv, capture=out["capture"], routes=out["routes"],
                memory=memory)
    check_plan(plan)
    return plan


def default_expert_cap(spec: ModelSpec, ranks: int, attn_cap: int, dispatch: str) -> int:
    """Routed rows per expert batch when the user names none. Host-routed: DEFAULT_EXPERT_CAP (1,024 rows). Device-routed,
    where an expert batch counts slots and a home sends its whole attention batch (attn_cap x top_k slots) to every
    holder: room for every home's batch at once, so that an owner which finds two homes' waves queued runs them as one
    batch and reads its experts' weights once (on 2 x H200 a 1,024-slot cap was filled by the owner's own wave, which
    ran alone while the other home's payload waited in the queue in ~40% of layers)."""
    if dispatch != "device" or not spec.moe_layers:
        return DEFAULT_EXPERT_CAP
    return max(DEFAULT_EXPERT_CAP, ranks * attn_cap * spec.experts.top_k)


def save_plan(plan: Plan, plan_dir: str | Path) -> Path:
    """Write PLAN_DIR/plan.json (the contract) and PLAN_DIR/plan.txt (a human summary)."""
    from lowering.summary import plan_summary

    plan_dir = Path(plan_dir)
    if plan_dir.exists() and not plan_dir.is_dir():
        raise UserError(f"{plan_dir}: exists and is not a directory; pick another -o PLAN_DIR")
    path = plan_dir / PLAN_FILE
    try:
        plan_dir.mkdir(parents=True, exist_ok=True)
        # Write then rename so a reader never sees half a plan.
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(plan.model_dump_json(indent=1))
        tmp.replace(path)
        (plan_dir / SUMMARY_FILE).write_text(plan_summary(plan))
    except OSError as err:
        raise UserError(f"{err.filename or plan_dir}: cannot write the plan there ({err.strerror or err}); "
                        f"pick another -o PLAN_DIR") from None
    return path


def load_plan(plan_dir: str | Path) -> Plan:
    """Read PLAN_DIR/plan.json (or a plan.json path). Missing, unreadable or other-version plans are UserErrors."""
    plan_dir = Path(plan_dir)
    path = plan_dir if plan_dir.suffix == ".json" else plan_dir / PLAN_FILE
    if not path.is_file():
        raise UserError(f"{path}: no plan here; run `dataflow compile MODEL --ranks N -o {plan_dir}` first")
    from graph_ir.files import parse_json, read_text
    try:
        data = parse_json(read_text(path, "plan file"), str(path), "a readable plan JSON")
    except UserError as err:
        raise UserError(f"{err}; compile it again") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: not a plan (top level is {type(data).__name__}); compile it again")
    version = data.get("version")
    if version != PLAN_VERSION:
        raise UserError(f"{path}: field 'version': plan version {version!r} is not supported "
                        f"(this dataflow reads version {PLAN_VERSION}); compile the model again")
    try:
        plan = Plan.model_validate(data)
    except ValidationError as err:
        from graph_ir.spec import format_validation_error
        raise UserError(format_validation_error(err, str(path))) from None
    # The runtime indexes every table by rank, stage, layer and expert: a hand-edited plan whose sections
    # disagree would end in an IndexError in every rank, or run with silently wrong tables.
    from lowering.check import check_loaded_plan
    check_loaded_plan(plan, str(path))
    return plan
