"""Division of a training set among the nodes of a job: which sample indices each node holds.

Every split is a pure function of the labels, the node count, the seed and its options, so the coordinator,
the agents and the simulator compute the same shards independently. Each shard is returned sorted; the
minibatch stream shuffles it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "SPLITS", "SPLIT_MEANINGS", "SPLIT_OPTIONS", "ShardStats", "SplitOptions", "describe_split", "format_split_table",
    "label_order", "split_indices",
]

MAX_LABEL_COLUMNS = 10  # a split table shows this many label columns; more classes are summarised


def label_order(num_classes: int) -> list[int]:
    """The order in which class-window's windows run over the classes: ECL-ISVR's
    np.random.RandomState(11).permutation(C), for 10 classes 7, 8, 2, 6, 4, 5, 1, 3, 0, 9."""
    return np.random.RandomState(11).permutation(num_classes).tolist()


def _iid(labels: np.ndarray, nodes: int, rng: np.random.Generator, num_classes: int) -> list[np.ndarray]:
    return np.array_split(rng.permutation(len(labels)), nodes)


def _by_class(labels: np.ndarray, nodes: int, rng: np.random.Generator, num_classes: int) -> list[np.ndarray]:
    # A stable sort keeps the file order within a class, so the split needs no randomness at all.
    return np.array_split(np.argsort(labels, kind="stable"), nodes)


def _by_file(labels: np.ndarray, nodes: int, rng: np.random.Generator, num_classes: int) -> list[np.ndarray]:
    """Whole files (the labels of a language model's samples) to each node, in order, cut where the shares come
    closest to equal; with fewer files than nodes, the samples in file order cut into equal contiguous chunks."""
    order = np.argsort(labels, kind="stable")
    files, sizes = np.unique(labels, return_counts=True)
    if len(files) < nodes:
        return np.array_split(order, nodes)
    ends = np.cumsum(sizes)  # ends[j]: samples in files 0..j
    cuts = []  # cuts[k - 1]: the first file of node k
    previous = 0
    for node in range(1, nodes):
        target = node * len(labels) / nodes
        # A file boundary after the previous cut that leaves at least one file to each node after this one.
        first, last = previous + 1, len(files) - (nodes - node)
        choice = min(range(first, last + 1), key=lambda file: abs(ends[file - 1] - target))
        cuts.append(choice)
        previous = choice
    return np.split(order, [int(ends[cut - 1]) for cut in cuts])


def _class_window(
    labels: np.ndarray, nodes: int, rng: np.random.Generator, num_classes: int, classes_per_node: int, shift: int
) -> list[np.ndarray]:
    if not (isinstance(classes_per_node, int) and 1 <= classes_per_node <= num_classes):
        raise ValueError(f"class-window: classes_per_node must be an integer in 1..{num_classes} (the data has "
                         f"{num_classes} classes), got {classes_per_node!r}")
    if not isinstance(shift, int):
        raise ValueError(f"class-window: shift must be an integer, got {shift!r}")
    order = label_order(num_classes)
    holders: dict[int, list[int]] = {label: [] for label in range(num_classes)}
    for node in range(nodes):
        start = shift * node % num_classes
        for offset in range(classes_per_node):
            holders[order[(start + offset) % num_classes]].append(node)
    parts: list[list[np.ndarray]] = [[] for _ in range(nodes)]
    # A class that no node's window covers (possible with few nodes) is left out of the split.
    for label in range(num_classes):
        if not holders[label]:
            continue
        members = rng.permutation(np.flatnonzero(labels == label))
        weights = 0.8 + 0.2 * rng.uniform(size=len(holders[label]))
        cuts = np.round(np.cumsum(weights / weights.sum())[:-1] * len(members)).astype(np.int64)
        for node, piece in zip(holders[label], np.split(members, cuts), strict=True):
            parts[node].append(piece)
    return [np.concatenate(pieces) for pieces in parts]


def _dirichlet(
    labels: np.ndarray, nodes: int, rng: np.random.Generator, num_classes: int, alpha: float
) -> list[np.ndarray]:
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not alpha > 0:
        raise ValueError(f"dirichlet: alpha must be a number > 0, got {alpha!r}")
    parts: list[list[int]] = [[] for _ in range(nodes)]
    for label in range(num_classes):
        members = rng.permutation(np.flatnonzero(labels == label))
        shares = rng.dirichlet(np.full(nodes, float(alpha)))
        cuts = np.round(np.cumsum(shares)[:-1] * len(members)).astype(np.int64)
        for node, piece in enumerate(np.split(members, cuts)):
            parts[node].extend(piece.tolist())
    # With a small alpha some nodes draw nothing; a node without data cannot train, so each empty node takes
    # one sample from the node that currently holds the most.
    for node in range(nodes):
        if not parts[node]:
            richest = max(range(nodes), key=lambda other: len(parts[other]))
            parts[node].append(parts[richest].pop())
    return [np.asarray(part, dtype=np.int64) for part in parts]


# name -> split function(labels, nodes, rng, num_classes, **options)
SPLITS: dict[str, Callable[..., list[np.ndarray]]] = {
    "iid": _iid,
    "class-window": _class_window,
    "by-class": _by_class,
    "dirichlet": _dirichlet,
    "by-file": _by_file,
}



class SplitOptions(BaseModel):
    """A split's `data.split_options` with their defaults; a split without options takes this one. The
    coordinator checks a job's options with it (coordinator.jobs.validate_job), and the job file's schema and
    reference (coordinator.jobschema) are generated from these; the split functions check the values too."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class ClassWindowOptions(SplitOptions):
    classes_per_node: int = Field(8, ge=1, description="classes each node holds (at most the data's classes)")
    shift: int = Field(4, description="how far the window of classes moves from one node to the next")


class DirichletOptions(SplitOptions):
    alpha: float = Field(0.5, gt=0, description="concentration: small values give each node few classes, large "
                         "values approach iid")


SPLIT_OPTIONS: dict[str, type[SplitOptions]] = {
    "iid": SplitOptions, "class-window": ClassWindowOptions, "by-class": SplitOptions, "dirichlet": DirichletOptions,
    "by-file": SplitOptions,
}
SPLIT_MEANINGS: dict[str, str] = {
    "iid": "shuffled, equal shares",
    "class-window": "ECL-ISVR's heterogeneous split: node n holds classes_per_node classes, a window moved by "
    "shift classes per node, each class shared unevenly among the nodes holding it",
    "by-class": "sorted by label and cut into contiguous equal chunks (ignores the seed)",
    "dirichlet": "per class, shares drawn from a Dirichlet(alpha) distribution; every node gets at least one "
    "sample",
    "by-file": "language-model data (text): whole source files to each node, in order, as near equal shares as "
    "file boundaries allow, so that each node trains on documents of its own (the heterogeneous setting); with "
    "fewer files than nodes, the sequences in file order cut into equal contiguous chunks; ignores the seed",
}


def split_indices(
    labels: np.ndarray, nodes: int, kind: str, seed: int, options: dict[str, Any] | None = None,
    num_classes: int | None = None,
) -> list[np.ndarray]:
    """Returns, for each of `nodes` nodes, the sorted int64 indices of the samples it holds. `num_classes` is the
    data's class count (DatasetInfo.num_classes; unset: the largest label + 1): class-window's order of the classes
    depends on it, so pass it when the labels may lack the last classes (a train_limit).

    Kinds: iid (shuffled, equal shares), by-file (a language model's samples, labelled by their source file: whole
    files to each node), class-window (ECL-ISVR; options classes_per_node=8, shift=4),
    by-class (sorted by label, contiguous equal chunks; ignores the seed), dirichlet (option alpha=0.5;
    every node gets at least one sample). Shares differ by at most one sample where the count does not
    divide. Raises ValueError naming an unknown kind or a bad option.
    """
    if kind not in SPLITS:
        raise ValueError(f"unknown split {kind!r}; known: {', '.join(SPLITS)}")
    fields = SPLIT_OPTIONS[kind].model_fields
    options = dict(options or {})
    unknown = sorted(set(options) - set(fields))
    if unknown:
        accepted = ", ".join(fields) or "none"
        raise ValueError(f"{kind}: unknown option(s) {', '.join(unknown)}; accepted: {accepted}")
    options = {name: field.default for name, field in fields.items()} | options
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise ValueError(f"labels must be one-dimensional, got shape {labels.shape}")
    if num_classes is None:
        num_classes = int(labels.max()) + 1 if labels.size else 1
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        raise ValueError(f"labels must lie in 0..{num_classes - 1}")
    if not 1 <= nodes <= len(labels):
        raise ValueError(f"nodes must be in 1..{len(labels)} (one sample per node at least), got {nodes}")
    shards = SPLITS[kind](labels, nodes, np.random.default_rng(seed), num_classes, **options)
    return [np.sort(shard).astype(np.int64, copy=False) for shard in shards]


@dataclass
class ShardStats:
    node: int
    samples: int
    label_counts: list[int]


def describe_split(labels: np.ndarray, shards: list[np.ndarray], num_classes: int | None = None) -> list[ShardStats]:
    """Sample count and label histogram of each node's shard (`num_classes` bins; unset: the largest label + 1)."""
    labels = np.asarray(labels)
    if num_classes is None:
        num_classes = int(labels.max()) + 1 if labels.size else 0
    return [
        ShardStats(
            node=node,
            samples=len(shard),
            label_counts=np.bincount(labels[shard], minlength=num_classes).tolist(),
        )
        for node, shard in enumerate(shards)
    ]


def format_split_table(stats: list[ShardStats]) -> str:
    """A plain-text table, one row per node: sample count, then the count of each label. With more than
    MAX_LABEL_COLUMNS classes, a column `classes` (how many of them the node holds) comes before the first labels'
    counts, and a last line says how many labels are not shown."""
    num_classes = max((len(item.label_counts) for item in stats), default=0)
    shown_labels = min(num_classes, MAX_LABEL_COLUMNS)
    held = ["classes"] if num_classes > shown_labels else []
    header = ["node", "samples", *held, *(f"L{label}" for label in range(shown_labels))]
    rows = [
        [str(item.node), str(item.samples), *([str(sum(1 for count in item.label_counts if count))] if held else []),
         *map(str, item.label_counts[:shown_labels])]
        for item in stats
    ]
    widths = [max(len(row[column]) for row in [header, *rows]) for column in range(len(header))]
    lines = ["  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True)) for row in [header, *rows]]
    if held:
        lines.append(f"(labels L{shown_labels}..L{num_classes - 1} not shown: {num_classes - shown_labels} more "
                     f"classes)")
    return "\n".join(lines)
