"""The virtual cluster's network (lab/network.py): a node's GPUs share one NIC, whose send and receive queues price
incast; links inside a node do not queue; the scenario's disturbances lie on top; the bench runs every system over
it."""
import pytest

from lab.interference import LinkSchedule, from_config
from lab.network import Network, Topology

MB = 1_000_000
TOPO = Topology(gpus_per_node=2, intra_latency_s=2e-6, intra_gbps=3600.0, nic_latency_s=5e-6, nic_gbps=200.0)
TX = MB * 8 / 200e9   # 40 us for 1 MB at 200 Gbit/s


def test_an_idle_path_costs_latency_plus_one_transmission():
    net = Network(TOPO, LinkSchedule(), ranks=8)
    assert net.delay(0, 2, MB, 0.0) == pytest.approx(5e-6 + TX)
    assert net.delay(0, 1, MB, 0.0) == pytest.approx(2e-6 + MB * 8 / 3600e9)   # same node: NVLink-class
    assert net.delay(3, 3, MB, 0.0) == 0.0


def test_incast_queues_at_the_receiving_nic_and_fan_out_at_the_sending_one():
    net = Network(TOPO, LinkSchedule(), ranks=8)
    into = [net.delay(src, 0, MB, 0.0) for src in (2, 4, 6)]      # three nodes send to node 0 at once
    assert into == pytest.approx([5e-6 + TX, 5e-6 + 2 * TX, 5e-6 + 3 * TX])
    net = Network(TOPO, LinkSchedule(), ranks=8)
    out = [net.delay(0, dst, MB, 0.0) for dst in (2, 4, 6)]       # node 0 sends to three nodes
    assert out == pytest.approx([5e-6 + TX, 5e-6 + 2 * TX, 5e-6 + 3 * TX])
    net = Network(TOPO, LinkSchedule(), ranks=8)                 # disjoint pairs: no queue
    assert [net.delay(s, d, MB, 0.0) for s, d in ((0, 2), (4, 6))] == pytest.approx([5e-6 + TX] * 2)
    net = Network(TOPO, LinkSchedule(), ranks=8)                 # two GPUs of node 1 share its NIC
    assert [net.delay(s, 0, MB, 0.0) for s in (2, 3)] == pytest.approx([5e-6 + TX, 5e-6 + 2 * TX])
    assert net.delay(2, 4, MB, 1.0) == pytest.approx(5e-6 + TX)  # later, the ports are idle again


def test_the_scenarios_disturbances_lie_on_the_topologys_links():
    inter = from_config({"bursts": [{"period_ms": 10, "duty": 0.5, "extra_delay_us": 100, "bandwidth_gbps": 50,
                                     "links": [[2, 0]]}]})
    net = Network(TOPO, inter.link, ranks=8)
    assert net.delay(2, 0, MB, 0.001) == pytest.approx(5e-6 + 100e-6 + MB * 8 / 50e9)   # in the burst
    assert net.delay(4, 0, MB, 0.007) == pytest.approx(5e-6 + TX)                        # other link, burst off


def test_a_delayed_message_holds_up_its_link_not_the_receiving_port():
    """A burst's extra delay lies between the ports: other nodes' messages into the same node pass the delayed one
    (a receive port takes messages as they arrive), while its own link's FIFO (the transport's) keeps order."""
    inter = from_config({"bursts": [{"period_ms": 10, "duty": 0.5, "extra_delay_us": 2000, "links": [[2, -1]]}]})
    net = Network(TOPO, inter.link, ranks=8)
    assert net.delay(2, 0, MB, 0.001) == pytest.approx(5e-6 + TX + 2e-3)     # node 1 -> node 0, in the burst
    assert net.delay(4, 0, MB, 0.001) == pytest.approx(5e-6 + 2 * TX)        # node 2 -> node 0: its tx queue only
    assert net.delay(6, 0, MB, 0.004) == pytest.approx(5e-6 + TX)            # later: the port is free, not held


