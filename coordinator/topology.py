"""Communication graphs: generators, edge signs and phases, mixing weights, and time-varying peer schedules.

Two families, both pure functions of (kind, nodes, seed, options) so that the coordinator, the simulator
and the CLI build the same graph for the same job:

- Undirected static graphs (`KINDS`), built by `build_topology` from a `TopologySpec`. Every edge carries a
  sign for PDMM/ADMM-ISVR (`edge_sign`) and, per endpoint, a phase for the asynchronous exchange schedule
  (`edge_phases`). `node_plan` bundles what one node needs.
- Time-varying graphs for SGP and AD-PSGD (`DYNAMIC_KINDS`): circulant graphs whose offsets rotate, one
  group per iteration (`offsets`, `out_peers`, `in_peers`, `is_passive`).

Ranks are 0..nodes-1 and an edge (a, b) has a < b. Mixing matrices act as
x_new = W @ x, so W[i, j] is the weight node i gives to node j's value.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal, get_args

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from nodeagent.jobspec import MAX_SHOWN_CHARS, TopologySpec, shown
from nodeagent.text import clip

Edge = tuple[int, int]
WeightKind = Literal["uniform", "metropolis-hastings"]
WEIGHT_KINDS: tuple[str, ...] = get_args(WeightKind)

KINDS: tuple[str, ...] = (
    "ring",
    "multiplex-ring",
    "complete",
    "star",
    "torus",
    "random-regular",
    "random",
    "edge-list",
    "ecl-random8",
    "exponential",
)
DYNAMIC_KINDS: tuple[str, ...] = (
    "dynamic-exponential",
    "npeer-exponential",
    "bipartite-exponential",
    "bipartite-linear",
)

# The 8-node random graph of the ECL-ISVR experiments, kept verbatim so that results are comparable.
ECL_RANDOM8_EDGES: tuple[Edge, ...] = (
    (0, 1), (0, 4), (0, 6), (0, 7), (1, 6), (2, 4), (2, 5), (3, 6), (3, 7), (4, 5),
)  # fmt: skip

# The most edges a job's graph may have (for the dynamic kinds: the union of one period), and the most sends one
# period of a dynamic kind's schedule may hold over all nodes (nodes x iterations x peers per iteration), so that
# building the graph and planning every node stays well under 2 s at the coordinator (benchmarks/planning.py). On
# MAX_NODES nodes the rings, star and torus stay below them; on 4096 nodes exponential has 47,104 edges and SGP's
# dynamic exponential graph with 2 peers per iteration 188,416 sends; complete fits up to 362 nodes. The kinds that
# could exceed them count before they build.
MAX_EDGES = 65_536
MAX_PERIOD_SENDS = 262_144

# A random d-regular graph with d >= 3 is connected with high probability (d = 2 is drawn as one cycle). The bound
# keeps a failure unlikely on thousands of nodes while guaranteeing termination.
_RANDOM_ATTEMPTS = 1000


# ----------------------------------------------------------------------------------------------------
# Undirected static graphs


@dataclass(frozen=True)
class Topology:
    """An undirected simple graph on ranks 0..nodes-1.

    `edges` holds each edge once as (a, b) with a < b, sorted, without duplicates or self loops; the
    constructor checks this so that every consumer can rely on it. `passive` are the ranks that never start
    an exchange, they only answer (the even ranks of the bipartite time-varying kinds).
    """

    nodes: int
    edges: tuple[Edge, ...]
    passive: frozenset[int] = frozenset()
    schedule_period: int = 1  # a dynamic kind's iterations before its rotation repeats (1: a static graph)
    # (interval, seed) -> phase draws (see phase_draws): drawn once, read by every node's plan.
    _draws: dict[tuple[int, int], np.ndarray] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise ValueError(f"a topology needs at least one node, got {self.nodes}")
        if any(not 0 <= rank < self.nodes for rank in self.passive):
            raise ValueError(f"passive ranks must lie in 0..{self.nodes - 1}")
        for a, b in self.edges:
            if not 0 <= a < b < self.nodes:
                raise ValueError(f"edge ({a}, {b}) must satisfy 0 <= a < b < {self.nodes}")
        if any(first >= second for first, second in zip(self.edges, self.edges[1:], strict=False)):
            raise ValueError("edges must be sorted and free of duplicates")

    @cached_property
    def _adjacency(self) -> tuple[tuple[int, ...], ...]:
        # Built once: neighbours are asked for often, and scanning the edge list each time is O(E). The edges are
        # sorted, so each rank meets its lower neighbours in order, then its higher ones: every list comes sorted.
        adjacent: list[list[int]] = [[] for _ in range(self.nodes)]
        for a, b in self.edges:
            adjacent[a].append(b)
            adjacent[b].append(a)
        return tuple(tuple(peers) for peers in adjacent)

    @cached_property
    def _edge_keys(self) -> np.ndarray:
        # a * nodes + b of each edge, ascending since the edges are sorted: an edge's index by binary search.
        return np.array([a * self.nodes + b for a, b in self.edges], dtype=np.int64).reshape(-1)

    def edge_indices(self, rank: int, peers: Sequence[int]) -> np.ndarray:
        """The index in `edges` of the edge between `rank` and each of `peers` (which must be its neighbours)."""
        keys = [min(rank, peer) * self.nodes + max(rank, peer) for peer in peers]
        return np.searchsorted(self._edge_keys, np.array(keys, dtype=np.int64))

    def phase_draws(self, interval: int, seed: int) -> np.ndarray:
        """Row i: the phases of edge i = (a, b), at which a and b start an exchange on it (see `edge_phases`).
        Drawn once per interval and seed: a plan per node that drew them all would cost O(nodes x edges)."""
        if interval < 1:
            raise ValueError(f"interval must be >= 1, got {interval}")
        draws = self._draws.get((interval, seed))
        if draws is None:
            draws = np.random.default_rng(seed).integers(0, interval, size=(len(self.edges), 2))
            self._draws[(interval, seed)] = draws
        return draws

    def neighbors(self, rank: int) -> list[int]:
        """The neighbours of `rank`, sorted."""
        _check_rank(rank, self.nodes)
        return list(self._adjacency[rank])

    def degree(self, rank: int) -> int:
        _check_rank(rank, self.nodes)
        return len(self._adjacency[rank])

    def is_connected(self) -> bool:
        seen = {0}
        frontier = [0]
        while frontier:
            rank = frontier.pop()
            for peer in self._adjacency[rank]:
                if peer not in seen:
                    seen.add(peer)
                    frontier.append(peer)
        return len(seen) == self.nodes


def _check_rank(rank: int, nodes: int) -> None:
    if not 0 <= rank < nodes:
        raise ValueError(f"rank {rank} is not in 0..{nodes - 1}")


def _normalise(pairs: Iterable[Edge]) -> tuple[Edge, ...]:
    """Undirected, deduplicated, sorted edges; self loops dropped (small circulant graphs wrap onto
    themselves)."""
    return tuple(sorted({(a, b) if a < b else (b, a) for a, b in pairs if a != b}))


def _circulant(nodes: int, distances: Iterable[int]) -> list[Edge]:
    """Every rank joined to the ranks `distance` ahead of it, modulo `nodes`."""
    return [(rank, (rank + distance) % nodes) for rank in range(nodes) for distance in distances]


def _powers_of_two_below(limit: int) -> list[int]:
    # Integer arithmetic: floor(log2(n - 1)) through floats misrounds for large n.
    powers = []
    power = 1
    while power < limit:
        powers.append(power)
        power *= 2
    return powers


def _int_option(spec: TopologySpec, name: str) -> int:
    value = spec.options.get(name)
    if value is None:
        raise ValueError(f"topology {spec.kind!r}: option {name!r} is required")
    # bool is an int in Python; `degree: true` in YAML is a mistake, not 1.
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"topology {spec.kind!r}: option {name!r} must be an integer, got {shown(value)}")
    return value


def _check_edge_count(spec: TopologySpec, count: int) -> None:
    """Before a graph is built: refuse one of more than MAX_EDGES edges, which would cost the coordinator dearly."""
    if count > MAX_EDGES:
        raise ValueError(f"topology {spec.kind!r}: {count} edges; a job's graph may have at most {MAX_EDGES}")


def _ring(spec: TopologySpec, nodes: int) -> Iterable[Edge]:
    return _circulant(nodes, [1])


def _multiplex_ring(spec: TopologySpec, nodes: int) -> Iterable[Edge]:
    return _circulant(nodes, [1, 2])


def _exponential(spec: TopologySpec, nodes: int) -> Iterable[Edge]:
    distances = _powers_of_two_below(nodes)
    # Distances d and nodes - d join the same pairs, and d = nodes / 2 joins each pair twice.
    offsets = {min(distance, nodes - distance) for distance in distances}
    _check_edge_count(spec, sum(nodes // 2 if 2 * offset == nodes else nodes for offset in offsets))
    return _circulant(nodes, distances)


def _complete(spec: TopologySpec, nodes: int) -> Iterable[Edge]:
    _check_edge_count(spec, nodes * (nodes - 1) // 2)
    return [(a, b) for a in range(nodes) for b in range(a + 1, nodes)]


def _star(spec: TopologySpec, nodes: int) -> Iterable[Edge]:
    return [(0, leaf) for leaf in range(1, nodes)]


def _torus(spec: TopologySpec, nodes: int) -> Iterable[Edge]:
    rows, cols = _torus_shape(spec, nodes)
    edges = []
    for row in range(rows):
        for col in range(cols):
            rank = row * cols + col
            edges.append((rank, row * cols + (col + 1) % cols))
            edges.append((rank, ((row + 1) % rows) * cols + col))
    return edges


def _torus_shape(spec: TopologySpec, nodes: int) -> tuple[int, int]:
    given = {name: _int_option(spec, name) for name in ("rows", "cols") if name in spec.options}
    if any(value < 1 for value in given.values()):
        raise ValueError(f"topology 'torus': rows and cols must be >= 1, got {given}")
    if not given:
        # The most square factorisation: the largest divisor not above sqrt(nodes) (1 for a prime: a ring).
        rows = max(d for d in range(1, int(nodes**0.5) + 1) if nodes % d == 0)
        cols = nodes // rows
    else:
        # One option given derives the other; the product check below catches a non-divisor.
        rows = given.get("rows", nodes // given.get("cols", 1))
        cols = given.get("cols", nodes // rows)
    if rows * cols != nodes:
        raise ValueError(f"topology 'torus': rows {rows} x cols {cols} does not equal nodes {nodes}")
    return rows, cols


def _random_regular(spec: TopologySpec, nodes: int) -> Iterable[Edge]:
    degree = _int_option(spec, "degree")
    if not 1 <= degree < nodes:
        raise ValueError(f"topology {spec.kind!r}: option 'degree' must be in 1..{nodes - 1}, got {degree}")
    if nodes * degree % 2:
        raise ValueError(f"topology {spec.kind!r}: nodes * degree must be even, got {nodes} * {degree}")
    if degree == 1 and nodes > 2:
        raise ValueError(f"topology {spec.kind!r}: degree 1 on {nodes} nodes can never be connected")
    _check_edge_count(spec, nodes * degree // 2)
    rng = np.random.default_rng(spec.seed)
    if degree == 2:
        # A connected 2-regular graph is one cycle through every rank: draw the order of the cycle. Redrawing
        # whole graphs until one is a single cycle took dozens of tries on 4096 nodes (about sqrt(nodes)).
        order = rng.permutation(nodes).tolist()
        return list(zip(order, order[1:] + order[:1], strict=True))
    for _ in range(_RANDOM_ATTEMPTS):
        edges = _random_regular_attempt(nodes, degree, rng)
        if edges is not None and Topology(nodes, _normalise(edges)).is_connected():
            return edges
    raise ValueError(
        f"topology {spec.kind!r}: no connected {degree}-regular graph on {nodes} nodes in {_RANDOM_ATTEMPTS} tries"
    )


def _random_regular_attempt(nodes: int, degree: int, rng: np.random.Generator) -> set[Edge] | None:
    """One try of the Steger-Wormald pairing: pair free stubs at random, keep the pairs that make a simple
    graph, re-pair the rest. Plain rejection of the whole configuration model fails almost always for degree
    above ~6; this succeeds almost always. Returns None when the leftover stubs cannot be paired."""
    edges: set[Edge] = set()
    stubs = [rank for rank in range(nodes) for _ in range(degree)]
    while stubs:
        leftover: dict[int, int] = {}
        shuffled = [stubs[i] for i in rng.permutation(len(stubs))]
        for a, b in zip(shuffled[0::2], shuffled[1::2], strict=True):
            edge = (min(a, b), max(a, b))
            if a != b and edge not in edges:
                edges.add(edge)
            else:
                leftover[a] = leftover.get(a, 0) + 1
                leftover[b] = leftover.get(b, 0) + 1
        pending = list(leftover)
        if pending and not any(
            (a, b) not in edges for i, a in enumerate(pending) for b in pending[i + 1 :]
        ):  # the ranks left with free stubs are already all joined: stuck
            return None
        stubs = [rank for rank, count in leftover.items() for _ in range(count)]
    return edges


def _edge_list(spec: TopologySpec, nodes: int) -> Iterable[Edge]:
    """Option `edges`: the text of an edge file (the command line inlines the file a job file names), one pair of
    ranks "a b" per line, '#' starting a comment. An error names the line and never repeats it."""
    text = spec.options.get("edges")
    if not isinstance(text, str):
        raise ValueError("topology 'edge-list': option 'edges' must be the text of an edge file, a line 'a b' per "
                         "edge")
    edges = []
    for number, line in enumerate(text.splitlines(), start=1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        where = f"topology 'edge-list': edges line {number}"
        try:
            a, b = (int(field) for field in fields)
        except ValueError:
            raise ValueError(f"{where}: expected two ranks 'a b'") from None
        if not (0 <= a < nodes and 0 <= b < nodes):
            raise ValueError(f"{where}: a rank is not in 0..{nodes - 1}")
        if a == b:
            raise ValueError(f"{where}: self loop {a}-{b}")
        edges.append((a, b))
    _check_edge_count(spec, len(edges))
    return edges


def _ecl_random8(spec: TopologySpec, nodes: int) -> Iterable[Edge]:
    if nodes != 8:
        raise ValueError(f"topology 'ecl-random8' is the fixed 8-node graph; the job has {nodes} nodes")
    return ECL_RANDOM8_EDGES


_Builder = Callable[[TopologySpec, int], Iterable[Edge]]
# kind -> builder; every kind of KINDS appears here.
_BUILDERS: dict[str, _Builder] = {
    "ring": _ring,
    "multiplex-ring": _multiplex_ring,
    "complete": _complete,
    "star": _star,
    "torus": _torus,
    "random-regular": _random_regular,
    "random": _random_regular,
    "edge-list": _edge_list,
    "ecl-random8": _ecl_random8,
    "exponential": _exponential,
}


# ----------------------------------------------------------------------------------------------------
# What each kind means and which options it takes: the job file's schema and reference (coordinator.jobschema)
# are generated from these, and the builders accept exactly the options named here (they check the values).


class KindOptions(BaseModel):
    """A kind's `topology.options`; a kind without options takes this one."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class TorusOptions(KindOptions):
    rows: int | None = Field(None, ge=1, description="rows of the grid; unset: nodes / cols, or with cols unset too "
                             "the most square factorisation of nodes")
    cols: int | None = Field(None, ge=1, description="columns of the grid; unset: nodes / rows")


