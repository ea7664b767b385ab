"""coordinator.topology: graph generators, signs, phases, mixing weights and time-varying peer schedules."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from coordinator.topology import (
    DYNAMIC_KINDS,
    ECL_RANDOM8_EDGES,
    KINDS,
    Topology,
    build_topology,
    directed_mixing_matrix,
    edge_phases,
    edge_sign,
    in_peers,
    is_column_stochastic,
    is_doubly_stochastic,
    is_passive,
    is_row_stochastic,
    mixing_matrix,
    node_plan,
    offsets,
    out_peers,
    peer_schedule,
    schedule_period,
)
from nodeagent.jobspec import TopologySpec

pytestmark = pytest.mark.unit


def build(kind: str, nodes: int, seed: int = 0, **options: Any) -> Topology:
    return build_topology(TopologySpec(kind=kind, seed=seed, options=options), nodes)


def degrees(topology: Topology) -> list[int]:
    return [topology.degree(rank) for rank in range(topology.nodes)]


def strongly_connected(nodes: int, arcs: set[tuple[int, int]]) -> bool:
    """Every rank reaches every other along the directed arcs (transitive closure by repeated squaring)."""
    reach = np.eye(nodes, dtype=bool)
    for src, dst in arcs:
        reach[src, dst] = True
    for _ in range(nodes.bit_length()):
        reach = reach | ((reach.astype(int) @ reach.astype(int)) > 0)
    return bool(reach.all())


# ----------------------------------------------------------------------------------------------------
# Undirected generators


@pytest.mark.parametrize(
    ("nodes", "edges"),
    [(1, ()), (2, ((0, 1),)), (3, ((0, 1), (0, 2), (1, 2))), (8, None)],
)
def test_ring_small_and_regular(nodes: int, edges: tuple[tuple[int, int], ...] | None) -> None:
    ring = build("ring", nodes)
    if edges is not None:
        assert ring.edges == edges
    else:
        assert len(ring.edges) == 8
        assert degrees(ring) == [2] * 8
        assert ring.neighbors(0) == [1, 7]
    assert ring.is_connected()


@pytest.mark.parametrize(("nodes", "edge_count", "degree"), [(3, 3, 2), (4, 6, 3), (5, 10, 4), (8, 16, 4)])
def test_multiplex_ring_dedupes_on_small_graphs(nodes: int, edge_count: int, degree: int) -> None:
    graph = build("multiplex-ring", nodes)
    assert len(graph.edges) == edge_count
    assert degrees(graph) == [degree] * nodes
    assert len(set(graph.edges)) == len(graph.edges)


def test_multiplex_ring_neighbours_at_distance_one_and_two() -> None:
    assert build("multiplex-ring", 8).neighbors(0) == [1, 2, 6, 7]


@pytest.mark.parametrize("nodes", [1, 2, 5, 9])
def test_complete(nodes: int) -> None:
    graph = build("complete", nodes)
    assert len(graph.edges) == nodes * (nodes - 1) // 2
    assert degrees(graph) == [nodes - 1] * nodes


@pytest.mark.parametrize("nodes", [2, 6])
def test_star_centre_zero(nodes: int) -> None:
    graph = build("star", nodes)
    assert degrees(graph) == [nodes - 1] + [1] * (nodes - 1)
    assert graph.neighbors(nodes - 1) == [0]
    assert graph.is_connected()


def test_torus_4x4_wraps_with_degree_4() -> None:
    graph = build("torus", 16, rows=4, cols=4)
    assert len(graph.edges) == 32
    assert degrees(graph) == [4] * 16
    assert graph.neighbors(0) == [1, 3, 4, 12]


def test_torus_default_is_most_square() -> None:
    assert build("torus", 16).edges == build("torus", 16, rows=4, cols=4).edges
    assert build("torus", 12).edges == build("torus", 12, rows=3, cols=4).edges
    # A prime has only the 1 x n factorisation: a ring.
    assert build("torus", 7).edges == build("ring", 7).edges
    # One option derives the other.
    assert build("torus", 12, cols=6).edges == build("torus", 12, rows=2, cols=6).edges


@pytest.mark.parametrize("options", [{"rows": 3, "cols": 3}, {"rows": 5}, {"cols": 0}, {"rows": "4"}])
def test_torus_bad_shape(options: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="torus"):
        build("torus", 16, **options)


@pytest.mark.parametrize("kind", ["random-regular", "random"])
@pytest.mark.parametrize(("nodes", "degree"), [(10, 3), (16, 4), (30, 2), (2, 1)])
def test_random_regular_connected(kind: str, nodes: int, degree: int) -> None:
    graph = build(kind, nodes, seed=5, degree=degree)
    assert degrees(graph) == [degree] * nodes
    assert graph.is_connected()


def test_random_regular_of_degree_2_is_one_cycle_on_many_nodes() -> None:
    """Drawn directly: redrawing whole graphs until one is a single cycle took dozens of tries on 4096 nodes."""
    graph = build("random-regular", 4096, seed=3, degree=2)
    assert degrees(graph) == [2] * 4096 and graph.is_connected()
    assert graph != build("ring", 4096) and graph == build("random-regular", 4096, seed=3, degree=2)


def test_random_regular_seeded() -> None:
    first = build("random", 20, seed=1, degree=3)
    assert build("random", 20, seed=1, degree=3) == first
    assert any(build("random", 20, seed=seed, degree=3).edges != first.edges for seed in (2, 3, 4))


@pytest.mark.parametrize(
    ("nodes", "options", "message"),
    [
        (9, {}, "'degree' is required"),
        (9, {"degree": 3}, "even"),
        (9, {"degree": 9}, "1..8"),
        (9, {"degree": True}, "integer"),
        (4, {"degree": 1}, "never"),
    ],
)
def test_random_regular_bad_degree(nodes: int, options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build("random-regular", nodes, **options)


def test_exponential_static() -> None:
    graph = build("exponential", 8)
    assert graph.neighbors(0) == [1, 2, 4, 6, 7]
    assert len(graph.edges) == 20
    assert degrees(graph) == [5] * 8


def test_ecl_random8_exact() -> None:
    graph = build("ecl-random8", 8)
    assert graph.edges == ((0, 1), (0, 4), (0, 6), (0, 7), (1, 6), (2, 4), (2, 5), (3, 6), (3, 7), (4, 5))
    assert graph.edges == ECL_RANDOM8_EDGES
    assert graph.is_connected()
    with pytest.raises(ValueError, match="8"):
        build("ecl-random8", 7)


def test_edge_list_text() -> None:
    graph = build("edge-list", 4, edges="# a triangle and a tail\n0 1\n1 2  # trailing comment\n\n2 0\n1 0\n2 3\n")
    assert graph.edges == ((0, 1), (0, 2), (1, 2), (2, 3))
    assert graph.is_connected()


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("0 1\n1 2 3\n", "edges line 2: expected two ranks 'a b'$"),
        ("0 1\n# x\n1 secret\n", "edges line 3: expected two ranks 'a b'$"),
        ("0 4\n", "edges line 1: a rank is not in 0..3$"),
        ("2 2\n", "edges line 1: self loop 2-2$"),
    ],
)
def test_edge_list_bad_line_names_it_and_does_not_repeat_it(body: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build("edge-list", 4, edges=body)


def test_edge_list_reads_no_file(tmp_path: Path) -> None:
    """A path is the command line's to read (nodeagent.jobspec.load_job_file): here it is no option at all."""
    path = tmp_path / "graph.txt"
    path.write_text("0 1\n1 2\n2 3\n")
    with pytest.raises(ValueError, match="unknown option\\(s\\) path; allowed: edges"):
        build("edge-list", 4, path=str(path))
    with pytest.raises(ValueError, match="option 'edges' must be the text of an edge file"):
        build("edge-list", 4)
    with pytest.raises(ValueError, match="option 'edges' must be the text"):
        build("edge-list", 4, edges=[[0, 1], [1, 2]])


