"""The token-level dataflow graph: shape, LayerID keys, and `graph_problems` (every invariant build_graph keeps,
checked here) catching each broken one."""
from __future__ import annotations

from pathlib import Path

import networkx as nx
import pytest

from graph_ir.graph import LayerID, build_graph as compact_graph, per_home, to_dot
from graph_ir.spec import load_spec
from lowering.placement import annotate, contiguous
from lowering.plan import Placement

SPECS = Path(__file__).resolve().parents[1] / "models" / "specs"
TINY = sorted(p.stem for p in SPECS.glob("tiny*.yaml"))


NODE_KINDS = ("attention", "expert", "merge", "sample")


def build_graph(spec, ranks, placement=None, homes=None):
    """The per-home graph on `ranks` ranks (the compact graph placed, then expanded), experts placed contiguously
    unless `placement` says, every home unless `homes`."""
    if placement is None:
        placement = [contiguous(spec.experts.num_experts, ranks) if spec.is_moe_layer(l) else []
                     for l in range(spec.num_layers)]
    g = compact_graph(spec)
    g.graph["ranks"] = ranks
    annotate(g, Placement(expert_rank=placement))
    return per_home(g, range(ranks) if homes is None else homes)


class GraphValidationError(ValueError):
    """The graph breaks an invariant, listed problem by problem."""


def graph_problems(g: nx.DiGraph) -> list[str]:
    """Every broken invariant, as readable lines (empty list: the graph is valid)."""
    L, E, k = g.graph["num_layers"], g.graph["num_experts"], g.graph["top_k"]
    ranks = g.graph["ranks"]
    dense = set(g.graph["dense_layers"])
    problems: list[str] = []
    homes = sorted({lid.home_rank for _, lid in g.nodes})
    for node, data in g.nodes(data=True):
        kind, lid = node
        if kind not in NODE_KINDS:
            problems.append(f"{node}: unknown node kind {kind!r}")
            continue
        if g.degree(node) == 0:
            problems.append(f"{node}: orphan node (no edges)")
        if not 0 <= data["rank"] < ranks:
            problems.append(f"{node}: runs on rank {data['rank']}, outside 0..{ranks - 1}")
        if kind == "expert":
            if not 0 <= lid.expert < E:
                problems.append(f"{node}: expert id {lid.expert} outside 0..{E - 1}")
            if lid.layer in dense:
                problems.append(f"{node}: expert node in dense layer {lid.layer}")
        elif lid.expert != -1:
            problems.append(f"{node}: {kind} node must have expert -1")
        if kind == "merge":
            sources = [p for p in g.predecessors(node) if p[0] == "expert" and p[1].layer == lid.layer
                       and p[1].home_rank == lid.home_rank]
            got = sorted(p[1].expert for p in sources)
            if got != list(range(E)):
                problems.append(f"{node}: merge fed by experts {got}, needs all {E} experts of layer {lid.layer}")
            if k > g.in_degree(node):
                problems.append(f"{node}: top_k {k} > {g.in_degree(node)} inputs: a token could never complete")
        for succ in g.successors(node):
            if succ[1].home_rank != lid.home_rank:
                problems.append(f"{node} -> {succ}: edge crosses homes; a request never leaves its home")
    for h in homes:
        sample, first = ("sample", LayerID(L, h)), ("attention", LayerID(0, h))
        if sample not in g or first not in g:
            problems.append(f"home {h}: missing sample or layer-0 attention node")
            continue
        if not g.has_edge(sample, first):
            problems.append(f"home {h}: chain does not close (no edge sample -> attention(0))")
        # One traversal each way per home, not a path search per layer: has_path per layer made this
        # O(layers^2 x experts) (minutes for a 256-layer, 512-expert spec).
        after_first = nx.descendants(g, first) | {first}
        before_sample = nx.ancestors(g, sample) | {sample}
        for layer in range(L):
            a = ("attention", LayerID(layer, h))
            if a not in g:
                problems.append(f"home {h}: no attention node for layer {layer}")
            elif a not in after_first or a not in before_sample:
                problems.append(f"home {h}: layer {layer} attention is not on the chain attention(0) -> sample")
            if layer not in dense and ("merge", LayerID(layer, h)) not in g:
                problems.append(f"home {h}: MoE layer {layer} has no merge node")
    return problems