class RandomRegularOptions(KindOptions):
    degree: int = Field(ge=1, description="every node's degree, in 1..nodes-1, with nodes * degree even")


class EdgeListOptions(KindOptions):
    edges: str = Field(description="the text of an edge file: a line 'a b' (two ranks) per edge, '#' starts a "
                       "comment; duplicates collapse")


class DynamicOptions(KindOptions):
    peers_per_iteration: int = Field(1, ge=1, description="out-peers of a node at each iteration")
    weights: WeightKind = Field("uniform", description="mixing weights of the neighbours in the union of one "
                                "period's graphs, for algorithms that mix with fixed weights (dsgd)")


KIND_OPTIONS: dict[str, type[KindOptions]] = {
    "torus": TorusOptions, "random-regular": RandomRegularOptions, "random": RandomRegularOptions,
    "edge-list": EdgeListOptions, **{kind: DynamicOptions for kind in DYNAMIC_KINDS},
}
KIND_MEANINGS: dict[str, str] = {
    "ring": "every rank joined to the next, a cycle (degree 2)",
    "multiplex-ring": "every rank joined to the ranks at distance 1 and 2 (degree 4)",
    "complete": "every pair of ranks joined",
    "star": "every rank joined to rank 0",
    "torus": "a 2-D grid that wraps around (degree 4; a side of 2 wraps onto the same neighbour)",
    "random-regular": "a random connected graph in which every rank has `degree` neighbours, seeded by "
    "topology.seed",
    "random": "the same as random-regular",
    "edge-list": "the edges given, from an edge file",
    "ecl-random8": "the fixed 8-node random graph of the ECL-ISVR experiments (nodes must be 8)",
    "exponential": "every rank joined to the ranks at distances 1, 2, 4, ... below nodes",
    "dynamic-exponential": "time-varying, directed (SGP): at iteration t a rank sends to one of +1, -1, +2, -2, "
    "+4, ... in turn",
    "npeer-exponential": "time-varying, directed (SGP): the n-peer forward exponential graph, each iteration one "
    "scale (k+1)^i with k = peers_per_iteration",
    "bipartite-exponential": "time-varying, bipartite (AD-PSGD): odd ranks initiate, even ranks answer, at odd "
    "distances 1, 3, 5, 9, 17, ... in turn (nodes must be even)",
    "bipartite-linear": "time-varying, bipartite (AD-PSGD): as bipartite-exponential over every odd distance",
}