def test_disconnected_graph_detected() -> None:
    assert not build("edge-list", 4, edges="0 1\n2 3\n").is_connected()
    assert not Topology(3, ((0, 1),)).is_connected()


_CIRCULANT_LIKE = [kind for kind in KINDS if kind not in ("edge-list", "ecl-random8", "random", "random-regular")]


@pytest.mark.parametrize(
    ("kind", "nodes", "options"),
    [(kind, nodes, {}) for kind in _CIRCULANT_LIKE for nodes in (1, 2, 3, 6, 8)]
    + [(kind, nodes, {"degree": min(2, nodes - 1)}) for kind in ("random", "random-regular") for nodes in (2, 3, 6)],
)
def test_every_kind_connected_and_simple(kind: str, nodes: int, options: dict[str, Any]) -> None:
    graph = build(kind, nodes, **options)
    assert graph.is_connected()
    assert all(a < b for a, b in graph.edges)
    assert list(graph.edges) == sorted(set(graph.edges))


def test_unknown_kind_and_option_named() -> None:
    with pytest.raises(ValueError, match="'hypercube'"):
        build("hypercube", 8)
    with pytest.raises(ValueError, match=r"unknown option.*width"):
        build("ring", 8, width=3)
    with pytest.raises(ValueError, match="at least one node"):
        build("ring", 0)


