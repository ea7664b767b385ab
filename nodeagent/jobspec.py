"""The job specification: one pydantic schema shared by the CLI, the coordinator, the agent and the simulator.

A job is written as YAML by a person (`coordinator submit job.yaml`), validated here, stored by the coordinator
and sent to every agent inside its assignment as JSON. Errors name the field that is wrong and never repeat more
than MAX_SHOWN_CHARS characters of what they were given.

Anyone who may submit a job is not trusted with the machines, so what a job costs is bounded before it is paid:
the YAML text (MAX_JOB_BYTES, checked before parsing), its values and nesting (MAX_YAML_VALUES, MAX_YAML_DEPTH, no
anchors or aliases, so that no value is ever expanded), the nodes (MAX_NODES) and the edges of the topology
(coordinator.topology.MAX_EDGES). A job names no file the coordinator reads: an edge-list file is read by the
command line that loads the job file (load_job_file) and sent inline.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError, model_validator

from nodeagent.text import clip

DEFAULT_DATA_DIR = "/usr/share/datasets/fashion-mnist"
Mode = Literal["async", "sync"]
# The formats of data a job can name (nodeagent.training.data reads them).
DatasetKind = Literal["fashion-mnist", "mnist", "cifar10", "cifar100", "npy", "image-folder", "text", "tokens"]
# What a job trains its model for (nodeagent.training.tasks): the loss, the evaluation metric and what a batch is.
TaskName = Literal["classification", "language-model"]

MAX_JOB_BYTES = 1 << 20  # of the YAML text; an inlined edge list counts
MAX_YAML_VALUES = 65_536  # scalars, lists and mappings: a 10,000-node job with per-rank speeds and slow-downs fits
MAX_YAML_DEPTH = 32  # nested lists and mappings; a job needs 6 (simulation.partitions[].groups[])
MAX_NODES = 10_000  # the simulator's scale (benchmarks/simulator.py); planning stays linear in nodes
MAX_LIAR_PUSHES = 1_000  # a simulated liar's pushes per step (simulation.byzantine[].pushes)
MAX_SHOWN_CHARS = 100  # of what a job wrote, repeated in an error
MAX_ERRORS_SHOWN = 10  # wrong fields named in one error


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


RobustRule = Literal["self-centered-clip", "centered-clip", "trimmed-mean", "median", "krum"]


class QuarantineSpec(_Strict):
    """When the coordinator quarantines a member on its own (coordinator.control.suspicion): a peer-to-peer job drops
    its edges (a live topology change), a parameter server ignores its pushes; the operator is told."""

    fraction: float = Field(
        0.8, gt=0, le=1, description="the suspicion (share of a member's recent contributions found outlying) at or "
        "above which it is quarantined")
    after_s: float = Field(
        10.0, ge=0, le=3600, description="how long its suspicion must stay at or above `fraction` first")


class RobustSpec(_Strict):
    """How a node or the parameter server takes contributions it cannot trust (nodeagent.robust): each algorithm
    accepts the rules its mathematics allows and refuses the others at validation, saying why."""

    rule: RobustRule = Field(
        description="self-centered-clip (peer-to-peer: each neighbour's contribution clipped around the node's own "
        "state before it is mixed); centered-clip, trimmed-mean, median or krum (the parameter server's aggregation "
        "of the workers' updates, the asynchronous servers taking centered-clip alone: each update's norm clipped, "
        "and the pushes of a worker more frequent than the median worker's scaled down to its rate; allreduce's of "
        "every member's gradient and diloco's of every pseudo-gradient but centered-clip, all-gathered instead of "
        "summed: n / 2 times the bytes)")
    radius: float | Literal["auto"] = Field(
        "auto", description="the clipping radius (L2) of the clip rules; auto: adapted from the recent "
        "distances the node (their lower quartile, over a neighbour's weight in the mix) or server (their median) has "
        "seen; a contribution beyond twice the lower quartile (DiLoCo over gossip: its push-sum round's, at most 4 "
        "times the whole window's) counts as outlying, and is reported as such where it is also beyond 3 of the node's "
        "own average local steps")
    byzantine: int | None = Field(
        None, ge=0, description="f, the members assumed Byzantine: trimmed-mean drops f values at each end of every "
        "coordinate, krum scores against n - f - 2 neighbours; unset: floor((n - 1) / 4)")
    suspect_fraction: float = Field(
        0.5, gt=0, le=1, description="a member whose suspicion (the share of its contributions in the last `window_s` "
        "that its neighbours, the parameter server or, in an all-reduce job, the other members found outlying) reaches "
        "this is flagged: an event, `status`, "
        "`edges`, the PeertrainMemberSuspected alert")
    window_s: float = Field(30.0, gt=0, le=3600, description="the window of recent contributions the suspicion counts")
    quarantine: QuarantineSpec | None = Field(
        None, description="quarantine a persistently suspected member on the coordinator's own decision ({}: the "
        "defaults; unset: only by hand, `coordinator quarantine`; refused by allreduce and diloco, whose members "
        "would all have to drop a member's rows from the same round)")

    @model_validator(mode="after")
    def _radius_positive(self) -> RobustSpec:
        if isinstance(self.radius, float) and not 0 < self.radius < float("inf"):
            raise ValueError(f"radius: {self.radius} must be a finite number > 0 (or auto)")
        return self


class AlgorithmSpec(_Strict):
    """Which algorithm every node runs, and its hyper-parameters."""

    name: str = Field("dsgd", max_length=64, description="the algorithm every node runs (see nodeagent.algorithms)")
    mode: Mode | None = Field(
        None, description="async (exchanges on the edge-phase schedule) or sync (every step); unset: the algorithm's "
        "own (dsgd: async)")
    lr: float = Field(0.02, gt=0, description="step size mu of the local SGD step")
    momentum: float = Field(0.0, ge=0, lt=1, description="heavy-ball momentum of the local SGD step; 0: plain SGD")
    nesterov: bool = Field(False, description="Nesterov's form of the momentum (needs momentum > 0 to matter)")
    l2: float = Field(0.0, ge=0, description="L2 term added to the gradient: l2 * w")
    interval: int = Field(8, ge=1, description="K: local steps between two exchanges on an edge")
    options: dict[str, Any] = Field(
        default_factory=dict, description="the algorithm's own options, checked by its Options model")
    robust: RobustSpec | None = Field(
        None, description="robust mixing or aggregation against members that send wrong numbers (unset: the plain "
        "rule)")


class ModelSpec(_Strict):
    """The model every node trains, built from the same seed on every node."""

    name: str = Field(
        "logistic", max_length=200, description="logistic, mlp, cnn, resnet-gn, resnet-cifar (classification), gpt "
        "(language models), or "
        "'package.module:factory' (agents import only modules their operator allowed: nodeagent serve --allow-import "
        "package.module)")
    options: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of the model factory")
    init: str | None = Field(
        None, min_length=1, max_length=4096, description="start from the parameters of this model file (what "
        "`coordinator export` or `coordinator simulate --export` writes) instead of the seeded initial ones: a path "
        "on every agent, and on the coordinator for the parameter-server family (as data.data_dir is); its model "
        "must be this job's, name for name and shape for shape")


class DataSpec(_Strict):
    """The training and test data, and how the training set is divided among the nodes."""

    dataset: DatasetKind = Field(
        "fashion-mnist", description="the data's kind: images and labels for "
        "classification (fashion-mnist, mnist, cifar10, cifar100, npy, image-folder), token sequences for a "
        "language model (text, tokens); the input shape and class count (or vocabulary) come from the files")
    data_dir: str = Field(
        DEFAULT_DATA_DIR, description="directory holding the data on every node (for cifar10 and cifar100 also its "
        "parent; for text also one file); an agent's --data-dir or --data-root may place it "
        "elsewhere on its machine (docs/operations.md, Data on the agents)")
    options: dict[str, Any] = Field(default_factory=dict, description="the dataset's own options")
    split: str = Field("iid", max_length=64, description="how the training set is divided among the nodes: iid, "
                       "class-window, by-class or dirichlet (classification), iid or by-file (language models)")
    split_options: dict[str, Any] = Field(default_factory=dict, description="the split's own options")
    batch_size: int = Field(100, ge=1, description="samples in one local step's minibatch (for a language "
                            "model: sequences)")
    train_limit: int | None = Field(None, ge=1, description="use only the first N training samples (a language "
                                    "model's: N sequences spread evenly over the files)")
    test_limit: int | None = Field(None, ge=1, description="evaluate on the first N test samples (a language "
                                   "model's: N validation sequences spread evenly over the files)")


Precision = Literal["fp32", "bf16", "fp16"]


class TrainingSpec(_Strict):
    """How each node computes its local steps."""

    precision: Precision = Field(
        "fp32", description="arithmetic of the forward and backward passes: fp32, or bf16/fp16 under autocast with "
        "fp32 master weights (fp16 with a dynamic loss scale; it needs a CUDA device: the coordinator places it "
        "only on agents on one). Exchanges and updates stay in fp32")


class TopologySpec(_Strict):
    """The communication graph: which nodes exchange with which."""

    kind: str = Field("ring", max_length=64, description="the graph: ring, multiplex-ring, ecl-random8, complete, "
                      "...")
    seed: int = Field(0, description="seed of the edge phases (and of random graphs)")
    options: dict[str, Any] = Field(
        default_factory=dict, description="the kind's own options; edge-list: edges, the text of an edge file (a "
        "job file may name the file instead, as path, which the command line reads and inlines)")


class WireSpec(_Strict):
    """How tensors travel between nodes."""

    encoding: Literal["raw", "fp16", "bf16"] = Field(
        "raw", description="the values on the wire: raw (the model's own dtype) or halved to fp16 or bf16")
    chunk_bytes: int = Field(1 << 20, ge=1024, le=64 << 20, description="bytes of one chunk of a tensor stream")
    max_message_bytes: int = Field(1 << 30, ge=1 << 20, description="largest stream a node accepts")
    exchange_timeout_s: float = Field(30.0, gt=0, description="seconds a node waits for one exchange with a peer "
                                      "(or one call to the parameter server) before it gives it up")


# The fixed cost of one message between agents (a direct-lane exchange of one element on loopback, insecure,
# benchmarks/rounds.py "exchange" on a 2-core machine; docs/results.md, "Rounds"). What a round of agents pays for a
# message, the hand-offs between an agent's threads included, is more (1.26 to 1.59 ms there): the benchmark prints
# it for the machine it runs on. The default stays, so that the simulated tables of docs/results.md, measured under
# it, can be run again as they were.
MESSAGE_COST_S = 0.0003


class NetworkSpec(_Strict):
    """The simulator's network model: every directed link has this latency and bandwidth."""

    latency_s: float = Field(0.0005, ge=0, description="one-way latency of a message")
    message_cost_s: float = Field(
        MESSAGE_COST_S, ge=0, le=1, description="the fixed cost of a message beside its bytes and latency (the "
        "call, the wake-ups and the checks at both ends), for which its link is busy; an all-reduce or all-gather "
        "pays it once a round, and the latency at each step of its ring. The default is what benchmarks/rounds.py "
        "measured for an exchange of one element between two agents on loopback; the benchmark also prints what a "
        "round of agents pays for a message on the machine it runs on, the value to simulate that machine with")
    bandwidth_bytes_per_s: float = Field(125e6, gt=0, description="per-link bandwidth (default 1 Gbit/s)")
    loss: float = Field(0.0, ge=0, lt=1, description="probability that a message is lost (the sender times out)")
    timeout_s: float = Field(1.0, gt=0, description="how long a sender waits for a lost message")