def kind_options(kind: str) -> type[KindOptions]:
    """The options model of a kind of KINDS or DYNAMIC_KINDS."""
    return KIND_OPTIONS.get(kind, KindOptions)


def _check_option_names(spec: TopologySpec) -> None:
    """Refuse an option the kind does not take, naming those it does."""
    allowed = sorted(kind_options(spec.kind).model_fields)
    unknown = sorted(set(spec.options) - set(allowed))
    if unknown:
        shown_unknown = clip(", ".join(unknown), MAX_SHOWN_CHARS)
        raise ValueError(f"topology {spec.kind!r}: unknown option(s) {shown_unknown}; allowed: "
                         f"{', '.join(allowed) or 'none'}")


def build_topology(spec: TopologySpec, nodes: int) -> Topology:
    """The undirected graph of `spec` on `nodes` ranks. ValueError names the kind or option that is wrong.

    - ring, multiplex-ring (distances 1 and 2), exponential (distances 2^i < nodes): circulant graphs; on few
      nodes the distances coincide and the duplicate edges collapse (ring of 2 = one edge, of 1 = none).
    - complete; star (centre 0).
    - torus: options rows, cols (either derives the other); default the most square factorisation; wraps
      (a side of 2 wraps onto the same neighbour, so a 2 x m torus has degree 3, and 1 x m is a ring).
    - random-regular / random: option degree; a random simple degree-regular graph (Steger-Wormald), seeded by
      spec.seed, redrawn until connected.
    - edge-list: option edges, the text of an edge file: "a b" lines, '#' starts a comment; duplicates collapse.
    - ecl-random8: the ECL-ISVR fixture, nodes must be 8.
    """
    if nodes < 1:
        raise ValueError(f"a topology needs at least one node, got {nodes}")
    if spec.kind in DYNAMIC_KINDS:
        return _union_of_period(spec, nodes)
    if spec.kind not in _BUILDERS:
        raise ValueError(f"unknown topology kind {spec.kind!r}; known kinds: {', '.join(KINDS + DYNAMIC_KINDS)}")
    _check_option_names(spec)
    return Topology(nodes, _normalise(_BUILDERS[spec.kind](spec, nodes)))


