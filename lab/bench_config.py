"""The bench's configuration (`python -m lab bench CONFIG.yaml`, benchmarks/*.yaml): the workload, the routing,
the cost model of the virtual clock, and the matrix of systems x policies x scenarios (lab/bench.py runs it).
Validated on load (pydantic, unknown keys refused); `check_config` checks what relates fields to each other."""
from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field

from graph_ir.errors import UserError
from runtime.executors.cost_model import CostModel

STREAMING = "streaming"
BARRIER_SYSTEMS = {"ag-ep": "ag", "a2a-ep": "a2a"}
SYSTEMS = (STREAMING,) + tuple(BARRIER_SYSTEMS)
KINDS = ("attn", "expert", "sample")  # a batch's kinds, as the cost fields name them


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class WorkloadConfig(_Strict):
    lengths: str = "sharegpt"            # sharegpt | gsm8k | fixed:P:O (ignored with `prompts`)
    prompts: Optional[str] = None        # JSONL file (id, prompt_token_ids, max_new_tokens), as `dataflow run`
    max_context: int = Field(512, ge=2)
    max_new_tokens: Optional[int] = Field(None, gt=0)   # cap on sampled output lengths
    requests: int = Field(200, gt=0)
    rate: float = Field(200.0, gt=0)     # Poisson, requests/s
    decode_only: bool = False            # the paper's mode: random prompt KV, no prefill compute


class RoutingConfig(_Strict):
    kind: Literal["model", "zipf", "trace"] = "zipf"
    s: float = 1.2
    drift_every: int = 0
    drift_stride: int = 1
    path: Optional[str] = None           # kind = trace


class BatchCost(_Strict):
    """One batch of a kind: fixed + per_row x rows, in us. Its host time outside the math (`host`, `barrier_host`: the
    engine's or the barrier rank's own Python: queues, scheduler, bookkeeping, launches) or its math (`barrier_math`)."""
    fixed_us: float = Field(0.0, ge=0)
    per_row_us: float = Field(0.0, ge=0)


class MessageLatency(_Strict):
    """The rank processes' transport's own time to hand a message to an idle receiver, beyond the link's (the header
    and payload through the send, receive and wake-up; lab/message_log.py measures it in a real run): floor_us + a
    lognormal of median median_us and shape sigma, drawn per message from the run's seeded stream, for every system's
    messages (the streaming engine's; the barrier ranks' ring hops, which pay collective_send_cpu_us each too)."""
    floor_us: float = Field(0.0, ge=0)
    median_us: float = Field(0.0, ge=0)
    sigma: float = Field(0.0, ge=0)

    def draw(self, rng) -> float:
        """Seconds for one message."""
        jitter = self.median_us * (rng.lognormvariate(0.0, self.sigma) if self.sigma else 1.0)
        return (self.floor_us + jitter) * 1e-6


class CostConfig(_Strict):
    attn_fixed_us: float = 60.0
    attn_per_row_us: float = 1.0
    expert_fixed_us: float = 150.0
    expert_per_row_us: float = 0.3
    expert_per_expert_us: float = 0.0  # each distinct expert of an expert batch beyond the first (its weight reads)
    sample_fixed_us: float = 30.0
    sample_per_row_us: float = 0.5
    # communication (runtime/executors/cost_model.py): defaults = free for the sender, direct collectives
    send_cpu_us: float = 0.0
    # True: a streaming message landing while its rank runs a batch is received after the batch, a message_latency
    # later (runtime/executors/cost_model.py busy_receive: CPU rank processes, whose receive threads wait for the GIL)
    receive_after_batch: bool = False
    # every batch's cost times a mean-1 lognormal factor of this shape, drawn per batch: rank processes that
    # time-share cores run a batch at its mean cost only on average, and a layer waits for its slowest path (a merge
    # for its top-k experts, a collective for every rank). 0: every batch its mean (lab/bench.py _compute_scale)
    batch_sigma: float = Field(0.0, ge=0, le=3)
    barrier_batch_sigma: Optional[float] = Field(None, ge=0, le=3)  # the barrier ranks' own; None: batch_sigma
    overlap_host: bool = True
    collective_fixed_us: dict[str, float] = Field(default_factory=lambda: {"ag": 0.0, "ar": 0.0, "a2a": 0.0})
    collective_send_cpu_us: float = 0.0
    collective_algo: Literal["ring", "direct"] = "direct"
    # host time per batch by kind (attn, expert, sample), beside the compute above: a batch holds its rank
    # max(compute, host) with overlap_host (a GPU runs the math while the host works), compute + host without (CPU
    # ranks). Empty: none (the compute numbers are the whole batch). `barrier_host`: the barrier baselines' ranks, whose
    # host code per batch is their own (lab/barrier_rank.py); None: the same as `host`.
    host: dict[str, BatchCost] = Field(default_factory=dict)
    barrier_host: Optional[dict[str, BatchCost]] = None
    # The barrier ranks' math per kind, where it differs from the fields above (rank processes time-sharing a CPU's
    # cores: a batch's wall time depends on how many ranks run at once, all of them at a barrier; each system's from
    # its own ranks' timers, benchmarks/sim_validation/inrun_costs.py). None: the same math for every system.
    barrier_math: Optional[dict[str, BatchCost]] = None
    message_latency: Optional[MessageLatency] = None  # every message; None: the link's latency alone

    def model(self, barrier: bool = False) -> CostModel:
        bad = set(self.collective_fixed_us) - {"ag", "ar", "a2a"}
        if bad:
            raise UserError(f"cost.collective_fixed_us: unknown collective(s) {sorted(bad)}; valid: ag, ar, a2a")
        host = self.barrier_host if barrier and self.barrier_host is not None else self.host
        own = self.barrier_math if barrier and self.barrier_math is not None else {}
        for name, kinds in (("host", host), ("barrier_math", own)):
            if bad := set(kinds) - set(KINDS):
                raise UserError(f"cost.{name}: unknown kind(s) {sorted(bad)}; valid: {', '.join(KINDS)}")
        math = {k: (getattr(self, f"{k}_fixed_us"), getattr(self, f"{k}_per_row_us")) for k in KINDS}
        math |= {k: (c.fixed_us, c.per_row_us) for k, c in own.items()}
        from lab.barrier import BarrierCostModel
        cls = BarrierCostModel
        extra = {}
        if host:
            cls = HostCostModel
            extra = {"host": tuple((k, h.fixed_us * 1e-6, h.per_row_us * 1e-6) for k, h in sorted(host.items()))}
        return cls(*(v * 1e-6 for k in KINDS for v in math[k]), expert_per_expert=self.expert_per_expert_us * 1e-6,
                   send_cpu=self.send_cpu_us * 1e-6, overlap_host=self.overlap_host,
                   busy_receive=self.message_latency.draw if self.receive_after_batch else None,
                   collective_fixed={k: v * 1e-6 for k, v in self.collective_fixed_us.items()},
                   collective_send_cpu=self.collective_send_cpu_us * 1e-6,
                   collective_algo=self.collective_algo, **extra)