@pytest.mark.parametrize("edges", [((1, 0),), ((0, 2), (0, 1)), ((0, 1), (0, 1)), ((0, 3),), ((1, 1),)])
def test_topology_rejects_malformed_edges(edges: tuple[tuple[int, int], ...]) -> None:
    with pytest.raises(ValueError):
        Topology(3, edges)


# ----------------------------------------------------------------------------------------------------
# Signs, phases, plans, weights


def test_edge_sign_antisymmetric() -> None:
    for i in range(5):
        for j in range(5):
            if i != j:
                assert edge_sign(i, j) == -edge_sign(j, i)
                assert edge_sign(i, j) == (1 if i < j else -1)
    with pytest.raises(ValueError):
        edge_sign(2, 2)


def test_edge_phases_range_determinism_seed() -> None:
    graph = build("ecl-random8", 8)
    phases = edge_phases(graph, interval=8, seed=3)
    assert set(phases) == {(a, b) for a, b in graph.edges} | {(b, a) for a, b in graph.edges}
    assert all(0 <= phase < 8 for phase in phases.values())
    assert edge_phases(graph, interval=8, seed=3) == phases
    assert edge_phases(graph, interval=8, seed=4) != phases
    # Endpoints draw independently: on a larger graph some edge has different phases at its two ends.
    big = edge_phases(build("complete", 10), interval=8, seed=0)
    assert any(big[(a, b)] != big[(b, a)] for a, b in build("complete", 10).edges)
    assert set(edge_phases(graph, interval=1, seed=0).values()) == {0}
    with pytest.raises(ValueError):
        edge_phases(graph, interval=0, seed=0)


@pytest.mark.parametrize("weights", ["uniform", "metropolis-hastings"])
def test_node_plan_matches_pieces(weights: str) -> None:
    graph = build("ecl-random8", 8)
    phases = edge_phases(graph, interval=8, seed=7)
    matrix = mixing_matrix(graph, weights)  # type: ignore[arg-type]
    for rank in range(8):
        plan, self_weight = node_plan(graph, rank, interval=8, seed=7, weights=weights)  # type: ignore[arg-type]
        assert [p.rank for p in plan] == graph.neighbors(rank)
        for p in plan:
            assert p.sign == edge_sign(rank, p.rank)
            assert p.phase == phases[(rank, p.rank)]
            assert p.weight == pytest.approx(matrix[rank, p.rank])
        assert self_weight == pytest.approx(matrix[rank, rank])
        assert self_weight + sum(p.weight for p in plan) == pytest.approx(1.0)