def _bench(tmp_path, network):
    from graph_ir.spec import load_spec
    from lab.bench import run_bench
    from lab.bench_config import BenchConfig
    cfg = BenchConfig.model_validate({
        "ranks": 4, "clock": "virtual", "executor": "sim", "peak_window_s": 0.05, "row_bytes": 200_000,
        "workload": {"lengths": "fixed:8:6", "requests": 16, "rate": 100000},
        "routing": {"kind": "zipf", "s": 1.0}, "systems": ["streaming", "ag-ep"], "policies": ["defrag"],
        "scenarios": {"clean": {}}, **({"network": network} if network else {}),
    })
    return {r["label"]: r for r in run_bench(cfg, load_spec("models/specs/tiny.yaml"), tmp_path)["results"]}


def test_the_bench_runs_every_system_over_the_network_and_contention_costs_time(tmp_path):
    flat = _bench(tmp_path / "flat", {"gpus_per_node": 4, "intra_gbps": 200.0, "intra_latency_us": 5.0})
    shared = _bench(tmp_path / "nic", {"gpus_per_node": 1})    # the same links, now behind one port per rank
    for runs in (flat, shared):
        assert all(r["output_tokens"] == 16 * 6 and r["unfinished"] == 0 for r in runs.values())
    for label in ("streaming/defrag", "ag-ep"):   # virtual clock: deterministic, the queues can only add time
        assert shared[label]["tokens_per_s"] < flat[label]["tokens_per_s"]


def test_a_network_is_virtual_only_and_owns_latency_and_bandwidth():
    from graph_ir.errors import UserError
    from lab.bench_config import BenchConfig, check_config
    base = {"ranks": 4, "network": {"gpus_per_node": 2}}
    with pytest.raises(UserError, match="virtual clock only"):
        check_config(BenchConfig.model_validate({**base, "clock": "wall"}))
    with pytest.raises(UserError, match="scenario 'clean' sets latency_us"):
        check_config(BenchConfig.model_validate({**base, "scenarios": {"clean": {"latency_us": 10}}}))
    check_config(BenchConfig.model_validate(base))


def test_stall_bursts_hold_a_barrier_collective_once_at_entry(tmp_path):
    """`collectives: stall` (how the GPU bench emulates a burst for the barrier baselines): every dispatch all-gather
    and all-reduce waits the extra delay once; with `hops` every ring message pays it, the step's count exchange too.
    Two ranks, 3 layers, a burst that never ends: +2 x 3 ms a step against +(3 x 3 + 1) ms."""
    from graph_ir.errors import UserError
    from graph_ir.spec import load_spec
    from lab.bench import run_bench
    from lab.bench_config import BenchConfig

    def burst(mode):
        return {"bursts": [{"period_ms": 10, "duty": 1.0, "extra_delay_us": 1000, "collectives": mode}]}
    cfg = BenchConfig.model_validate({
        "ranks": 2, "clock": "virtual", "executor": "sim", "peak_window_s": 0.05, "network": {"gpus_per_node": 2},
        "workload": {"lengths": "fixed:6:5", "requests": 8, "rate": 1e9, "decode_only": True},
        "routing": {"kind": "zipf", "s": 1.0}, "cost": {"collective_algo": "ring"}, "policies": ["defrag"],
        "systems": ["ag-ep"], "baseline": "ag-ep", "scenarios": {"clean": {}, "hops": burst("hops"),
                                                                  "stall": burst("stall")}})
    spec = load_spec("models/specs/tiny.yaml")
    assert spec.num_layers == 3
    itl = {r["scenario"]: r["itl_p50_ms"] for r in run_bench(cfg, spec, tmp_path)["results"]}
    assert itl["hops"] - itl["clean"] == pytest.approx(10.0, abs=0.01)
    assert itl["stall"] - itl["clean"] == pytest.approx(6.0, abs=0.01)
    bad = cfg.model_copy(update={"systems": ["a2a-ep"], "baseline": "a2a-ep"})   # priced message by message
    with pytest.raises(UserError, match="collectives: stall"):
        run_bench(bad, spec, tmp_path / "a2a")