class FaultSpec(_Strict):
    """A node that is down (neither steps nor answers nor beats) between two virtual times. The coordinator's failure
    policy applies as on agents: down for longer than the heartbeat timeout (15 s) and `failure.lost_grace_s`, it
    fails a synchronous job, and an asynchronous one finishes without it once the others have."""

    node: int = Field(ge=0, description="rank of the node")
    down_from: float = Field(ge=0, description="virtual time (s) at which it goes down")
    down_until: float = Field(gt=0, description="virtual time (s) at which it comes back")


class PartitionSpec(_Strict):
    """Groups of nodes that cannot reach each other between two virtual times."""

    groups: list[list[int]] = Field(min_length=2, description="lists of ranks; nodes of different groups cannot "
                                    "reach each other")
    start: float = Field(ge=0, description="virtual time (s) at which the partition begins")
    end: float = Field(gt=0, description="virtual time (s) at which it heals")


class TopologyChangeSpec(_Strict):
    """A topology change the simulator applies while the job runs, as `coordinator topology` does on a cluster:
    every node switches just before step `at_step`."""

    at_step: int = Field(ge=1, description="the step before which every node switches (1..steps-1)")
    kind: str = Field(max_length=64, description="the new topology's kind (as topology.kind)")
    options: dict[str, Any] = Field(default_factory=dict, description="the new kind's own options")
    seed: int = Field(0, description="seed of the new edge phases (and of a random graph)")

    def topology(self) -> TopologySpec:
        return TopologySpec(kind=self.kind, seed=self.seed, options=self.options)