# ----------------------------------------------------------------------------------------------------
# Signs, phases, per-node plans


def edge_sign(i: int, j: int) -> int:
    """A_ij of PDMM/ADMM-ISVR: +1 for the lower rank, -1 for the higher, so A_ij = -A_ji."""
    if i == j:
        raise ValueError(f"no edge sign for a self loop ({i}, {j})")
    return 1 if i < j else -1


def edge_phases(topology: Topology, interval: int, seed: int) -> dict[Edge, int]:
    """For each directed pair (i, j) of every edge, the phase in 0..interval-1 at which i starts an exchange
    on that edge. The two endpoints draw independently, so an edge is exchanged about twice per interval at
    random moments (the asynchronous model of ECL-ISVR). Draws go in edge order, (a, b) then (b, a)."""
    phases: dict[Edge, int] = {}
    for (a, b), (phase_a, phase_b) in zip(topology.edges, topology.phase_draws(interval, seed).tolist(), strict=True):
        phases[(a, b)] = phase_a
        phases[(b, a)] = phase_b
    return phases


@dataclass(frozen=True)
class NeighborPlan:
    """What a node needs about one neighbour: its rank, the node's sign A_ij and phase on that edge, and the
    mixing weight it gives the neighbour's value."""

    rank: int
    sign: int
    phase: int
    weight: float
    peer_phase: int  # the neighbour's own phase on the edge


