"""Job validation and node planning, shared by the coordinator's service, the simulator, the CLI and the demo.

Validation goes through the algorithm registry: the algorithm named by the job checks the whole job itself
(its mode, momentum, options and what it needs of the graph), so nothing here knows an algorithm by name.
No gRPC here: the CLI and the simulator validate and plan jobs without a coordinator.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from pydantic import ValidationError

from coordinator.topology import Topology, build_topology, node_plan, peer_schedule
from nodeagent.algorithms import Family, Neighbor, lookup
from nodeagent.defaults import MAX_MODEL_MEMORY_MIB
from nodeagent.jobspec import JobSpec, JobSpecError, TopologySpec, format_validation_error
from nodeagent.training.data import FIXED_SHAPES
from nodeagent.training.model_memory import MIB, bound_model_memory
from nodeagent.training.models import MODELS, check_model, is_import_path
from nodeagent.training.splits import SPLIT_OPTIONS, SPLITS
from nodeagent.training.tasks import check_task, task_of


def validate_job(spec: JobSpec, max_model_bytes: int = MAX_MODEL_MEMORY_MIB * MIB) -> Topology:
    """Checks that need more than the schema; returns the job's topology (an elastic job's at its largest size,
    after checking it at its smallest too). Raises JobSpecError naming the field. A model whose parameters and
    optimizer state exceed `max_model_bytes` is refused, with both figures, where the dataset fixes its shape."""
    if spec.elastic:
        check_elastic(spec)
        validate_job(spec.sized(spec.min_nodes), max_model_bytes)
        return validate_job(spec.sized(), max_model_bytes)
    algorithm = lookup(spec.algorithm.name)
    if spec.data.split not in SPLITS:
        raise JobSpecError(f"data.split: unknown split {spec.data.split!r}; known: {sorted(SPLITS)}")
    try:  # here, not first at the agents that split the data
        SPLIT_OPTIONS[spec.data.split].model_validate(spec.data.split_options)
    except ValidationError as error:
        unknown = f"unknown option of the {spec.data.split} split"
        raise JobSpecError(format_validation_error(error, "data.split_options", unknown)) from None
    check_task(spec)
    try:
        model = check_model(spec.model, *task_of(spec).nominal_input(spec))
    except ValueError as error:
        field = "model.options" if spec.model.name in MODELS else "model.name"
        raise JobSpecError(f"{field}: {error}") from None
    if model is not None and spec.data.dataset in FIXED_SHAPES:  # the nominal data is the job's: its real size
        bound_model_memory(model, spec, max_model_bytes, "the coordinator")
    if algorithm.family is Family.SERVER and is_import_path(spec.model.name):
        raise JobSpecError(
            f"model.name: {spec.algorithm.name} keeps the model at the coordinator, which imports no user code: "
            f"name a registered model ({', '.join(MODELS)})"
        )
    topology = _checked_topology(spec)
    for index, change in enumerate(spec.simulation.topology_changes):
        try:
            validate_topology_change(spec, change.topology())
        except JobSpecError as error:
            raise JobSpecError(f"simulation.topology_changes[{index}]: {error}") from None
    return topology


def _checked_topology(spec: JobSpec) -> Topology:
    """The job's graph, built, connected and accepted by its algorithm; JobSpecError naming the field otherwise."""
    if spec.topology.kind == "edge-list" and "path" in spec.topology.options:
        # The command line that loads a job file reads the edge file it names and sends its text (load_job_file).
        raise JobSpecError("topology.options.path: topology edge-list: give the edges inline (option edges); the "
                           "coordinator reads no files")
    try:
        topology = build_topology(spec.topology, spec.nodes)
    except ValueError as error:
        raise JobSpecError(f"topology: {error}") from None
    if spec.nodes > 1 and not topology.is_connected():
        raise JobSpecError(f"topology: {spec.topology.kind} on {spec.nodes} nodes is not connected")
    try:
        lookup(spec.algorithm.name).check(spec, topology)
    except JobSpecError:
        raise
    except ValueError as error:  # a check that names its field in a plain ValueError
        raise JobSpecError(str(error)) from None
    return topology


def with_topology(spec: JobSpec, topology: TopologySpec) -> JobSpec:
    """The job as it runs after a change to `topology` (what its nodes are planned from)."""
    return spec.model_copy(update={"topology": topology})