Attack = Literal["sign-flip", "scale", "constant", "zeros", "random", "alie", "ipm", "dissensus"]


class ByzantineSpec(_Strict):
    """Members that send wrong numbers (nodeagent.byzantine): they train as the others do, and every tensor message
    they send (to a neighbour, in answer to one, or to the parameter server) is replaced by the attack's."""

    ranks: list[int] = Field(min_length=1, max_length=MAX_NODES, description="the lying ranks")
    attack: Attack = Field(
        description="sign-flip (-v), scale (v * strength), constant (every entry = strength), zeros, random "
        "(Gaussian noise of standard deviation strength), alie (mean - z std of the honest messages, 'a little is "
        "enough'), ipm (-strength * their mean, inner-product manipulation), dissensus (the receiver's own value "
        "pushed away from the honest mean by strength times their difference)")
    strength: float | None = Field(
        None, description="the attack's parameter; unset: scale 1e6, constant 1000, random 1.0, alie z = 1.0, "
        "ipm 0.1, dissensus 1.0")
    pushes: int = Field(
        1, ge=1, le=MAX_LIAR_PUSHES, description="an asynchronous parameter server's liar (asgd, dc-asgd, adacomp): "
        "each of its steps pushes its forged update this many times (a worker that pushes as often as the server "
        "answers it), each copy claiming a step of its own, as the server applies one push per step")


