"""A job's task: the data it reads and what a batch of it is, the loss, and the evaluation metric.

The node driver, the algorithms, the simulator and the report are task-neutral: an algorithm minimises the loss
the task hands it (`loss_fn`) over the batches the task's data makes, an evaluation returns an EvalResult whose
fields the task fills (accuracy for classification; validation loss and perplexity for a language model), and
what status, follow, the report and the metrics show is the task's `metrics`.

- classification: images (or any samples) and class labels; a batch is (samples (B, ...), labels (B,)); the loss
  is the cross-entropy of the logits (B, C); the metric is test accuracy.
- language-model: token sequences (nodeagent.training.tokens); a batch is (tokens (B, T), next tokens (B, T));
  the loss is the mean cross-entropy per token of the logits (B, T, V); the metrics are the validation loss and
  its exponential, the perplexity.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, ValidationError
from torch import nn

from nodeagent.jobspec import JobSpec, JobSpecError, format_validation_error
from nodeagent.runtime.progress import TASK_METRICS, Metric
from nodeagent.training.data import FIXED_SHAPES, Dataset, load_dataset
from nodeagent.training.loop import EvalResult, evaluate, model_device
from nodeagent.training.models import MODELS, InputShape, is_import_path
from nodeagent.training.splits import SPLIT_OPTIONS, split_indices
from nodeagent.training.tokens import TextOptions, TokenDataset, TokensOptions, load_tokens

__all__ = ["DATASET_MEANINGS", "DATASET_OPTIONS", "TASKS", "Task", "check_task", "task_of"]

TrainingData = Dataset | TokenDataset


class NoDatasetOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


# Each dataset kind's `data.options` (checked by the coordinator and where the data is read) and meaning; the job
# file's schema and reference (coordinator.jobschema) are generated from them.
DATASET_OPTIONS: dict[str, type[BaseModel]] = {
    "fashion-mnist": NoDatasetOptions, "mnist": NoDatasetOptions, "cifar10": NoDatasetOptions,
    "cifar100": NoDatasetOptions, "npy": NoDatasetOptions, "image-folder": NoDatasetOptions,
    "text": TextOptions, "tokens": TokensOptions,
}
DATASET_MEANINGS: dict[str, str] = {
    "fashion-mnist": "classification: Fashion-MNIST's four IDX files, plain or .gz (Debian's dataset-fashion-mnist "
    "puts them in /usr/share/datasets/fashion-mnist)",
    "mnist": "classification: MNIST's four IDX files, plain or .gz",
    "cifar10": "classification: the binary distribution's .bin files (data_batch_1..5.bin, test_batch.bin) in "
    "data_dir or its cifar-10-batches-bin",
    "cifar100": "classification: the binary distribution's train.bin and test.bin (fine labels) in data_dir or its "
    "cifar-100-binary",
    "npy": "classification: train_x.npy, train_y.npy, test_x.npy, test_y.npy: samples of any shape, uint8 or "
    "floating, and integer labels",
    "image-folder": "classification: train/<class>/<image> and test/<class>/<image>, every image of one size",
    "text": "language models: a directory of UTF-8 text files (or one file), byte-level tokens (a vocabulary of "
    "256, no tokenizer); the last validation_fraction of every file is held out for validation; a sample is "
    "sequence_length + 1 bytes of one file",
    "tokens": "language models: train.bin and val.bin, flat token files as nanoGPT writes them (uint16 or uint32, "
    "no header); a sample is sequence_length + 1 tokens",
}


BYTE_VOCABULARY = 256  # text data's (tokens data has its own)


class Task(ABC):
    name: ClassVar[str]
    datasets: ClassVar[tuple[str, ...]]  # the data kinds it reads
    splits: ClassVar[tuple[str, ...]]  # the splits it divides them by
    metrics: ClassVar[tuple[Metric, ...]]  # what its evaluations show, the headline first
    models: ClassVar[tuple[str, ...]]  # the registered models made for it (an import path may serve any task)

    @abstractmethod
    def load(self, spec: JobSpec, directory: str | Path, split: str) -> TrainingData:
        """The job's training or test data read from `directory`."""

    @abstractmethod
    def loss_fn(self) -> nn.Module:
        """The loss of a batch's outputs against its targets, a mean: what the algorithms minimise."""

    @abstractmethod
    def evaluate(self, model: nn.Module, data: TrainingData) -> EvalResult:
        """The model's figures on all of `data`, in eval mode and without autograd, on the model's device."""

    @abstractmethod
    def nominal_input(self, spec: JobSpec) -> tuple[InputShape, int]:
        """A sample's shape and the class (vocabulary) count to check the job's model options against before its
        data is read: the dataset's where the spec fixes them, else typical ones (the options' checks do not
        depend on them)."""

    def shards(self, spec: JobSpec, train: TrainingData) -> list[np.ndarray]:
        """Each rank's sample indices of the training data (nodeagent.training.splits)."""
        assert isinstance(train, Dataset)
        return split_indices(train.labels.numpy(), spec.max_nodes, spec.data.split, spec.seed,
                             dict(spec.data.split_options), train.info.num_classes)