def _weights_of(topology: Topology, rank: int, kind: str) -> tuple[dict[int, float], float]:
    """One row of the mixing matrix: neighbour -> weight, and the self weight. Computed per row so that a
    node's plan does not cost an n x n matrix."""
    peers = topology.neighbors(rank)
    if kind == "uniform":
        share = 1.0 / (len(peers) + 1)
        return {peer: share for peer in peers}, share
    if kind == "metropolis-hastings":
        own = len(peers)
        row = {peer: 1.0 / (1 + max(own, topology.degree(peer))) for peer in peers}
        return row, 1.0 - sum(row.values())
    raise ValueError(f"unknown mixing weights {shown(kind)}; known: {', '.join(WEIGHT_KINDS)}")


def node_plan(
    topology: Topology, rank: int, interval: int, seed: int, weights: WeightKind = "uniform"
) -> tuple[list[NeighborPlan], float]:
    """The neighbours of `rank` (sorted by rank) with sign, phase and weight, and the node's self weight: the phases
    of `edge_phases`, read from the topology's draws for the edges of `rank` only."""
    row, self_weight = _weights_of(topology, rank, weights)
    peers = list(row)
    draws = topology.phase_draws(interval, seed)[topology.edge_indices(rank, peers)].tolist()
    plan = []
    for peer, (lower, higher) in zip(peers, draws, strict=True):  # the phases of the edge's lower and higher rank
        phase, peer_phase = (lower, higher) if rank < peer else (higher, lower)
        plan.append(NeighborPlan(peer, edge_sign(rank, peer), phase, row[peer], peer_phase))
    return plan, self_weight