class SimulationSpec(_Strict):
    """How `coordinator simulate` charges virtual time; the rest of the job is the same as a real run's."""

    step_time_s: float = Field(0.01, gt=0, description="virtual compute time of one local step at speed 1")
    speeds: list[float] = Field(default_factory=list, description="relative speed per rank (default 1 for all)")
    jitter: float = Field(0.0, ge=0, le=1, description="relative standard deviation of each step's time")
    network: NetworkSpec = Field(default_factory=NetworkSpec, description="the simulated network")
    faults: list[FaultSpec] = Field(default_factory=list, description="nodes that are down for a while")
    partitions: list[PartitionSpec] = Field(default_factory=list, description="network partitions")
    seed: int = Field(0, ge=0, description="seeds jitter and message loss")
    topology_changes: list[TopologyChangeSpec] = Field(
        default_factory=list, max_length=100,
        description="topology changes while the job runs, in ascending at_step order")
    byzantine: list[ByzantineSpec] = Field(
        default_factory=list, max_length=100, description="members that lie: their messages are replaced by an "
        "attack's (for research on robust rules, and for tests)")


class FailureSpec(_Strict):
    """What the coordinator does when a node of the job fails or is lost. A node that cannot build or continue its
    job fails the job at once."""

    lost_grace_s: float = Field(
        60.0, gt=0, description="a node without heartbeat for this long fails a synchronous job (an asynchronous "
        "job goes on without it; an all-reduce job goes on while at least `min_members` remain); a node restarted "
        "within it rejoins")
    step_timeout_s: float = Field(
        10.0, gt=0, le=3600, description="all-reduce jobs: the longest one step's collective may take; a member that "
        "does not take its part within it (killed, stopped, cut off) aborts the step on every member, and the others "
        "go on without it from the next step")
    join_s: float = Field(
        2.0, gt=0, le=600, description="all-reduce jobs: after a member is lost, how long the others wait for every "
        "rank that is alive to come to the next quorum before they go on with those present")
    min_members: int = Field(
        0, ge=0, le=MAX_NODES, description="all-reduce jobs: the fewest members a quorum may have to go on (0: a "
        "majority of the job's nodes, so that two halves cut apart never both train); fewer for longer than "
        "`lost_grace_s` fail the job")


class StartSpec(_Strict):
    """How the job starts on its nodes."""

    barrier: bool = Field(
        True, description="every node builds its part (data loaded, model built, serving its peers), reports ready to "
        "the coordinator and waits: the coordinator releases all together once every rank is ready, so that no node "
        "trains ahead of the others (a seeded synchronous job then runs alike each time); false: each node starts "
        "once built")
    timeout_s: float = Field(
        300.0, gt=0, le=86_400, description="with the barrier: the job fails when some rank is not ready this long "
        "after the job started (the reason names the ranks and their nodes)")


class CheckpointSpec(_Strict):
    """What the agents keep of the job's checkpoints once it ended."""

    keep: bool = Field(
        False, description="keep every rank's last checkpoint (a flat parameter vector and the algorithm's state) on "
        "its agent after the job ended, in STATE_DIR/checkpoints/kept, until an operator deletes it; false: the "
        "agent deletes it when the job ends (unless its --keep-checkpoints keeps the last jobs'). The trained "
        "model does not need it: each rank sends its final model to the coordinator (`coordinator export`)")


class NodeRange(_Strict):
    """An elastic job's size: it starts on `min` agents (or on as many as are free, up to `max`), agents that become
    free join it while it has fewer than `max`, and a lost member leaves it while at least `min` remain."""

    min: int = Field(ge=2, le=MAX_NODES, description="agents the job starts with at least, and keeps at least")
    max: int = Field(ge=2, le=MAX_NODES, description="agents the job may grow to; its data is split into max shards, "
                     "one per rank")

    @model_validator(mode="after")
    def _ordered(self) -> NodeRange:
        if self.min > self.max:
            raise ValueError(f"min {self.min} is larger than max {self.max}")
        return self


