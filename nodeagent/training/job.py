"""One node of a job, built from the job spec and the node's place in the topology.

Both runtimes (the gRPC agent and the simulator) build their nodes here, so a node is the same object
whichever runtime drives it: same seeded initial model on every node, same shard, same batch order.

What the nodes of a job share is prepared once per job (`JobData`): the datasets, the split and the seeded initial
model. A node then costs only its own state: its shard is an index array into the shared training set, its model a
copy of the initial one. The simulator builds thousands of nodes from one JobData; an agent builds its one node
through `build_node`.
"""

from __future__ import annotations

import copy
import math
from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from nodeagent.algorithms import Algorithm, Neighbor, NodeContext, build_algorithm
from nodeagent.jobspec import JobSpec
from nodeagent.training.loop import CPU, BatchStream, EvalResult, model_device
from nodeagent.training.model_memory import check_model_memory
from nodeagent.training.models import initial_model
from nodeagent.training.tasks import Task, TrainingData, task_of

# Values a module's copy may share with the original: immutable.
_IMMUTABLE = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)
_CONTAINERS = (dict, OrderedDict, set, list)  # copied shallowly where they hold only immutable values


class _NotPlain(Exception):
    """A module holds something `copy_model`'s fast path does not copy as deepcopy would."""


def copy_model(model: nn.Module, device: torch.device) -> nn.Module:
    """`copy.deepcopy(model).to(device)`: the same parameters, buffers and attributes, for a plain module tree
    (modules, parameters, buffers, immutable attributes, containers of immutable values) in one pass, about ten
    times faster for a small model. The simulator copies the initial model once per node, and deepcopy's generic
    walk and the `.to` after it took nearly half of building a logistic node. Anything else (hooks, custom copying,
    other attribute types) takes deepcopy itself."""
    try:
        return _copied_module(model, device, {})
    except _NotPlain:
        return copy.deepcopy(model).to(device)


def _immutable(value: object) -> bool:
    return isinstance(value, _IMMUTABLE) or (type(value) is tuple and all(_immutable(v) for v in value))


def _plain_container(value: object) -> bool:
    """A dict, set or list of immutable values (a module's empty hook dictionaries): a shallow copy is a deep one."""
    if isinstance(value, dict) and type(value) in (dict, OrderedDict):
        return all(_immutable(k) and _immutable(v) for k, v in value.items())
    return isinstance(value, set | list) and type(value) in (set, list) and all(_immutable(v) for v in value)


def _copied_module(module: nn.Module, device: torch.device, memo: dict[int, Any]) -> nn.Module:
    if id(module) in memo:  # one module reached twice (shared): shared in the copy too, as deepcopy's memo keeps it
        return memo[id(module)]
    cls = type(module)
    if (getattr(cls, "__deepcopy__", None) is not None or cls.__reduce_ex__ is not object.__reduce_ex__
            or cls.__getstate__ is not nn.Module.__getstate__):
        raise _NotPlain
    copied = cls.__new__(cls)
    memo[id(module)] = copied
    state: dict[str, object] = {}
    for key, value in module.__dict__.items():
        if key == "_parameters":
            state[key] = {name: _copied_tensor(p, device, memo) for name, p in value.items()}
        elif key == "_buffers":
            state[key] = {name: _copied_tensor(b, device, memo) for name, b in value.items()}
        elif key == "_modules":
            state[key] = {name: None if m is None else _copied_module(m, device, memo) for name, m in value.items()}
        elif type(value) in _CONTAINERS and not value:  # most of a module's attributes: its empty hook tables
            state[key] = value.copy()
        elif _immutable(value):
            state[key] = value
        elif _plain_container(value):
            state[key] = value.copy()
        else:
            raise _NotPlain
    copied.__setstate__(state)  # as deepcopy restores it (a convolution's sets defaults of older versions)
    return copied


def _copied_tensor(tensor: torch.Tensor | None, device: torch.device, memo: dict[int, Any]) -> torch.Tensor | None:
    """A parameter or buffer as deepcopy and `.to(device)` leave it: its values copied (its gradient not, as
    Parameter's deepcopy leaves it), on `device`."""
    if tensor is None:
        return None
    if id(tensor) in memo:  # tied weights stay tied
        return memo[id(tensor)]
    if type(tensor) is nn.Parameter and not tensor.__dict__:
        copied: torch.Tensor = nn.Parameter(tensor.detach().to(device, copy=True), tensor.requires_grad)
    elif type(tensor) is torch.Tensor and not tensor.requires_grad and tensor.grad is None and not tensor.__dict__:
        copied = tensor.detach().to(device, copy=True)
    else:
        raise _NotPlain
    memo[id(tensor)] = copied
    return copied


class InitialEvaluation:
    """The job's initial model evaluated on its test set once per device, for all its nodes: each is evaluated at
    step 0 (where its curve starts), from the same parameters, which would repeat one evaluation per node."""

    def __init__(self, initial: nn.Module, test_set: TrainingData, task: Task) -> None:
        self._state = initial.state_dict()
        self._test_set = test_set
        self._task = task
        self._on_device: dict[torch.device, dict[str, torch.Tensor]] = {}
        self._results: dict[torch.device, EvalResult] = {}

    def of(self, model: nn.Module) -> EvalResult | None:
        """The initial model's result on `model`'s device if `model` holds exactly its parameters and buffers, else
        None."""
        device = model_device(model)
        initial = self._on_device.get(device)
        if initial is None:
            initial = self._on_device[device] = {k: v.to(device) for k, v in self._state.items()}
        state = model.state_dict()
        if state.keys() != initial.keys() or not all(torch.equal(state[k], initial[k]) for k in state):
            return None
        if device not in self._results:
            self._results[device] = self._task.evaluate(model, self._test_set)
        return self._results[device]