def test_mixing_weights_on_irregular_graph() -> None:
    graph = build("star", 5)
    metropolis = mixing_matrix(graph, "metropolis-hastings")
    uniform = mixing_matrix(graph, "uniform")
    assert is_doubly_stochastic(metropolis)
    assert np.allclose(metropolis, metropolis.T)
    assert metropolis[1, 0] == pytest.approx(1 / 5)
    assert is_row_stochastic(uniform)
    assert not is_doubly_stochastic(uniform)
    assert not is_column_stochastic(uniform)
    # On a regular graph the two coincide and both are doubly stochastic.
    ring = build("ring", 6)
    assert np.allclose(mixing_matrix(ring, "uniform"), mixing_matrix(ring, "metropolis-hastings"))
    assert is_doubly_stochastic(mixing_matrix(ring, "uniform"))
    with pytest.raises(ValueError, match="'max-degree'"):
        mixing_matrix(ring, "max-degree")  # type: ignore[arg-type]


def test_stochastic_checks_reject_negative_and_non_square() -> None:
    assert not is_doubly_stochastic(np.array([[1.5, -0.5], [-0.5, 1.5]]))
    assert not is_row_stochastic(np.ones((2, 3)) / 3)


# ----------------------------------------------------------------------------------------------------
# Time-varying graphs


def test_dynamic_exponential_rotation_for_8_nodes() -> None:
    assert offsets("dynamic-exponential", 8) == [1, 7, 2, 6, 4]
    sequence = [out_peers("dynamic-exponential", 8, 3, t) for t in range(7)]
    assert sequence == [[4], [2], [5], [1], [7], [4], [2]]
    # k = 2 takes the next two offsets of the rotation, wrapping around.
    assert [out_peers("dynamic-exponential", 8, 0, t, 2) for t in range(3)] == [[1, 7], [2, 6], [4, 1]]


def test_dynamic_exponential_small_sizes() -> None:
    assert offsets("dynamic-exponential", 1) == []
    assert out_peers("dynamic-exponential", 1, 0, 5) == []
    assert offsets("dynamic-exponential", 2) == [1]
    assert offsets("dynamic-exponential", 3) == [1, 2]
    with pytest.raises(ValueError, match="too many"):
        out_peers("dynamic-exponential", 2, 0, 0, 2)


def test_npeer_exponential_offsets() -> None:
    assert offsets("npeer-exponential", 8, 1) == [1, 2, 4]
    assert offsets("npeer-exponential", 8, 2) == [1, 2, 3, 6]
    assert offsets("npeer-exponential", 16, 3) == [1, 2, 3, 4, 8, 12]
    assert [out_peers("npeer-exponential", 8, 5, t, 2) for t in range(2)] == [[6, 7], [0, 3]]


def test_bipartite_kinds() -> None:
    assert offsets("bipartite-exponential", 8) == [1, 7, 3, 5]
    assert offsets("bipartite-exponential", 16) == [1, 15, 3, 13, 5, 11, 9, 7]
    assert offsets("bipartite-linear", 16) == [1, 15, 3, 13, 5, 11, 7, 9]
    for kind in ("bipartite-exponential", "bipartite-linear"):
        for t in range(8):
            for rank in range(16):
                peers = out_peers(kind, 16, rank, t)
                assert is_passive(kind, rank) == (peers == [])
                assert all(is_passive(kind, peer) for peer in peers)
        with pytest.raises(ValueError, match="even"):
            offsets(kind, 7)
    # Even ranks are passive (answer only), odd ranks active (initiate).
    assert is_passive("bipartite-exponential", 0)
    assert not is_passive("bipartite-exponential", 1)
    assert out_peers("bipartite-exponential", 8, 0, 0) == []
    assert [out_peers("bipartite-exponential", 8, 3, t) for t in range(4)] == [[4], [2], [6], [0]]
    assert not is_passive("dynamic-exponential", 0)


@pytest.mark.parametrize("kind", DYNAMIC_KINDS)
@pytest.mark.parametrize(("nodes", "k"), [(8, 1), (8, 2), (16, 1), (12, 3)])
def test_in_peers_mirror_out_peers(kind: str, nodes: int, k: int) -> None:
    for t in range(6):
        arcs = {(r, p) for r in range(nodes) for p in out_peers(kind, nodes, r, t, k)}
        assert arcs == {(s, r) for r in range(nodes) for s in in_peers(kind, nodes, r, t, k)}


