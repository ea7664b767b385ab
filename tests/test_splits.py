"""Division of the training set among nodes: determinism, disjointness, coverage and each kind's shape."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from nodeagent.training.data import load_dataset
from nodeagent.training.splits import (
    SPLITS,
    describe_split,
    format_split_table,
    label_order,
    split_indices,
)

pytestmark = pytest.mark.unit

# by-file divides a language model's samples labelled by their file; here the labels stand for files.
ALL_KINDS = [("iid", {}), ("class-window", {}), ("by-class", {}), ("dirichlet", {"alpha": 0.5}), ("by-file", {})]


@pytest.fixture(scope="module")
def labels(fashion_mnist_dir: Path) -> np.ndarray:
    return load_dataset("fashion-mnist", fashion_mnist_dir, "train").labels.numpy()


def label_sets(labels: np.ndarray, shards: list[np.ndarray]) -> list[set[int]]:
    return [set(np.unique(labels[shard]).tolist()) for shard in shards]


def window(node: int, classes_per_node: int = 8, shift: int = 4) -> set[int]:
    """The labels node `node` holds under the class-window rule, computed from the rule itself."""
    order = np.random.RandomState(11).permutation(10)
    return {int(order[(shift * node + offset) % 10]) for offset in range(classes_per_node)}


def test_every_kind_is_tested() -> None:
    assert sorted(SPLITS) == sorted(kind for kind, _ in ALL_KINDS)


@pytest.mark.parametrize(("kind", "options"), ALL_KINDS)
def test_same_seed_same_shards(labels: np.ndarray, kind: str, options: dict) -> None:
    first = split_indices(labels, 8, kind, 3, options)
    second = split_indices(labels, 8, kind, 3, options)
    assert all(np.array_equal(a, b) for a, b in zip(first, second, strict=True))


@pytest.mark.parametrize(("kind", "options"), [item for item in ALL_KINDS if item[0] not in ("by-class", "by-file")])
def test_another_seed_other_shards(labels: np.ndarray, kind: str, options: dict) -> None:
    first = split_indices(labels, 8, kind, 3, options)
    other = split_indices(labels, 8, kind, 4, options)
    assert not all(np.array_equal(a, b) for a, b in zip(first, other, strict=True))


@pytest.mark.parametrize(("kind", "options"), ALL_KINDS)
@pytest.mark.parametrize("nodes", [1, 8, 13])
def test_shards_are_disjoint_and_cover_every_sample(labels: np.ndarray, kind: str, options: dict, nodes: int) -> None:
    shards = split_indices(labels, nodes, kind, 0, options)
    assert len(shards) == nodes
    assert all(shard.dtype == np.int64 and len(shard) > 0 for shard in shards)
    joined = np.concatenate(shards)
    assert len(joined) == len(np.unique(joined))  # disjoint
    if kind == "class-window" and nodes == 1:
        # One window of 8 labels: the two labels outside it are left out, everything else is used.
        expected = np.flatnonzero(np.isin(labels, sorted(window(0))))
    else:
        expected = np.arange(len(labels))
    assert np.array_equal(np.sort(joined), expected)


def test_the_ecl_label_order_is_numpy_legacy_seed_11() -> None:
    assert label_order(10) == [7, 8, 2, 6, 4, 5, 1, 3, 0, 9] == np.random.RandomState(11).permutation(10).tolist()


def test_class_window_label_sets_for_8_nodes(labels: np.ndarray) -> None:
    shards = split_indices(labels, 8, "class-window", 0, {})
    held = label_sets(labels, shards)
    assert held[0] == {7, 8, 2, 6, 4, 5, 1, 3}
    assert held[1] == {4, 5, 1, 3, 0, 9, 7, 8}
    assert held == [window(node) for node in range(8)]


def test_class_window_options(labels: np.ndarray) -> None:
    shards = split_indices(labels, 10, "class-window", 0, {"classes_per_node": 2, "shift": 1})
    order = label_order(10)
    assert label_sets(labels, shards) == [{order[k], order[(k + 1) % 10]} for k in range(10)]


def test_class_window_divides_each_class_by_weights_in_0_8_to_1(labels: np.ndarray) -> None:
    shards = split_indices(labels, 8, "class-window", 0, {})
    counts = np.array([np.bincount(labels[shard], minlength=10) for shard in shards])
    for label in range(10):
        shares = counts[:, label][counts[:, label] > 0] / counts[:, label].sum()
        others = len(shares) - 1
        # A weight w in [0.8, 1] among others in [0.8, 1]: its normalised share has these bounds.
        assert shares.min() >= 0.8 / (0.8 + others * 1.0) - 1e-3
        assert shares.max() <= 1.0 / (1.0 + others * 0.8) + 1e-3
        assert shares.max() > shares.min()  # the weights are drawn, not equal


def test_iid_shares_are_equal_and_balanced(labels: np.ndarray) -> None:
    shards = split_indices(labels, 7, "iid", 0, {})
    sizes = [len(shard) for shard in shards]
    assert max(sizes) - min(sizes) <= 1
    for stats in describe_split(labels, shards):
        assert min(stats.label_counts) > 0.8 * stats.samples / 10


def test_by_class_cuts_the_label_sorted_samples_into_chunks(labels: np.ndarray) -> None:
    shards = split_indices(labels, 10, "by-class", 0, {})
    assert label_sets(labels, shards) == [{label} for label in range(10)]
    shards = split_indices(labels, 4, "by-class", 0, {})
    # 15,000 samples each: node 0 holds labels 0, 1 and half of 2, node 1 the other half of 2, 3 and 4, ...
    assert [stats.label_counts for stats in describe_split(labels, shards)][:2] == [
        [6000, 6000, 3000, 0, 0, 0, 0, 0, 0, 0],
        [0, 0, 3000, 6000, 6000, 0, 0, 0, 0, 0],
    ]


def distance_from_global(labels: np.ndarray, shards: list[np.ndarray]) -> float:
    """Mean total-variation distance between each node's label distribution and the whole set's."""
    overall = np.bincount(labels, minlength=10) / len(labels)
    return float(np.mean([0.5 * np.abs(np.bincount(labels[s], minlength=10) / len(s) - overall).sum() for s in shards]))


def test_dirichlet_heterogeneity_follows_alpha(labels: np.ndarray) -> None:
    skewed = split_indices(labels, 8, "dirichlet", 0, {"alpha": 0.1})
    near_iid = split_indices(labels, 8, "dirichlet", 0, {"alpha": 1000.0})
    assert distance_from_global(labels, skewed) > 0.5
    assert distance_from_global(labels, near_iid) < 0.05


def test_dirichlet_gives_every_node_a_sample_even_when_starved() -> None:
    few = np.arange(40) % 10
    shards = split_indices(few, 40, "dirichlet", 0, {"alpha": 0.01})
    assert [len(shard) for shard in shards] == [1] * 40


@pytest.mark.parametrize(
    ("kind", "options", "message"),
    [
        ("round-robin", {}, "unknown split 'round-robin'"),
        ("iid", {"alpha": 1.0}, "iid: unknown option.*alpha"),
        ("dirichlet", {"alpha": 0}, "dirichlet: alpha"),
        ("dirichlet", {"alpha": "much"}, "dirichlet: alpha"),
        ("class-window", {"classes_per_node": 11}, "class-window: classes_per_node"),
        ("class-window", {"shift": 1.5}, "class-window: shift"),
        ("class-window", {"classes": 8}, "class-window: unknown option.*classes"),
    ],
)
def test_bad_kind_or_option_is_named(kind: str, options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        split_indices(np.arange(100) % 10, 4, kind, 0, options)


def test_more_nodes_than_samples_is_refused() -> None:
    with pytest.raises(ValueError, match="nodes"):
        split_indices(np.arange(5), 6, "iid", 0, {})


def test_split_table_shows_counts_per_node(labels: np.ndarray) -> None:
    stats = describe_split(labels, split_indices(labels, 8, "class-window", 0, {}))
    assert sum(item.samples for item in stats) == len(labels)
    assert all(sum(item.label_counts) == item.samples for item in stats)
    lines = format_split_table(stats).splitlines()
    assert lines[0].split() == ["node", "samples", *(f"L{label}" for label in range(10))]
    assert len(lines) == 9
    node0 = lines[1].split()
    assert node0[:2] == ["0", str(stats[0].samples)] and node0[2] == "0"  # label 0 is outside node 0's window
    assert [int(cell) for cell in node0[2:]] == stats[0].label_counts


@pytest.mark.parametrize(("kind", "options"), [("iid", {}), ("class-window", {"classes_per_node": 2, "shift": 1}),
                                               ("by-class", {}), ("dirichlet", {"alpha": 0.5})])
@pytest.mark.parametrize("num_classes", [3, 100])
def test_every_kind_splits_data_of_3_or_100_classes(kind: str, options: dict, num_classes: int) -> None:
    labels = np.random.default_rng(0).permutation(np.arange(30 * num_classes) % num_classes)
    shards = split_indices(labels, 6, kind, 0, options, num_classes)
    joined = np.concatenate(shards)
    assert len(joined) == len(np.unique(joined)) and all(len(shard) for shard in shards)
    if kind == "class-window":  # windows of 2 classes moving by 1 over the classes in label_order(num_classes)
        order = label_order(num_classes)
        assert label_sets(labels, shards) == [{order[n % num_classes], order[(n + 1) % num_classes]} for n in range(6)]
    else:
        assert np.array_equal(np.sort(joined), np.arange(len(labels)))


def test_class_window_cannot_hold_more_classes_than_the_data_has() -> None:
    with pytest.raises(ValueError, match=r"classes_per_node must be an integer in 1\.\.3 \(the data has 3 classes\)"):
        split_indices(np.arange(30) % 3, 4, "class-window", 0, {}, 3)  # the default 8


def test_the_class_count_comes_from_the_data_not_the_labels_present() -> None:
    # A limited training set may lack the last classes: the class order is still that of the data's 10 classes.
    labels = np.arange(80) % 8
    shards = split_indices(labels, 10, "class-window", 0, {"classes_per_node": 2, "shift": 1}, 10)
    order = label_order(10)
    assert label_sets(labels, shards)[0] == {order[0], order[1]} - {8, 9}
    with pytest.raises(ValueError, match=r"labels must lie in 0\.\.4"):
        split_indices(labels, 2, "iid", 0, {}, 5)


def test_the_split_table_of_100_classes_shows_the_first_ten_and_counts_the_rest() -> None:
    labels = np.arange(2000) % 100
    stats = describe_split(labels, split_indices(labels, 4, "by-class", 0, {}, 100), 100)
    lines = format_split_table(stats).splitlines()
    assert lines[0].split() == ["node", "samples", "classes", *(f"L{label}" for label in range(10))]
    assert lines[1].split()[:3] == ["0", "500", "25"] and lines[4].split()[3:] == ["0"] * 10
    assert lines[-1] == "(labels L10..L99 not shown: 90 more classes)"
    assert max(len(line) for line in lines) < 80