def mixing_matrix(topology: Topology, kind: WeightKind) -> np.ndarray:
    """The n x n weight matrix. uniform: 1/(E_i+1) on self and neighbours; row-stochastic, doubly stochastic
    only on regular graphs. metropolis-hastings: w_ij = 1/(1+max(d_i, d_j)), self = 1 - sum; symmetric and
    doubly stochastic on any graph."""
    matrix = np.zeros((topology.nodes, topology.nodes))
    for rank in range(topology.nodes):
        row, self_weight = _weights_of(topology, rank, kind)
        matrix[rank, rank] = self_weight
        for peer, weight in row.items():
            matrix[rank, peer] = weight
    return matrix


def _is_square_nonnegative(m: np.ndarray, tol: float) -> bool:
    return m.ndim == 2 and m.shape[0] == m.shape[1] and bool(np.all(m >= -tol))


def is_row_stochastic(m: np.ndarray, tol: float = 1e-9) -> bool:
    return _is_square_nonnegative(m, tol) and bool(np.allclose(m.sum(axis=1), 1.0, rtol=0.0, atol=tol))


def is_column_stochastic(m: np.ndarray, tol: float = 1e-9) -> bool:
    return _is_square_nonnegative(m, tol) and bool(np.allclose(m.sum(axis=0), 1.0, rtol=0.0, atol=tol))


def is_doubly_stochastic(m: np.ndarray, tol: float = 1e-9) -> bool:
    return is_row_stochastic(m, tol) and is_column_stochastic(m, tol)


# ----------------------------------------------------------------------------------------------------
# Time-varying directed graphs (SGP, AD-PSGD)


def _dedupe_offsets(nodes: int, raw: Iterable[int]) -> list[int]:
    """Offsets reduced modulo nodes, first occurrence kept, offset 0 (the node itself) dropped."""
    seen: dict[int, None] = {}  # keeps the order of first occurrences; a list's `in` made this quadratic
    for offset in raw:
        reduced = offset % nodes
        if reduced:
            seen.setdefault(reduced)
    return list(seen)


def _check_dynamic(kind: str, nodes: int, peers_per_iteration: int) -> None:
    if kind not in DYNAMIC_KINDS:
        raise ValueError(f"unknown dynamic topology kind {kind!r}; known kinds: {', '.join(DYNAMIC_KINDS)}")
    if nodes < 1:
        raise ValueError(f"a topology needs at least one node, got {nodes}")
    if peers_per_iteration < 1:
        raise ValueError(f"peers_per_iteration must be >= 1, got {peers_per_iteration}")
    # An odd cycle is not bipartite: with odd nodes the odd offsets wrap onto the same parity.
    if kind.startswith("bipartite-") and nodes % 2:
        raise ValueError(f"topology {kind!r} needs an even number of nodes, got {nodes}")