class Classification(Task):
    name = "classification"
    datasets = ("fashion-mnist", "mnist", "cifar10", "cifar100", "npy", "image-folder")
    splits = ("iid", "class-window", "by-class", "dirichlet")
    models = ("logistic", "mlp", "cnn", "resnet-gn", "resnet-cifar")
    metrics = TASK_METRICS[name]

    def load(self, spec: JobSpec, directory: str | Path, split: str) -> Dataset:
        limit = spec.data.train_limit if split == "train" else spec.data.test_limit
        return load_dataset(spec.data.dataset, directory, split, limit)  # type: ignore[arg-type]

    def loss_fn(self) -> nn.Module:
        return nn.CrossEntropyLoss()

    def nominal_input(self, spec: JobSpec) -> tuple[InputShape, int]:
        return FIXED_SHAPES.get(spec.data.dataset, ((3, 32, 32), 10))  # npy and image-folder data have their own

    def evaluate(self, model: nn.Module, data: TrainingData) -> EvalResult:
        assert isinstance(data, Dataset)
        return evaluate(model, data)


class SequenceCrossEntropy(nn.Module):
    """The mean cross-entropy per token of logits (B, T, V) against next tokens (B, T)."""

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


EVAL_LOGITS = 1 << 22  # logits computed at once in a language model's evaluation (16 MB of float32)


def perplexity(loss: float) -> float:
    """exp(loss), the perplexity of a mean cross-entropy per token in nats (inf where it overflows)."""
    return math.exp(loss) if loss < 700 else math.inf


class LanguageModel(Task):
    name = "language-model"
    datasets = ("text", "tokens")
    splits = ("iid", "by-file")
    models = ("gpt",)
    metrics = TASK_METRICS[name]

    def load(self, spec: JobSpec, directory: str | Path, split: str) -> TokenDataset:
        limit = spec.data.train_limit if split == "train" else spec.data.test_limit
        options = DATASET_OPTIONS[spec.data.dataset].model_validate(spec.data.options)
        assert isinstance(options, TextOptions | TokensOptions)
        return load_tokens(spec.data.dataset, directory, split, options, limit)  # type: ignore[arg-type]

    def loss_fn(self) -> nn.Module:
        return SequenceCrossEntropy()

    def nominal_input(self, spec: JobSpec) -> tuple[InputShape, int]:
        options = DATASET_OPTIONS[spec.data.dataset].model_validate(spec.data.options)
        assert isinstance(options, TextOptions | TokensOptions)
        return (options.sequence_length,), BYTE_VOCABULARY

    def shards(self, spec: JobSpec, train: TrainingData) -> list[np.ndarray]:
        assert isinstance(train, TokenDataset)
        files = int(train.groups.max()) + 1
        return split_indices(train.groups, spec.max_nodes, spec.data.split, spec.seed, {}, files)

    def evaluate(self, model: nn.Module, data: TrainingData) -> EvalResult:
        """The mean cross-entropy per token over every validation sample, and its perplexity; the sum stays on the
        device until the end (one synchronisation per evaluation)."""
        assert isinstance(data, TokenDataset)
        if len(data) == 0:
            raise ValueError("cannot evaluate on an empty dataset")
        device = model_device(model)
        source = data.on(device) or data
        chunk = max(1, EVAL_LOGITS // (data.sequence_length * data.info.num_classes))
        was_training = model.training
        model.eval()
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        try:
            with torch.no_grad():
                for start in range(0, len(data), chunk):
                    inputs, targets = source.batch(slice(start, start + chunk))
                    inputs, targets = inputs.to(device), targets.to(device)
                    logits = model(inputs)
                    loss_sum += F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1),
                                                reduction="sum")
        finally:
            model.train(was_training)
        loss = float(loss_sum) / (len(data) * data.sequence_length)
        return EvalResult(accuracy=math.nan, loss=loss, perplexity=perplexity(loss))


TASKS: dict[str, Task] = {task.name: task for task in (Classification(), LanguageModel())}


def task_of(spec: JobSpec) -> Task:
    return TASKS[spec.task]


def check_task(spec: JobSpec) -> None:
    """Refuse a job whose data, split or model does not fit its task, or whose dataset options are wrong, with
    JobSpecError naming the field."""
    task = task_of(spec)
    data = spec.data
    if data.dataset not in task.datasets:
        other = next(t for t in TASKS.values() if data.dataset in t.datasets)
        raise JobSpecError(f"data.dataset: {data.dataset} is {other.name} data; the {task.name} task reads "
                           f"{', '.join(task.datasets)} (or set task: {other.name})")
    try:
        DATASET_OPTIONS[data.dataset].model_validate(data.options)
    except ValidationError as error:
        unknown = f"unknown option of the {data.dataset} dataset"
        raise JobSpecError(format_validation_error(error, "data.options", unknown)) from None
    if data.split in SPLIT_OPTIONS and data.split not in task.splits:
        raise JobSpecError(f"data.split: the {task.name} task splits its data by {', '.join(task.splits)}, not "
                           f"{data.split}")
    if data.split == "by-file" and data.dataset == "tokens":
        raise JobSpecError("data.split: by-file needs text data (files); tokens data is one stream: use iid")
    if not is_import_path(spec.model.name) and spec.model.name in MODELS and spec.model.name not in task.models:
        raise JobSpecError(f"model.name: {spec.model.name} is not a {task.name} model; the {task.name} task takes "
                           f"{', '.join(task.models)} or 'package.module:factory'")