def _nodes_form(value: Any) -> str:
    return "elastic" if isinstance(value, dict | NodeRange) else "fixed"


# A fixed size, or an elastic job's range; an error names the form it was read as (nodes.fixed, nodes.elastic.min).
Nodes = Annotated[
    Annotated[int, Field(ge=1, le=MAX_NODES), Tag("fixed")] | Annotated[NodeRange, Tag("elastic")],
    Discriminator(_nodes_form),
]


class JobSpec(_Strict):
    """A training job: what every node trains, on which data, over which graph, with which algorithm."""

    name: str = Field("job", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$",
                      description="the job's name; commands take it wherever they take a job (the newest of that "
                      "name)")
    nodes: Nodes = Field(
        8, description="number of node agents in the job (1..10000), or {min, max} for an elastic job whose agents "
        "may join and leave while it runs (peer-to-peer algorithms that can change their topology)")
    task: TaskName = Field(
        "classification", description="what the model learns, which fixes its loss, its evaluation metric and what "
        "a batch is: classification (cross-entropy over class labels; test accuracy) or language-model (next-token "
        "cross-entropy over token sequences; validation loss and perplexity)")
    steps: int = Field(1000, ge=1, description="local steps per node")
    eval_every: int = Field(200, ge=1, description="evaluate on the test set every N steps (and at the end)")
    seed: int = Field(0, ge=0, description="seeds the initial model, the split and the batch orders")
    algorithm: AlgorithmSpec = Field(default_factory=AlgorithmSpec, description="the training algorithm")
    model: ModelSpec = Field(default_factory=ModelSpec, description="the model")
    data: DataSpec = Field(default_factory=DataSpec, description="the data and its split")
    training: TrainingSpec = Field(default_factory=TrainingSpec, description="how local steps are computed")
    topology: TopologySpec = Field(default_factory=TopologySpec, description="the communication graph")
    wire: WireSpec = Field(default_factory=WireSpec, description="the transport of tensors")
    slowdown: dict[int, float] = Field(
        default_factory=dict, description="rank -> factor >= 1 that stretches each local step (heterogeneity)"
    )
    min_step_s: float = Field(0.0, ge=0.0, le=60.0, description="every local step lasts at least this long, the rest "
                              "slept: a fixed pace whatever the host (the simulator: at least this much virtual time)")
    failure: FailureSpec = Field(default_factory=FailureSpec, description="what a failed or lost node does to the "
                                 "job")
    start: StartSpec = Field(default_factory=StartSpec, description="how the job starts on its nodes")
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec, description="what the agents keep of the "
                                       "job's checkpoints once it ended")

    simulation: SimulationSpec = Field(default_factory=SimulationSpec, description="used by the simulator only")

    @property
    def elastic(self) -> bool:
        """Whether agents may join and leave the job while it runs (`nodes: {min, max}`)."""
        return isinstance(self.nodes, NodeRange)

    @property
    def min_nodes(self) -> int:
        return self.nodes.min if isinstance(self.nodes, NodeRange) else self.nodes

    @property
    def max_nodes(self) -> int:
        """The most ranks the job has: its size, or an elastic job's max (its data is split into that many
        shards)."""
        return self.nodes.max if isinstance(self.nodes, NodeRange) else self.nodes

    @property
    def quorum_minimum(self) -> int:
        """The fewest members an all-reduce quorum of the job may have: `failure.min_members`, or a majority of its
        most ranks (an elastic job's max: its nodes are built for that many, as every agent's spec is sized)."""
        nodes = self.max_nodes
        return min(self.failure.min_members, nodes) if self.failure.min_members else nodes // 2 + 1

    def sized(self, count: int | None = None) -> JobSpec:
        """The job with a fixed number of nodes, `count` (default: its most, `max_nodes`): what its nodes are built
        from and its graph is planned for, elastic or not."""
        return self.model_copy(update={"nodes": self.max_nodes if count is None else count})

    @model_validator(mode="after")
    def _ranks_in_range(self) -> JobSpec:
        nodes = self.max_nodes

        def check(where: str, rank: int) -> None:
            if not 0 <= rank < nodes:
                raise ValueError(f"{where}: rank {rank} is not in 0..{nodes - 1}")

        for rank, factor in self.slowdown.items():
            check("slowdown", rank)
            if factor < 1:
                raise ValueError(f"slowdown: factor {factor} of rank {rank} must be >= 1")
        simulation = self.simulation
        if simulation.speeds and len(simulation.speeds) != nodes:
            raise ValueError(f"simulation.speeds: {len(simulation.speeds)} speeds for {nodes} nodes")
        if any(speed <= 0 for speed in simulation.speeds):
            raise ValueError("simulation.speeds: every speed must be positive")
        for fault in simulation.faults:
            check("simulation.faults", fault.node)
            if fault.down_until <= fault.down_from:
                raise ValueError("simulation.faults: down_until must come after down_from")
        for partition in simulation.partitions:
            for group in partition.groups:
                for rank in group:
                    check("simulation.partitions", rank)
            if partition.end <= partition.start:
                raise ValueError("simulation.partitions: end must come after start")
        liars: set[int] = set()
        for group in simulation.byzantine:
            for rank in group.ranks:
                check("simulation.byzantine", rank)
                if rank in liars:
                    raise ValueError(f"simulation.byzantine: rank {rank} is named twice")
                liars.add(rank)
        previous = 0
        for index, change in enumerate(simulation.topology_changes):
            where = f"simulation.topology_changes[{index}].at_step"
            if not 1 <= change.at_step < self.steps:
                raise ValueError(f"{where}: {change.at_step} is not in 1..{self.steps - 1} (the job's steps - 1)")
            if change.at_step <= previous:
                raise ValueError(f"{where}: changes must be in ascending order of at_step, {change.at_step} comes "
                                 f"after {previous}")
            previous = change.at_step
        return self

    def to_json(self) -> str:
        return self.model_dump_json()

    @classmethod
    def from_json(cls, text: str) -> JobSpec:
        return cls.model_validate_json(text)