def offsets(kind: str, nodes: int, peers_per_iteration: int = 1) -> list[int]:
    """The rotation sequence of a dynamic kind: offsets in 1..nodes-1 (taken modulo nodes, deduplicated, first
    occurrence kept). At iteration t rank r sends to r + offset for the k offsets at positions
    t*k .. t*k+k-1 of the sequence, cyclically (k = peers_per_iteration); see `out_peers`.

    - dynamic-exponential: +2^0, -2^0, +2^1, -2^1, ... for 2^i < nodes (SGP's directed exponential graph).
      8 nodes: 1, 7, 2, 6, 4.
    - npeer-exponential: SGP's "n-peer forward exponential" graph: for i = 0, 1, ... while (k+1)^i < nodes,
      and for j = 1..k, the forward offset j*(k+1)^i. Only this kind's offsets depend on k; taken k at a
      time, each iteration covers one scale i. 8 nodes, k = 1: 1, 2, 4; k = 2: 1, 2, 3, 6.
    - bipartite-exponential: SGP's bipartite exponential graph: +1, -1, then +(2^i + 1), -(2^i + 1) for
      i >= 1 while 2^i < nodes, i.e. odd distances 1, 3, 5, 9, 17, ...; every offset is odd, so with an even
      number of nodes it always joins an even (passive) rank and an odd (active) one. 8 nodes: 1, 7, 3, 5.
    - bipartite-linear: every odd distance, +1, -1, +3, -3, ...; 8 nodes: 1, 7, 3, 5.
    Bipartite kinds need an even number of nodes. A single node has no offsets.
    """
    _check_dynamic(kind, nodes, peers_per_iteration)
    if kind == "dynamic-exponential":
        raw = [sign * power for power in _powers_of_two_below(nodes) for sign in (1, -1)]
    elif kind == "npeer-exponential":
        base = peers_per_iteration + 1
        raw = []
        scale = 1
        while scale < nodes:
            raw.extend(j * scale for j in range(1, base))
            scale *= base
    elif kind == "bipartite-exponential":
        distances = [1] + [power + 1 for power in _powers_of_two_below(nodes)[1:]]
        raw = [sign * distance for distance in distances for sign in (1, -1)]
    else:  # bipartite-linear
        raw = [sign * distance for distance in range(1, nodes, 2) for sign in (1, -1)]
    return _dedupe_offsets(nodes, raw)


def _offsets_at(kind: str, nodes: int, iteration: int, peers_per_iteration: int) -> list[int]:
    return _chosen(offsets(kind, nodes, peers_per_iteration), kind, nodes, iteration, peers_per_iteration)


def _chosen(sequence: list[int], kind: str, nodes: int, iteration: int, peers_per_iteration: int) -> list[int]:
    """The offsets of `iteration`: the next peers_per_iteration of the rotation `sequence`, cyclically."""
    if iteration < 0:
        raise ValueError(f"iteration must be >= 0, got {iteration}")
    if not sequence:  # a single node: nobody to talk to
        return []
    if peers_per_iteration > len(sequence):
        # More peers than distinct offsets would send two shares to one peer in an iteration.
        raise ValueError(
            f"topology {kind!r} on {nodes} nodes has {len(sequence)} distinct offsets; "
            f"peers_per_iteration {peers_per_iteration} is too many"
        )
    start = iteration * peers_per_iteration
    return [sequence[(start + m) % len(sequence)] for m in range(peers_per_iteration)]


def is_passive(kind: str, rank: int) -> bool:
    """Bipartite kinds: even ranks are passive (they only answer), odd ranks active (they initiate), so a
    bilateral exchange never deadlocks. Other kinds have no passive ranks."""
    if kind not in DYNAMIC_KINDS:
        raise ValueError(f"unknown dynamic topology kind {kind!r}; known kinds: {', '.join(DYNAMIC_KINDS)}")
    return kind.startswith("bipartite-") and rank % 2 == 0


def out_peers(kind: str, nodes: int, rank: int, iteration: int, peers_per_iteration: int = 1) -> list[int]:
    """The ranks `rank` sends to (SGP) or initiates an exchange with (AD-PSGD) at `iteration`: (rank + offset)
    mod nodes for this iteration's offsets (see `offsets`). Passive ranks of bipartite kinds return []."""
    _check_rank(rank, nodes)
    chosen = _offsets_at(kind, nodes, iteration, peers_per_iteration)
    if is_passive(kind, rank):
        return []
    return [(rank + offset) % nodes for offset in chosen]