def validate_topology_change(spec: JobSpec, topology: TopologySpec) -> Topology:
    """Whether a running job of `spec` may switch to `topology`: its algorithm talks to neighbours and can change
    them between two steps, and the new graph fits the job (its nodes, the algorithm's `check`). Returns the new
    graph; JobSpecError naming the field otherwise (`topology...` for the new graph)."""
    check_topology_changes(spec)
    return _checked_topology(with_topology(spec, topology))


def check_topology_changes(spec: JobSpec) -> None:
    """Whether a job of `spec` can change its topology at all (JobSpecError on algorithm.name if not)."""
    algorithm = lookup(spec.algorithm.name)
    if algorithm.family is not Family.PEER:
        raise JobSpecError(f"algorithm.name: {spec.algorithm.name} has no topology to change (its nodes talk "
                           f"{'to the parameter server' if algorithm.family is Family.SERVER else 'all at once'})")
    if not algorithm.changes_topology:
        raise JobSpecError(f"algorithm.name: {spec.algorithm.name} cannot change its topology while it runs")


def check_elastic(spec: JobSpec) -> None:
    """Whether agents may join and leave a job of `spec` while it runs: its graph is planned again for each new
    membership and delivered as a topology change, so its algorithm must be able to change its topology
    (JobSpecError on nodes if not)."""
    try:
        check_topology_changes(spec)
    except JobSpecError as error:
        reason = str(error).removeprefix("algorithm.name: ")
        raise JobSpecError(f"nodes: an elastic job ({{min, max}}) is planned again as agents join and leave, which "
                           f"needs an algorithm that changes its topology while it runs: {reason}") from None


def validate_membership(spec: JobSpec, count: int) -> Topology:
    """The graph of a running elastic job (`spec` as it runs now, its topology changes included) planned again for
    `count` members: built, connected and accepted by its algorithm; JobSpecError naming the field otherwise."""
    if not spec.min_nodes <= count <= spec.max_nodes:
        raise JobSpecError(f"nodes: {count} members are not in {spec.min_nodes}..{spec.max_nodes}")
    return _checked_topology(spec.sized(count))


@dataclass(frozen=True)
class NodePlan:
    """Everything of a node's place in a job's topology, as the coordinator assigns it."""

    neighbors: tuple[Neighbor, ...]
    self_weight: float
    peer_schedule: tuple[tuple[int, ...], ...]


def plan_node(spec: JobSpec, topology: Topology, rank: int) -> NodePlan:
    """A parameter-server algorithm's workers talk only to the server: no neighbours."""
    if lookup(spec.algorithm.name).family is Family.SERVER:
        return NodePlan((), 1.0, ())
    plans, self_weight = node_plan(
        topology, rank, spec.algorithm.interval, spec.topology.seed,
        weights=spec.topology.options.get("weights", "uniform"),
    )
    neighbors = tuple(Neighbor(p.rank, p.sign, p.phase, p.weight, p.peer_phase) for p in plans)
    return NodePlan(neighbors, self_weight, peer_schedule(spec.topology, spec.nodes, rank))


def plan_member(spec: JobSpec, topology: Topology, ranks: Sequence[int], rank: int) -> NodePlan:
    """The plan of `rank` in a job whose members hold `ranks` (ascending; `topology` built for len(ranks) nodes).
    The graph is planned on positions 0..len(ranks)-1, the i-th member at position i, and its ranks put back: an
    elastic job's ranks stay with their members (and their data shards) and may have gaps where a member left. The
    mapping keeps the order of ranks, so an edge's sign (+1 at the lower rank) is the same in either numbering."""
    count = len(ranks)
    if count == ranks[-1] + 1:  # ranks 0..count-1: positions are ranks
        return plan_node(spec.sized(count), topology, rank)
    position = bisect.bisect_left(ranks, rank)
    if position == count or ranks[position] != rank:
        raise ValueError(f"rank {rank} is not a member")
    plan = plan_node(spec.sized(count), topology, position)
    return NodePlan(tuple(dataclasses.replace(n, rank=ranks[n.rank]) for n in plan.neighbors), plan.self_weight,
                    tuple(tuple(ranks[peer] for peer in peers) for peers in plan.peer_schedule))