class JobSpecError(ValueError):
    """A job specification that cannot be used; the message names the field."""


def shown(value: object) -> str:
    """`value` as an error repeats it: its repr, cut (a job may hold a megabyte in one string)."""
    return clip(repr(value), MAX_SHOWN_CHARS)


def format_validation_error(error: ValidationError, prefix: str = "", unknown: str = "") -> str:
    """One line naming each wrong field (`prefix.field: what is wrong`), the first MAX_ERRORS_SHOWN of them; `unknown`
    replaces pydantic's words for a key the model does not know. Keys the job wrote are cut (see `shown`)."""
    items = error.errors()
    lines = []
    for item in items[:MAX_ERRORS_SHOWN]:
        path = ([prefix] if prefix else []) + [
            shown(part) if isinstance(part, str) and len(part) > MAX_SHOWN_CHARS else str(part) for part in item["loc"]
        ]
        message = unknown if unknown and item["type"] == "extra_forbidden" else item["msg"]
        lines.append(f"{'.'.join(path) or '(top level)'}: {message}")
    if len(items) > MAX_ERRORS_SHOWN:
        lines.append(f"and {len(items) - MAX_ERRORS_SHOWN} more")
    return "; ".join(lines)


def parse_job_spec(data: dict[str, Any] | None) -> JobSpec:
    try:
        return JobSpec.model_validate(data or {})
    except ValidationError as error:
        raise JobSpecError(format_validation_error(error)) from None


def parse_job_yaml(text: str) -> JobSpec:
    return parse_job_spec(_job_mapping(text))


def _job_mapping(text: str) -> dict[str, Any]:
    """The mapping a job's YAML text holds, within the bounds of this module's docstring; JobSpecError otherwise.
    libyaml parses (PyYAML's own parser takes 10 s of CPU for a megabyte)."""
    _check_size(text, "the job")
    _check_yaml_shape(text)
    try:
        data = yaml.load(text, Loader=yaml.CSafeLoader)
    except yaml.YAMLError as error:
        raise JobSpecError(f"not valid YAML: {_yaml_problem(error)}") from None
    except ValueError as error:  # a value the safe constructor refuses: an integer of 5000 digits, a 13th month
        raise JobSpecError(f"not valid YAML: a value cannot be read: {clip(str(error), MAX_SHOWN_CHARS)}") from None
    if data is None:  # nothing but blanks and comments: a file cut short, not a request for the default job
        raise JobSpecError("the job file is empty")
    if not isinstance(data, dict):
        raise JobSpecError("the job file must be a YAML mapping")
    return data


def _check_size(text: str, what: str) -> None:
    size = len(text.encode("utf-8"))
    if size > MAX_JOB_BYTES:
        raise JobSpecError(f"{what} is {size} bytes; a job may be at most {MAX_JOB_BYTES} (1 MiB)")