def _host_cost_model():
    from dataclasses import dataclass
    from lab.barrier import BarrierCostModel

    @dataclass(frozen=True)
    class HostCostModel(BarrierCostModel):
        """The cost model with a host time per batch beside each compute (CostConfig.host), combined by the cost
        model's own overlap rule (runtime/executors/cost_model.py `overlap_host`): max on a GPU, the sum on a CPU."""
        host: tuple = ()   # ((kind, fixed_s, per_row_s), ...)

        def duration(self, kind: str, rows: int, experts: int = 1) -> float:
            compute = super().duration(kind, rows, experts)
            for k, fixed, per_row in self.host:
                if k == kind:
                    h = fixed + per_row * rows
                    return max(compute, h) if self.overlap_host else compute + h
            return compute

    return HostCostModel


class NetworkConfig(_Strict):
    """The cluster's topology on the virtual clock (lab/network.py): nodes of `gpus_per_node` GPUs, point-to-point
    links inside a node, one shared NIC per node between nodes (with its send and receive queues). Defaults: the
    paper's testbed NIC (200 Gbit/s) and NVLink-class links inside a node (H200: 450 GB/s each way)."""
    gpus_per_node: int = Field(gt=0)
    nic_gbps: float = Field(200.0, gt=0)
    nic_latency_us: float = Field(5.0, ge=0)
    intra_gbps: float = Field(3600.0, gt=0)
    intra_latency_us: float = Field(2.0, ge=0)

    def topology(self):
        from lab.network import Topology
        return Topology(self.gpus_per_node, self.intra_latency_us * 1e-6, self.intra_gbps,
                        self.nic_latency_us * 1e-6, self.nic_gbps)


class BenchConfig(_Strict):
    name: str = "bench"
    model: str = "tiny"
    ranks: int = Field(4, gt=0)
    clock: Literal["virtual", "wall", "process"] = "virtual"
    executor: Literal["sim", "torch"] = "sim"
    seed: int = 0
    repeats: int = Field(1, gt=0)        # measure the matrix N times (round by round); report medians
    kv_blocks: Optional[int] = Field(None, gt=0)
    # Memory each rank's plan may use (GiB). None: with executor sim, a simulated H200's 141 GiB (what the
    # H200-grounded costs model; this host's memory says nothing about a simulated GPU's); with torch, this host's
    # share per rank (lowering/memory.py default_cpu_memory_gib), as `dataflow compile` plans for the CPU.
    device_memory_gib: Optional[float] = Field(None, gt=0)
    # Bytes the link model charges per tensor row (None: the tensors' real bytes). Lets a tiny or
    # simulated model (8-byte rows) carry a real model's rows: GPT-OSS hidden 2880 x bf16 = 5760.
    row_bytes: Optional[int] = Field(None, gt=0)
    workload: WorkloadConfig = WorkloadConfig()
    routing: RoutingConfig = RoutingConfig()
    cost: CostConfig = CostConfig()      # or, in the YAML, the path of a cost profile (lab/costs/*.yaml)
    systems: list[str] = Field(default_factory=lambda: list(SYSTEMS))
    policies: list[str] = Field(default_factory=lambda: ["defrag", "mtfs", "flfs"])
    baseline: str = "ag-ep"
    scenarios: dict[str, dict] = Field(default_factory=lambda: {"clean": {}})
    # The links' topology and queues (virtual clock only); None: every link on its own, priced by the scenario's
    # latency_us / bandwidth_gbps (which a network replaces: a scenario then sets disturbances only).
    network: Optional[NetworkConfig] = None
    # A folder for a Chrome/Perfetto trace of every in-process streaming cell (trace-POLICY-SCENARIO-rN.json: each
    # rank's batches and scheduler decisions, the run's latest TRACE_BATCHES per rank). None: no traces.
    trace_dir: Optional[str] = None
    # Virtual clock: split each streaming simulation over this many processes once everything is admitted (the same
    # report, up to ~P x faster where the run allows it: runtime/drivers/partitions.py says where).
    processes: int = Field(1, gt=0)
    clean_scenario: str = "clean"
    peak_window_s: float = Field(60.0, gt=0)
    heatmap_policies: list[str] = Field(default_factory=lambda: ["mtfs", "defrag"])


