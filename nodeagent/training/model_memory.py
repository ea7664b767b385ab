"""A bound on the memory a job's model takes on each node, checked before anything is allocated.

A spec of a few bytes may ask for a model of any size (`mlp` with `hidden: [100000, 100000]`): every agent would
allocate it, its gradients and its optimizer state, and the coordinator a copy per parameter-server job. The model is
built on torch's meta device first (shapes only, no memory), and its parameters, their gradients and the momentum
buffer (when training.momentum > 0) are counted against the bound: at `coordinator validate` and submit where the
dataset fixes the input shape and class count, and on each agent, which knows its data, before it builds the model.
What an algorithm keeps besides (neighbours' copies, a parameter server's state) is not counted: the bound is a
floor on the cost, meant to refuse the absurd, not to plan a device's memory.
"""

from __future__ import annotations

import logging
from collections.abc import Collection

import torch
from torch import nn

from nodeagent.jobspec import JobSpec, JobSpecError
from nodeagent.training.models import InputShape, build_model, is_import_path

log = logging.getLogger("nodeagent")

MIB = 1 << 20

class ModelTooLarge(JobSpecError):
    """A model whose parameters and optimizer state exceed the bound; the message gives both figures."""


def model_memory_bytes(model: nn.Module, spec: JobSpec) -> int:
    """What training `model` as `spec` says holds at least: its parameters, their gradients, the momentum buffer
    (training with momentum) and its buffers."""
    parameters = sum(p.numel() * p.element_size() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    copies = 2 + (spec.algorithm.momentum > 0)
    return parameters * copies + buffers


def check_model_memory(spec: JobSpec, input_shape: InputShape, num_classes: int, bound_bytes: int,
                       allow_imports: Collection[str] = (), where: str = "this node") -> int:
    """The bytes the job's model needs (model_memory_bytes), counted on the meta device; ModelTooLarge when they
    exceed `bound_bytes` (`where` names whose bound it is). 0 for an imported model that cannot be built there."""
    try:
        with torch.device("meta"):
            model = build_model(spec.model, input_shape, num_classes, allow_imports)
    except (NotImplementedError, RuntimeError) as error:
        if not is_import_path(spec.model.name):
            raise
        # A user's factory may do what shapes alone cannot (read a value, load weights): it is built as it is.
        log.warning("model %s cannot be counted on the meta device (%s): its memory is not bounded here",
                    spec.model.name, str(error).splitlines()[0] if str(error) else type(error).__name__)
        return 0
    return bound_model_memory(model, spec, bound_bytes, where)


def bound_model_memory(model: nn.Module, spec: JobSpec, bound_bytes: int, where: str) -> int:
    """The bytes training `model` (built anywhere, the meta device included) needs; ModelTooLarge when they exceed
    `bound_bytes` (`where` names whose bound it is)."""
    needed = model_memory_bytes(model, spec)
    if needed > bound_bytes:
        count = sum(p.numel() for p in model.parameters())
        momentum = " and algorithm.momentum's buffer" if spec.algorithm.momentum > 0 else ""
        raise ModelTooLarge(
            f"model: {spec.model.name} needs {needed / MIB:,.0f} MiB for {count:,} parameters (with gradients"
            f"{momentum}); {where} allows {bound_bytes / MIB:,.0f} MiB (--max-model-memory)")
    return needed