def _check_yaml_shape(text: str) -> None:
    """Refuse, before any value is built, what would make building it costly: anchors and aliases (an alias repeats
    a value without its text, so 500 bytes of them expand to gigabytes), nesting deeper than MAX_YAML_DEPTH (libyaml
    slows quadratically with depth, and its loader recurses) and more than MAX_YAML_VALUES values. Reads the events
    only up to the first of these."""
    depth = values = 0
    try:
        for event in yaml.parse(text, Loader=yaml.CSafeLoader):
            if isinstance(event, yaml.NodeEvent) and event.anchor is not None:  # an alias is a NodeEvent too
                raise JobSpecError(f"YAML anchors and aliases (& and *) are not accepted{_line(event)}: write "
                                   "values out")
            if isinstance(event, yaml.ScalarEvent | yaml.CollectionStartEvent):
                values += 1
                if values > MAX_YAML_VALUES:
                    raise JobSpecError(f"more than {MAX_YAML_VALUES} values{_line(event)}")
            if isinstance(event, yaml.CollectionStartEvent):
                depth += 1
                if depth > MAX_YAML_DEPTH:
                    raise JobSpecError(f"lists and mappings nested deeper than {MAX_YAML_DEPTH} levels{_line(event)}")
            elif isinstance(event, yaml.CollectionEndEvent):
                depth -= 1
    except yaml.YAMLError as error:
        problem = _yaml_problem(error)
        if "maximum nesting depth" in problem:  # libyaml's own bound (newer releases), reached before ours is read
            raise JobSpecError(f"lists and mappings nested deeper than {MAX_YAML_DEPTH} levels") from None
        raise JobSpecError(f"not valid YAML: {problem}") from None


def _line(event: yaml.Event) -> str:
    return f" (line {event.start_mark.line + 1})" if event.start_mark else ""


def _yaml_problem(error: yaml.YAMLError) -> str:
    """PyYAML's error in one line: the problem and where (its own message spans lines, a caret under the column)."""
    if isinstance(error, yaml.MarkedYAMLError) and error.problem:
        mark = error.problem_mark
        return f"{error.problem}" + (f" (line {mark.line + 1}, column {mark.column + 1})" if mark else "")
    return " ".join(str(error).split())


@dataclass(frozen=True)
class JobFile:
    """A job file as the command line loaded it."""

    spec: JobSpec
    text: str  # what `coordinator submit` sends: the file's own text, or with the edge file it names inlined


def load_job_file(path: str | Path, overrides: Sequence[Override] = ()) -> JobFile:
    """The job of a YAML file, with `overrides` (`--set PATH=VALUE`) applied before it is validated. An edge-list
    topology may name its edge file (`options.path`, relative to the job file's directory): it is read here and
    inlined as `options.edges`, since the coordinator reads no files. OSError if the job file cannot be read;
    JobSpecError if it is not a job (binary, empty, too large, ...), an override does not fit it, or its edge file
    cannot be used."""
    path = Path(path)
    text = _read_text(path, "the job file")
    data = _job_mapping(text)
    apply_overrides(data, overrides)
    edge_file = _inline_edge_file(data, path.parent)
    if edge_file is None and not overrides:
        return JobFile(parse_job_spec(data), text)
    text = yaml.dump(data, Dumper=_JobDumper, sort_keys=False, allow_unicode=True)
    what = "with the overrides" if edge_file is None else f"with the edges of {shown(edge_file)} inlined"
    _check_size(text, f"{what}, the job")
    try:
        return JobFile(parse_job_yaml(text), text)  # parsed again: what submit sends is what was checked
    except JobSpecError as error:
        given = ", ".join(f"--set {override}" for override in overrides)
        raise JobSpecError(f"{error}{f' (with {given})' if overrides else ''}") from None


# -- Overrides on the command line: `--set algorithm.lr=0.05` ----------------------------------------------------

MAX_OVERRIDES = 64


@dataclass(frozen=True)
class Override:
    """One `--set PATH=VALUE`: a dotted path of the job's fields and the value that replaces what the job file says
    there (read as YAML: `0.05` a number, `true` a boolean, `[1, 2]` a list, `ring` a string)."""

    path: tuple[str, ...]
    value: Any
    text: str  # as given, for errors

    def __str__(self) -> str:
        return clip(self.text, MAX_SHOWN_CHARS)