HostCostModel = _host_cost_model()


def load_config(path: str | Path) -> BenchConfig:
    import yaml
    p = Path(path)
    if not p.is_file():
        raise UserError(f"bench config {p} does not exist")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as err:
        raise UserError(f"{p}: not valid YAML: {err}") from None
    if isinstance(data, dict) and isinstance(data.get("cost"), str):   # `cost: lab/costs/NAME.yaml`: a cost profile file
        cost = Path(data["cost"])
        if not cost.is_file():
            raise UserError(f"{p}: cost profile {cost} does not exist")
        from graph_ir.files import load_yaml
        data = {**data, "cost": load_yaml(cost, "cost profile", max_bytes=None) or {}}
    return validated(BenchConfig, data, str(p))


def validated(model: type[BaseModel], data, source: str):
    """`model.model_validate(data)`, its errors as one UserError naming `source` and each field."""
    from pydantic import ValidationError
    try:
        return model.model_validate(data)
    except ValidationError as err:
        msgs = "; ".join(f"{'.'.join(str(x) for x in e['loc'])}: {e['msg']}" for e in err.errors())
        raise UserError(f"{source}: {msgs}") from None


def split_system(name: str) -> tuple[str, int]:
    """A system name and the expert replicas its plan is compiled with: "ag-ep+r8" -> ("ag-ep", 8) (dataflow compile
    --replicas 8: the same copies for every system that names them, each choosing among them its own way),
    "streaming" -> ("streaming", 0); a malformed suffix gives -1. "streaming+r8s": the streaming engine choosing
    among the copies by the barrier baselines' static rule (lab/static_replicas.py StaticCopies, an ablation)."""
    base, sep, n = name.partition("+r")
    if base == STREAMING and n.endswith("s"):
        n = n[:-1]
    return base, (int(n) if n.isdigit() else -1) if sep else 0


def check_config(cfg: BenchConfig) -> None:
    bad = [s for s in cfg.systems if split_system(s)[0] not in SYSTEMS or split_system(s)[1] < 0]
    if bad:
        raise UserError(f"unknown system(s) {bad}; valid: {', '.join(SYSTEMS)}, each optionally with +rN "
                        f"(its plan compiled with N expert replicas per layer)")
    if cfg.baseline not in cfg.systems:
        raise UserError(f"baseline {cfg.baseline!r} is not among the systems {cfg.systems}")
    if cfg.clean_scenario not in cfg.scenarios:
        raise UserError(f"clean scenario {cfg.clean_scenario!r} is not among the scenarios {list(cfg.scenarios)}")
    if cfg.cost.message_latency is not None and cfg.network is not None:
        raise UserError("cost.message_latency is a host's own delivery time, for a config without `network` (a "
                        "topology prices its links' latency itself)")
    if cfg.cost.receive_after_batch and cfg.cost.message_latency is None:
        raise UserError("cost.receive_after_batch: a message's receive after the batch takes cost.message_latency; "
                        "set it (floor_us, median_us, sigma)")
    if cfg.network is not None:
        if cfg.clock != "virtual":
            raise UserError(f"network: a topology with queues is modelled on the virtual clock only (clock is "
                            f"{cfg.clock!r}; a wall-clock run's links are the real ones)")
        for name, sc in cfg.scenarios.items():
            both = sorted({"latency_us", "bandwidth_gbps"} & set(sc or {}))
            if both:
                raise UserError(f"scenario {name!r} sets {', '.join(both)}, which `network:` defines (nic_* and "
                                f"intra_* fields); a scenario with a network sets disturbances only")
    from runtime.core.scheduler import POLICIES, make_policy
    for p in cfg.policies:  # a name or "name:key=value,..." (runtime/scheduler.parse_policy)
        try:
            make_policy(p)
        except ValueError as err:
            raise UserError(f"policies: {p!r}: {err} (valid names: {', '.join(POLICIES)})") from None