@dataclass
class Node:
    spec: JobSpec
    rank: int
    algorithm: Algorithm
    batches: BatchStream
    test_set: TrainingData | None  # None: the node is not evaluated (mathematics tests on synthetic problems)
    shard_size: int
    initial_evaluation: InitialEvaluation | None = None  # shared by the job's nodes, on the same test set

    @property
    def task(self) -> Task:
        return task_of(self.spec)

    def evaluate(self) -> EvalResult:
        if self.test_set is None:
            return EvalResult(math.nan, math.nan)
        if self.initial_evaluation is not None and self.algorithm.clock == 0:
            known = self.initial_evaluation.of(self.algorithm.model)
            if known is not None:
                return known
        return self.task.evaluate(self.algorithm.model, self.test_set)


@dataclass(frozen=True)
class JobData:
    """What every node of a job shares, read and computed once per job (`prepare`): the training and test sets
    (never modified: every node indexes the same tensors), each rank's shard of sample indices, the seeded initial
    model, which no node trains (each trains a copy: `node`), and its evaluation."""

    spec: JobSpec
    train: TrainingData
    test: TrainingData
    shards: list[np.ndarray]
    initial: nn.Module
    initial_evaluation: InitialEvaluation
    device: torch.device = CPU  # where every node of it computes: model, algorithm state, batches, evaluation

    @classmethod
    def prepare(cls, spec: JobSpec, data_dir: str | Path | None = None, allow_imports: Collection[str] = (),
                device: torch.device = CPU, max_model_bytes: int | None = None) -> JobData:
        """Loads the job's data and splits it, and builds its initial model (on the CPU, seeded: the same on every
        device). `data_dir` overrides the job's data directory on this machine; `allow_imports` are the modules a
        model may be imported from on it (nodeagent.training.models); `device` is where its nodes compute;
        `max_model_bytes` bounds the model with its optimizer state, checked before it is built (model_memory). Seeds
        torch's global generator as `initial_model` does, once: what the nodes draw next (dropout) is what a
        single node built alone would draw."""
        if spec.training.precision == "fp16" and device.type != "cuda":
            raise ValueError(f"training.precision fp16 needs a CUDA device; this node computes on {device}")
        directory = data_dir or spec.data.data_dir
        task = task_of(spec)
        train = task.load(spec, directory, "train")
        test = task.load(spec, directory, "test")
        shards = task.shards(spec, train)
        if max_model_bytes is not None:  # before the model takes any memory
            check_model_memory(spec, train.info.input_shape, train.info.num_classes, max_model_bytes, allow_imports)
        initial = initial_model(spec, train.info, allow_imports)
        return cls(spec, train, test, shards, initial, InitialEvaluation(initial, test, task), device)

    @cached_property
    def loss_fn(self) -> nn.Module:
        """The task's loss, one module for every node: it holds no state, and building one per node cost more than
        a small model's copy."""
        return task_of(self.spec).loss_fn()

    def node(self, rank: int, neighbors: tuple[Neighbor, ...], self_weight: float,
             peer_schedule: tuple[tuple[int, ...], ...] = ()) -> Node:
        """The node of `rank`: its own copy of the initial model (identical on every node), its shard, and its
        algorithm."""
        spec = self.spec
        context = NodeContext(
            rank=rank,
            world_size=spec.nodes,
            neighbors=neighbors,
            spec=spec.algorithm,
            self_weight=self_weight,
            seed=spec.seed,
            peer_schedule=peer_schedule,
            precision=spec.training.precision,
            steps=spec.steps,
        )
        algorithm = build_algorithm(copy_model(self.initial, self.device), context, self.loss_fn)
        shard = self.shards[rank]
        # Each node draws its own batch order, reproducibly (the same on every device).
        batches = BatchStream(self.train, shard, spec.data.batch_size, seed=spec.seed * 1_000_003 + rank,
                              device=self.device)
        return Node(spec, rank, algorithm, batches, self.test, len(shard), self.initial_evaluation)


def build_node(
    spec: JobSpec,
    rank: int,
    neighbors: tuple[Neighbor, ...],
    self_weight: float,
    data_dir: str | Path | None = None,
    peer_schedule: tuple[tuple[int, ...], ...] = (),
    allow_imports: Collection[str] = (),
    device: torch.device = CPU,
    max_model_bytes: int | None = None,
) -> Node:
    """The node of `rank` alone (an agent's), on `device`: the job's data prepared for it (`JobData.prepare`), then
    its node. Building many nodes of one job, prepare the JobData once and call its `node` for each."""
    return JobData.prepare(spec, data_dir, allow_imports, device, max_model_bytes).node(rank, neighbors, self_weight,
                                                                                      peer_schedule)