def in_peers(kind: str, nodes: int, rank: int, iteration: int, peers_per_iteration: int = 1) -> list[int]:
    """The ranks whose `out_peers` at `iteration` include `rank`: what a node receives from (or answers)."""
    _check_rank(rank, nodes)
    chosen = _offsets_at(kind, nodes, iteration, peers_per_iteration)
    senders = [(rank - offset) % nodes for offset in chosen]
    return [sender for sender in senders if not is_passive(kind, sender)]


def directed_mixing_matrix(nodes: int, out_peers_per_node: Sequence[Sequence[int]]) -> np.ndarray:
    """Push-sum weights: sender j keeps 1/(k_j+1) and gives 1/(k_j+1) to each of its k_j out-peers, so
    W[i, j] is what i receives from j and every column sums to 1 (column-stochastic)."""
    if len(out_peers_per_node) != nodes:
        raise ValueError(f"expected out-peers for {nodes} nodes, got {len(out_peers_per_node)}")
    matrix = np.zeros((nodes, nodes))
    for sender, peers in enumerate(out_peers_per_node):
        if len(set(peers)) != len(peers) or sender in peers:
            raise ValueError(f"out-peers of rank {sender} must be distinct and not itself, got {list(peers)}")
        share = 1.0 / (len(peers) + 1)
        matrix[sender, sender] = share
        for peer in peers:
            _check_rank(peer, nodes)
            matrix[peer, sender] = share
    return matrix


def _peers_per_iteration(spec: TopologySpec) -> int:
    _check_option_names(spec)
    return _int_option(spec, "peers_per_iteration") if "peers_per_iteration" in spec.options else 1


def schedule_period(kind: str, nodes: int, peers_per_iteration: int = 1) -> int:
    """Iterations after which the rotation of a dynamic kind repeats."""
    return _period(len(offsets(kind, nodes, peers_per_iteration)), peers_per_iteration)


def _period(count: int, peers_per_iteration: int) -> int:
    return count // math.gcd(count, peers_per_iteration) if count else 1


def peer_schedule(spec: TopologySpec, nodes: int, rank: int) -> tuple[tuple[int, ...], ...]:
    """A dynamic kind's out-peers of `rank` at each iteration of one period (`out_peers`); () for static kinds,
    whose nodes talk to all their neighbours."""
    if spec.kind not in DYNAMIC_KINDS:
        return ()
    _check_rank(rank, nodes)
    k = _peers_per_iteration(spec)
    sequence = offsets(spec.kind, nodes, k)  # once, not once per iteration
    passive = is_passive(spec.kind, rank)
    schedule = []
    for t in range(_period(len(sequence), k)):
        chosen = _chosen(sequence, spec.kind, nodes, t, k)
        schedule.append(() if passive else tuple((rank + offset) % nodes for offset in chosen))
    return tuple(schedule)


def _union_of_period(spec: TopologySpec, nodes: int) -> Topology:
    """The undirected graph of every pair that talks during one period of a dynamic kind: the neighbours a
    node must accept messages from, whichever direction they flow. A period ends where the rotation comes back
    to its start, so it uses every offset: each active rank is joined to rank + offset for every offset."""
    k = _peers_per_iteration(spec)
    weights = spec.options.get("weights", "uniform")
    if weights not in WEIGHT_KINDS:  # checked here, with the job, rather than when the coordinator plans a node
        raise ValueError(f"topology {spec.kind!r}: option 'weights' must be one of {', '.join(WEIGHT_KINDS)}, got "
                         f"{shown(weights)}")
    sequence = offsets(spec.kind, nodes, k)
    _chosen(sequence, spec.kind, nodes, 0, k)  # refuses more peers per iteration than there are offsets
    # Offsets d and nodes - d join the same pairs.
    _check_edge_count(spec, nodes * len({min(offset, nodes - offset) for offset in sequence}))
    period = _period(len(sequence), k)
    if nodes * period * k > MAX_PERIOD_SENDS:  # what every node's plan (peer_schedule) holds
        raise ValueError(
            f"topology {spec.kind!r}: one period of its schedule has {nodes * period * k} sends ({nodes} nodes x "
            f"{period} iterations x {k} peers per iteration); at most {MAX_PERIOD_SENDS} are allowed"
        )
    edges = [
        (rank, (rank + offset) % nodes)
        for rank in range(nodes)
        if not is_passive(spec.kind, rank)
        for offset in sequence
    ]
    passive = frozenset(rank for rank in range(nodes) if is_passive(spec.kind, rank))
    return Topology(nodes, _normalise(edges), passive, period)