def parse_override(text: str) -> Override:
    """`PATH=VALUE` as an Override; JobSpecError saying what is wrong. The path must name fields of the job's
    sections (an error names the first that is not one); below a mapping of free keys (an algorithm's, a model's or a
    split's options) any key is accepted here and checked by the job's own validation."""
    path_text, separator, value_text = text.partition("=")
    if not separator or not path_text.strip():
        raise JobSpecError(f"--set {shown(text)}: write PATH=VALUE, e.g. algorithm.lr=0.05")
    path = tuple(part.strip() for part in path_text.split("."))
    if any(not part for part in path) or len(path) > MAX_YAML_DEPTH:
        raise JobSpecError(f"--set {shown(text)}: {shown(path_text)} is no dotted path of fields")
    _check_override_path(path)
    try:
        _check_size(value_text, "the value")
        _check_yaml_shape(value_text)
        value = yaml.load(value_text, Loader=yaml.CSafeLoader) if value_text.strip() else ""
    except (JobSpecError, yaml.YAMLError, ValueError) as error:
        raise JobSpecError(f"--set {shown(path_text)}: {shown(value_text)} is no YAML value: {error}") from None
    return Override(path, value, text)


def _check_override_path(path: tuple[str, ...]) -> None:
    """JobSpecError unless `path` follows the fields of JobSpec's sections down to a field (or into a mapping of free
    keys, whose keys the job's validation checks)."""
    model: type[BaseModel] | None = JobSpec
    for depth, part in enumerate(path):
        where = ".".join(path[:depth]) or "the job"
        if model is None:  # below a value that is no section: a free mapping's keys, or nothing
            return
        field = model.model_fields.get(part)
        if field is None:
            raise JobSpecError(f"--set {'.'.join(path)}: {where} has no field {shown(part)}; its fields: "
                               f"{', '.join(model.model_fields)}")
        model = _section_of(field.annotation)
        if model is None and depth < len(path) - 1 and not _is_mapping(field.annotation):
            raise JobSpecError(f"--set {'.'.join(path)}: {'.'.join(path[:depth + 1])} is a value, not a section")


def _section_of(annotation: Any) -> type[BaseModel] | None:
    """The section (a model) a field holds, if it holds one (`nodes` may: {min, max})."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for argument in get_args(annotation):
        if (section := _section_of(argument)) is not None:
            return section
    return None


def _is_mapping(annotation: Any) -> bool:
    return get_origin(annotation) is dict


def apply_overrides(data: dict[str, Any], overrides: Sequence[Override]) -> None:
    """Set each override's value at its path in the job's mapping `data`, creating the sections it leaves out."""
    if len(overrides) > MAX_OVERRIDES:
        raise JobSpecError(f"{len(overrides)} overrides; at most {MAX_OVERRIDES}")
    for override in overrides:
        target = data
        for depth, part in enumerate(override.path[:-1]):
            below = target.setdefault(part, {})
            if not isinstance(below, dict):
                raise JobSpecError(f"--set {'.'.join(override.path)}: the job's "
                                   f"{'.'.join(override.path[:depth + 1])} is {shown(below)}, not a mapping")
            target = below
        target[override.path[-1]] = override.value


def _read_text(path: Path, what: str) -> str:
    """A file's text, read no further than a job may be long (/dev/zero ends there too). OSError if it cannot be
    read."""
    with path.open("rb") as file:
        data = file.read(MAX_JOB_BYTES + 1)
    if len(data) > MAX_JOB_BYTES:
        raise JobSpecError(f"{what} is larger than a job may be ({MAX_JOB_BYTES} bytes, 1 MiB)")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise JobSpecError(f"not a text file (byte {error.start} is not UTF-8)") from None


def _inline_edge_file(data: dict[str, Any], directory: Path) -> str | None:
    """Replace the `path` option of an edge-list topology by `edges`, the text of that file; returns the file's
    name as the job wrote it, None if the job names no edge file. The file's content is never repeated in an
    error."""
    topology = data.get("topology")
    options = topology.get("options") if isinstance(topology, dict) and topology.get("kind") == "edge-list" else None
    if not isinstance(options, dict) or "path" not in options:
        return None
    name = options.pop("path")
    if not isinstance(name, str) or not name:
        raise JobSpecError("topology.options.path: must be the name of an edge file")
    if "edges" in options:
        raise JobSpecError("topology.options: give the edges inline (edges) or as a file (path), not both")
    try:
        options["edges"] = _read_text(directory / name, "the edge file")
    except OSError as error:
        reason = error.strerror or type(error).__name__
        raise JobSpecError(f"topology.options.path: cannot read {shown(name)}: {reason}") from None
    except JobSpecError as error:
        raise JobSpecError(f"topology.options.path: {shown(name)}: {error}") from None
    return name


class _JobDumper(yaml.CSafeDumper):
    """Writes a multi-line string (an inlined edge file) as a literal block, line for line as in the file."""


def _represent_str(dumper: yaml.representer.SafeRepresenter, value: str) -> yaml.ScalarNode:
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)


_JobDumper.add_representer(str, _represent_str)