@pytest.mark.parametrize("kind", DYNAMIC_KINDS)
@pytest.mark.parametrize(("nodes", "k"), [(2, 1), (6, 1), (8, 1), (8, 2), (16, 3), (20, 2)])
def test_union_over_a_period_strongly_connected(kind: str, nodes: int, k: int) -> None:
    period = len(offsets(kind, nodes, k))
    arcs = {(r, p) for t in range(period) for r in range(nodes) for p in out_peers(kind, nodes, r, t, k)}
    if kind.startswith("bipartite-"):
        arcs |= {(p, r) for r, p in arcs}  # bilateral: the passive end answers on the same exchange
    assert strongly_connected(nodes, arcs)


@pytest.mark.parametrize("kind", DYNAMIC_KINDS)
@pytest.mark.parametrize(("nodes", "k"), [(6, 1), (8, 2), (12, 3), (16, 5), (20, 2)])
def test_union_and_schedules_are_those_of_out_peers_over_a_period(kind: str, nodes: int, k: int) -> None:
    spec = TopologySpec(kind=kind, options={"peers_per_iteration": k})
    period = schedule_period(kind, nodes, k)
    arcs = {(r, p) for t in range(period) for r in range(nodes) for p in out_peers(kind, nodes, r, t, k)}
    assert build_topology(spec, nodes).edges == tuple(sorted({(min(a, b), max(a, b)) for a, b in arcs}))
    for rank in range(nodes):
        expected = tuple(tuple(out_peers(kind, nodes, rank, t, k)) for t in range(period))
        assert peer_schedule(spec, nodes, rank) == expected


def test_dynamic_mixing_weights_are_checked_with_the_graph() -> None:
    """Not first when the coordinator plans a node, which would fail the assignment of a job it accepted."""
    with pytest.raises(ValueError, match="option 'weights' must be one of uniform, metropolis-hastings, got 'x"):
        build("dynamic-exponential", 8, weights="x" * 1000)
    assert build("dynamic-exponential", 8, weights="metropolis-hastings").nodes == 8


def test_single_iteration_not_strongly_connected_check_can_fail() -> None:
    # The connectivity helper itself must be able to say no: one iteration of +2 on 8 nodes is two cycles.
    arcs = {(r, p) for r in range(8) for p in out_peers("dynamic-exponential", 8, r, 2)}
    assert not strongly_connected(8, arcs)


def test_directed_mixing_matrix_column_stochastic() -> None:
    peers = [out_peers("npeer-exponential", 8, r, 0, 2) for r in range(8)]
    matrix = directed_mixing_matrix(8, peers)
    assert is_column_stochastic(matrix)
    assert matrix[1, 0] == pytest.approx(1 / 3)
    assert matrix[0, 0] == pytest.approx(1 / 3)
    # Unequal out-degrees: still column-stochastic, no longer row-stochastic; push-sum (ratio of the numerator
    # to the weight) still reaches the exact average, where the numerator alone is biased.
    uneven = directed_mixing_matrix(3, [[1, 2], [0], [1]])
    assert is_column_stochastic(uneven)
    assert not is_row_stochastic(uneven)
    values, weights = np.array([0.0, 3.0, 9.0]), np.ones(3)
    for _ in range(200):
        values, weights = uneven @ values, uneven @ weights
    assert np.allclose(values / weights, 4.0)
    assert not np.allclose(values, 4.0)


@pytest.mark.parametrize("bad", [[[1], [0]], [[0], [0], [0]], [[1, 1], [0], [0]], [[3], [0], [0]]])
def test_directed_mixing_matrix_validates(bad: list[list[int]]) -> None:
    with pytest.raises(ValueError):
        directed_mixing_matrix(3, bad)


def test_unknown_dynamic_kind_named() -> None:
    with pytest.raises(ValueError, match="'ring'"):
        offsets("ring", 8)
    with pytest.raises(ValueError, match="iteration"):
        out_peers("dynamic-exponential", 8, 0, -1)
    with pytest.raises(ValueError, match="rank"):
        out_peers("dynamic-exponential", 8, 8, 0)
