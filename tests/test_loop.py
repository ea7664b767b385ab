"""Minibatch streams over a shard, and evaluation, on real Fashion-MNIST where it matters."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nodeagent.jobspec import ModelSpec
from nodeagent.training.data import Dataset, DatasetInfo, Normalisation, load_dataset
from nodeagent.training.loop import BatchStream, evaluate
from nodeagent.training.models import build_model

pytestmark = pytest.mark.unit


def in_memory(images: torch.Tensor, labels: torch.Tensor) -> Dataset:
    """A dataset of these float samples, taken as they are (no normalisation)."""
    info = DatasetInfo(tuple(images.shape[1:]), 10, len(labels), 0)
    return Dataset(samples=images.numpy(), labels=labels, info=info, normalisation=Normalisation(1.0, (0.0,), (1.0,)))


def numbered(size: int) -> Dataset:
    """A dataset whose image i holds the number i, so a batch shows which samples it drew."""
    return in_memory(torch.arange(size, dtype=torch.float32).reshape(size, 1, 1, 1),
                     torch.arange(size, dtype=torch.int64) % 10)


def drawn(batch: tuple[torch.Tensor, torch.Tensor]) -> list[int]:
    return batch[0].reshape(-1).long().tolist()


@pytest.fixture(scope="module")
def fashion_train(fashion_mnist_dir: Path) -> Dataset:
    return load_dataset("fashion-mnist", fashion_mnist_dir, "train")


@pytest.fixture(scope="module")
def fashion_test(fashion_mnist_dir: Path) -> Dataset:
    return load_dataset("fashion-mnist", fashion_mnist_dir, "test")


def test_each_epoch_visits_the_shard_once_in_a_new_order() -> None:
    shard = np.arange(100, 350)  # 250 samples of a 400-sample dataset
    stream = BatchStream(numbered(400), shard, batch_size=100, seed=0)
    epochs = []
    for _ in range(2):
        batches = [drawn(stream.next()) for _ in range(3)]
        assert [len(batch) for batch in batches] == [100, 100, 50]
        epochs.append([index for batch in batches for index in batch])
    assert stream.epochs == 2
    assert sorted(epochs[0]) == sorted(epochs[1]) == shard.tolist()
    assert epochs[0] != epochs[1]
    assert epochs[0] != shard.tolist()  # shuffled, not in shard order


def test_the_epoch_count_advances_when_the_last_batch_is_served() -> None:
    stream = BatchStream(numbered(10), np.arange(10), batch_size=4, seed=0)
    counts = []
    for _ in range(6):
        stream.next()
        counts.append(stream.epochs)
    assert counts == [0, 0, 1, 1, 1, 2]


def test_same_seed_same_batches_other_seed_other_batches() -> None:
    def first_batches(seed: int) -> list[list[int]]:
        stream = BatchStream(numbered(300), np.arange(300), batch_size=32, seed=seed)
        return [drawn(batch) for _, batch in zip(range(25), stream, strict=False)]  # over two epochs

    assert first_batches(7) == first_batches(7)
    assert first_batches(7) != first_batches(8)


def test_batches_hold_images_with_their_own_labels(fashion_train: Dataset) -> None:
    shard = np.arange(1000, 1300)
    images, labels = BatchStream(fashion_train, shard, batch_size=50, seed=0).next()
    assert images.shape == (50, 1, 28, 28) and labels.shape == (50,)
    for image, label in zip(images, labels, strict=True):
        matches = (fashion_train.images(shard) == image).all(dim=(1, 2, 3)).nonzero().reshape(-1)
        assert len(matches) > 0 and label == fashion_train.labels[shard][matches[0]]


@pytest.mark.parametrize(
    ("indices", "batch_size", "message"),
    [(np.array([], np.int64), 10, "non-empty"), (np.array([0, 10]), 10, "0..9"), (np.arange(5), 0, "batch_size")],
)
def test_bad_shards_are_refused(indices: np.ndarray, batch_size: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BatchStream(numbered(10), indices, batch_size, seed=0)


def test_untrained_model_is_at_chance(fashion_test: Dataset) -> None:
    torch.manual_seed(0)
    result = evaluate(build_model(ModelSpec(name="logistic")), fashion_test)
    assert 0.02 < result.accuracy < 0.25
    assert abs(result.loss - math.log(10)) < 0.7


def test_logistic_regression_learns_fashion_mnist(fashion_train: Dataset, fashion_test: Dataset) -> None:
    torch.manual_seed(0)
    model = build_model(ModelSpec(name="logistic"))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    stream = BatchStream(fashion_train, np.arange(len(fashion_train)), batch_size=100, seed=0)
    for _ in range(300):
        images, labels = stream.next()
        optimizer.zero_grad()
        F.cross_entropy(model(images), labels).backward()
        optimizer.step()
    result = evaluate(model, fashion_test)
    assert result.accuracy > 0.7
    assert result.loss < 0.9


def test_evaluate_matches_a_direct_computation_whatever_the_batch_size(fashion_test: Dataset) -> None:
    torch.manual_seed(0)
    model = build_model(ModelSpec(name="mlp", options={"hidden": [32]}))
    subset = in_memory(fashion_test.images(slice(0, 530)), fashion_test.labels[:530])
    with torch.no_grad():
        logits = model(subset.images(slice(None)))
    expected_accuracy = int((logits.argmax(dim=1) == subset.labels).sum()) / len(subset)
    expected_loss = F.cross_entropy(logits, subset.labels).item()
    for batch_size in (1000, 100, 7):
        result = evaluate(model, subset, batch_size=batch_size)
        assert result.accuracy == expected_accuracy
        assert result.loss == pytest.approx(expected_loss, rel=1e-5)


class _Probe(nn.Module):
    """Records whether autograd was on and which mode it was in when called; dropout makes train mode visible."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(784, 10)
        self.dropout = nn.Dropout(0.9)
        self.calls: list[tuple[bool, bool]] = []

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        self.calls.append((torch.is_grad_enabled(), self.training))
        return self.dropout(self.linear(images.flatten(1)))


@pytest.mark.parametrize("training", [True, False])
def test_evaluate_runs_in_eval_mode_without_autograd_and_restores_the_mode(training: bool) -> None:
    model = _Probe()
    model.train(training)
    dataset = in_memory(torch.randn(20, 1, 28, 28), torch.arange(20) % 10)
    first = evaluate(model, dataset, batch_size=8)
    assert model.calls == [(False, False)] * 3
    assert model.training is training
    assert evaluate(model, dataset, batch_size=8) == first  # no dropout noise


def test_evaluate_refuses_an_empty_dataset() -> None:
    with pytest.raises(ValueError, match="empty"):
        evaluate(nn.Flatten(), in_memory(torch.zeros(0, 1, 28, 28), torch.zeros(0, dtype=torch.int64)))
