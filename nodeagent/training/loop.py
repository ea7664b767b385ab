"""Minibatches over a node's shard, and evaluation of a model on a dataset.

No DataLoader: the whole dataset already sits in one array (in memory or memory-mapped), so a minibatch is one
indexing operation and its normalisation, which keeps the per-step overhead to microseconds (the simulator runs
hundreds of nodes in one process).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from nodeagent.training.data import Dataset

__all__ = ["BatchStream", "EvalResult", "evaluate"]


class BatchStream:
    """An endless, deterministic sequence of minibatches from the samples `indices` of `dataset`.

    Each epoch visits every sample of the shard once, in an order drawn from a numpy Generator seeded with
    `seed`; the last batch of an epoch is smaller when the batch size does not divide the shard.
    """

    def __init__(self, dataset: Dataset, indices: np.ndarray, batch_size: int, seed: int) -> None:
        indices = np.asarray(indices, dtype=np.int64)
        if indices.ndim != 1 or len(indices) == 0:
            raise ValueError(f"a shard must be a non-empty 1-D index array, got shape {indices.shape}")
        if indices.min() < 0 or indices.max() >= len(dataset):
            raise ValueError(f"shard indices must lie in 0..{len(dataset) - 1}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        self.dataset = dataset  # shared, never copied: the stream only gathers its minibatches from it
        self._indices = indices
        self._batch_size = batch_size
        self._rng = np.random.default_rng(seed)
        self._order = self._shuffled()
        self._position = 0
        self.epochs = 0  # complete passes over the shard served so far

    def _shuffled(self) -> np.ndarray:
        return self._indices[self._rng.permutation(len(self._indices))]

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next minibatch: normalised images (B, *input_shape) and labels (B,)."""
        batch = self._order[self._position : self._position + self._batch_size]
        self._position += self._batch_size
        if self._position >= len(self._order):
            self.epochs += 1
            self._order = self._shuffled()
            self._position = 0
        return self.dataset.images(batch), self.dataset.labels.index_select(0, torch.from_numpy(batch))

    __next__ = next

    def __iter__(self) -> BatchStream:
        return self


@dataclass(frozen=True)
class EvalResult:
    accuracy: float  # fraction correct, in [0, 1]
    loss: float  # mean cross-entropy per sample


def evaluate(model: nn.Module, dataset: Dataset, batch_size: int = 1000) -> EvalResult:
    """Accuracy and mean cross-entropy of `model` on all of `dataset`, in eval mode (dropout off) and without
    autograd; the model's previous train/eval mode is restored afterwards."""
    if len(dataset) == 0:
        raise ValueError("cannot evaluate on an empty dataset")
    was_training = model.training
    model.eval()
    correct = 0
    loss_sum = 0.0
    try:
        with torch.no_grad():
            for start in range(0, len(dataset), batch_size):
                images = dataset.normalised[start : start + batch_size]
                labels = dataset.labels[start : start + batch_size]
                logits = model(images)
                loss_sum += F.cross_entropy(logits, labels, reduction="sum").item()
                correct += int((logits.argmax(dim=1) == labels).sum().item())
    finally:
        model.train(was_training)
    return EvalResult(accuracy=correct / len(dataset), loss=loss_sum / len(dataset))
