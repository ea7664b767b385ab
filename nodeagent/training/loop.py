"""Minibatches over a node's shard, and evaluation of a model on a dataset.

No DataLoader: the whole dataset already sits in one array (in memory or memory-mapped), so a minibatch is one
indexing operation and its normalisation, which keeps the per-step overhead to microseconds (the simulator runs
hundreds of nodes in one process).

On a GPU the batches are made where the node computes: from the data set uploaded to the device once when it fits
(`Dataset.on`), else gathered in host memory, pinned and copied over without blocking, one batch ahead, so that the
copy of the next batch overlaps the step on this one. The order of the samples is the same on every device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from nodeagent.training.data import Dataset

if TYPE_CHECKING:
    from nodeagent.training.tokens import TokenDataset

__all__ = ["BatchStream", "EvalResult", "evaluate", "model_device"]

CPU = torch.device("cpu")


class BatchStream:
    """An endless, deterministic sequence of minibatches from the samples `indices` of `dataset` (a classification
    Dataset or a language model's TokenDataset: what a batch is, is the dataset's `batch`).

    Each epoch visits every sample of the shard once, in an order drawn from a numpy Generator seeded with
    `seed`; the last batch of an epoch is smaller when the batch size does not divide the shard.
    """

    def __init__(self, dataset: Dataset | TokenDataset, indices: np.ndarray, batch_size: int, seed: int,
                 device: torch.device = CPU) -> None:
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
        self.device = device
        self._on_device = dataset.on(device)
        self._order_on_device: torch.Tensor | None = None  # this epoch's order, where the data set is uploaded
        self._ahead: tuple[torch.Tensor, torch.Tensor] | None = None  # the next batch, on its way to the device

    def _shuffled(self) -> np.ndarray:
        return self._indices[self._rng.permutation(len(self._indices))]

    def _indices_of_next(self) -> np.ndarray:
        batch = self._order[self._position : self._position + self._batch_size]
        self._position += self._batch_size
        if self._position >= len(self._order):
            self.epochs += 1
            self._order = self._shuffled()
            self._position = 0
        return batch

    def _on_host(self, batch: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        return self.dataset.batch(batch)

    def _copied_over(self, batch: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch gathered in host memory and copied to the device from pinned memory, without blocking: the
        caching host allocator keeps the pinned buffers until their copies completed."""
        images, labels = self._on_host(batch)
        return (images.pin_memory().to(self.device, non_blocking=True),
                labels.pin_memory().to(self.device, non_blocking=True))

    def _indices_on_device(self) -> torch.Tensor:
        """The next minibatch's indices, cut from the epoch's order uploaded once per epoch: a copy from pageable
        memory per step would wait for the device to finish the steps queued before it."""
        if self._position == 0 or self._order_on_device is None:
            self._order_on_device = torch.from_numpy(self._order).to(self.device)
        start = self._position
        self._indices_of_next()
        return self._order_on_device[start : start + self._batch_size]

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next minibatch, on the stream's device: inputs and targets (normalised images (B, *input_shape) and
        labels (B,); a language model's tokens and next tokens, (B, T) each)."""
        if self.device.type == "cpu":
            return self._on_host(self._indices_of_next())
        if self._on_device is not None:
            return self._on_device.batch(self._indices_on_device())
        current = self._ahead if self._ahead is not None else self._copied_over(self._indices_of_next())
        self._ahead = self._copied_over(self._indices_of_next())
        return current

    __next__ = next

    def __iter__(self) -> BatchStream:
        return self


@dataclass(frozen=True)
class EvalResult:
    """An evaluation's figures, as its task (nodeagent.training.tasks) fills them; NaN: not a figure of the task."""

    accuracy: float  # classification: fraction correct, in [0, 1]
    loss: float  # mean cross-entropy per sample (per token for a language model)
    perplexity: float = math.nan  # language models: exp(loss)


def model_device(model: nn.Module) -> torch.device:
    """The device of a model's parameters (the CPU for a model without any)."""
    parameter = next(model.parameters(), None)
    return parameter.device if parameter is not None else CPU


def evaluate(model: nn.Module, dataset: Dataset, batch_size: int = 1000) -> EvalResult:
    """Accuracy and mean cross-entropy of `model` on all of `dataset`, in eval mode (dropout off) and without
    autograd, on the model's device; the model's previous train/eval mode is restored afterwards. The sums stay on
    the device until the end: one synchronisation with a GPU per evaluation, not two per chunk."""
    if len(dataset) == 0:
        raise ValueError("cannot evaluate on an empty dataset")
    device = model_device(model)
    uploaded = dataset.on(device)
    was_training = model.training
    model.eval()
    correct: torch.Tensor | None = None
    loss_sum: torch.Tensor | None = None  # float64, of float32 chunk sums, as a Python float would add them
    try:
        with torch.no_grad():
            for start in range(0, len(dataset), batch_size):
                part = slice(start, start + batch_size)
                if uploaded is not None:
                    images, labels = uploaded.images(part), uploaded.labels[part]
                else:
                    images = dataset.normalised[part].to(device, non_blocking=True)
                    labels = dataset.labels[part].to(device, non_blocking=True)
                logits = model(images)
                chunk_loss = F.cross_entropy(logits, labels, reduction="sum").double()
                chunk_correct = (logits.argmax(dim=1) == labels).sum()
                # The first chunk's sums start the totals: most evaluations (each simulated node's) are of one chunk.
                loss_sum = chunk_loss if loss_sum is None else loss_sum.add_(chunk_loss)
                correct = chunk_correct if correct is None else correct.add_(chunk_correct)
    finally:
        model.train(was_training)
    assert correct is not None and loss_sum is not None  # the data set is not empty: one chunk at least
    return EvalResult(accuracy=int(correct) / len(dataset), loss=float(loss_sum) / len(dataset))
