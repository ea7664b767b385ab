"""One node of a job, built from the job spec and the node's place in the topology.

Both runtimes (the gRPC agent and the simulator) build their nodes here, so a node is the same object
whichever runtime drives it: same seeded initial model on every node, same shard, same batch order.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from nodeagent.algorithms import Algorithm, Neighbor, NodeContext, build_algorithm
from nodeagent.jobspec import JobSpec
from nodeagent.training.data import Dataset, load_dataset
from nodeagent.training.loop import BatchStream, EvalResult, evaluate
from nodeagent.training.models import initial_model
from nodeagent.training.splits import split_indices


@dataclass
class Node:
    spec: JobSpec
    rank: int
    algorithm: Algorithm
    batches: BatchStream
    test_set: Dataset | None  # None: the node is not evaluated (mathematics tests on synthetic problems)
    shard_size: int

    def evaluate(self) -> EvalResult:
        if self.test_set is None:
            return EvalResult(math.nan, math.nan)
        return evaluate(self.algorithm.model, self.test_set)


def build_node(
    spec: JobSpec,
    rank: int,
    neighbors: tuple[Neighbor, ...],
    self_weight: float,
    data_dir: str | Path | None = None,
    peer_schedule: tuple[tuple[int, ...], ...] = (),
    allow_imports: Collection[str] = (),
) -> Node:
    """The node of `rank`: model initialised from the job's seed (identical on every node), its data shard,
    and its algorithm. `data_dir` overrides the job's data directory on this machine; `allow_imports` are the
    modules a model may be imported from on it (nodeagent.training.models)."""
    directory = data_dir or spec.data.data_dir
    train = load_dataset(spec.data.dataset, directory, "train", spec.data.train_limit)
    test = load_dataset(spec.data.dataset, directory, "test", spec.data.test_limit)
    shards = split_indices(
        train.labels.numpy(), spec.nodes, spec.data.split, spec.seed, dict(spec.data.split_options),
        train.info.num_classes,
    )
    model = initial_model(spec, train.info, allow_imports)
    context = NodeContext(
        rank=rank,
        world_size=spec.nodes,
        neighbors=neighbors,
        spec=spec.algorithm,
        self_weight=self_weight,
        seed=spec.seed,
        peer_schedule=peer_schedule,
    )
    algorithm = build_algorithm(model, context)
    # Each node draws its own batch order, reproducibly.
    batches = BatchStream(train, shards[rank], spec.data.batch_size, seed=spec.seed * 1_000_003 + rank)
    return Node(spec, rank, algorithm, batches, test, len(shards[rank]))