def validate_graph(g: nx.DiGraph) -> None:
    problems = graph_problems(g)
    if problems:
        shown = problems[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else [])
        raise GraphValidationError("dataflow graph is invalid:\n  " + "\n  ".join(shown))


@pytest.mark.parametrize("name", TINY)
@pytest.mark.parametrize("ranks", [1, 3, 12])
def test_tiny_graphs_are_valid_and_have_the_expected_shape(name, ranks):
    spec = load_spec(SPECS / f"{name}.yaml")
    g = build_graph(spec, ranks)
    validate_graph(g)
    E, moe = spec.experts.num_experts, spec.moe_layers
    per_home = spec.num_layers + len(moe) * (E + 1) + 1  # attention, experts + merge, sample
    assert g.number_of_nodes() == ranks * per_home
    for h in range(ranks):
        for layer in moe:
            merge = ("merge", LayerID(layer, h))
            assert g.in_degree(merge) == E >= spec.experts.top_k
            assert {p[1].expert for p in g.predecessors(merge)} == set(range(E))
        # The chain: attention(0) reaches sample, and sample closes the loop back to attention(0).
        assert nx.has_path(g, ("attention", LayerID(0, h)), ("sample", LayerID(spec.num_layers, h)))
        assert g.has_edge(("sample", LayerID(spec.num_layers, h)), ("attention", LayerID(0, h)))


def test_dense_layers_skip_experts_and_expert_nodes_run_where_placed():
    spec = load_spec(SPECS / "tiny-deepseek-v2.yaml")  # layer 0 dense
    g = build_graph(spec, 4)
    assert g.has_edge(("attention", LayerID(0, 2)), ("attention", LayerID(1, 2)))
    assert not any(n[0] == "expert" and n[1].layer == 0 for n in g)
    placement = [[], [3] * 10, [e % 4 for e in range(10)]]
    g = build_graph(spec, 4, placement)
    validate_graph(g)
    assert g.nodes[("expert", LayerID(1, 0, 7))]["rank"] == 3
    assert g.nodes[("expert", LayerID(2, 1, 6))]["rank"] == 2
    assert g.nodes[("attention", LayerID(2, 1))]["rank"] == 1  # attention runs on the home rank


def test_homes_subset_builds_one_subgraph():
    spec = load_spec(SPECS / "tiny.yaml")
    g = build_graph(spec, 8, homes=[5])
    validate_graph(g)
    assert {n[1].home_rank for n in g} == {5}


@pytest.fixture
def graph():
    return build_graph(load_spec(SPECS / "tiny-qwen3-moe.yaml"), 2)


def test_missing_expert_input_to_merge_is_caught(graph):
    graph.remove_edge(("expert", LayerID(1, 0, 3)), ("merge", LayerID(1, 0)))
    assert any("merge fed by experts" in p for p in graph_problems(graph))
    with pytest.raises(GraphValidationError, match="needs all 8 experts"):
        validate_graph(graph)


def test_open_chain_is_caught(graph):
    graph.remove_edge(("sample", LayerID(3, 1)), ("attention", LayerID(0, 1)))
    assert any("chain does not close" in p for p in graph_problems(graph))


def test_orphan_and_out_of_range_expert_are_caught(graph):
    graph.add_node(("expert", LayerID(1, 0, 99)), kind="expert", lid=LayerID(1, 0, 99), rank=0)
    problems = graph_problems(graph)
    assert any("orphan" in p for p in problems)
    assert any("expert id 99 outside 0..7" in p for p in problems)


def test_top_k_larger_than_inputs_is_caught(graph):
    graph.graph["top_k"] = 9
    assert any("top_k 9 > 8 inputs" in p for p in graph_problems(graph))


def test_cross_home_edge_is_caught(graph):
    graph.add_edge(("merge", LayerID(0, 0)), ("attention", LayerID(1, 1)))
    assert any("crosses homes" in p for p in graph_problems(graph))


def test_dot_output_lists_every_node_and_edge():
    spec = load_spec(SPECS / "tiny.yaml")
    g = build_graph(spec, 2)
    dot = to_dot(g)
    assert dot.startswith('digraph "tiny"') and dot.rstrip().endswith("}")
    assert dot.count(" -> ") == g.number_of_edges()
    assert dot.count("[label=") == g.number_of_nodes()
    assert dot.count('label="next step"') == 2  # one closing edge per home
    assert "cluster_home1" in dot
