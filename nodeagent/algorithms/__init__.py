"""Algorithms by name: the registry, the one list of them.

Each algorithm is one module of this package holding an I/O-free state machine (see base.py) with typed options
and a `check()`; every module here is imported and every concrete Algorithm subclass in it registered under its
`name`, so adding an algorithm is adding its module (and its tests).
"""

from __future__ import annotations

import importlib
import pkgutil

from torch import nn

from nodeagent.algorithms.base import Algorithm, Family, Neighbor, NodeContext, Route, Send, Snapshot
from nodeagent.jobspec import JobSpec, JobSpecError
from nodeagent.ps.server import ServerHalf
from nodeagent.ps.worker import PSWorker
from nodeagent.training.data import DatasetInfo


def _algorithms(cls: type[Algorithm]) -> list[type[Algorithm]]:
    """The registrable subclasses of `cls`, depth first: those that set their own name."""
    found = []
    for sub in cls.__subclasses__():
        if "name" in vars(sub):
            found.append(sub)
        found.extend(_algorithms(sub))
    return found


for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

REGISTRY: dict[str, type[Algorithm]] = {cls.name: cls for cls in _algorithms(Algorithm)}
SERVER_ALGORITHMS: dict[str, type[PSWorker]] = {
    name: cls for name, cls in REGISTRY.items() if issubclass(cls, PSWorker)
}


def lookup(name: str) -> type[Algorithm]:
    """The algorithm called `name`; JobSpecError naming the field otherwise."""
    try:
        return REGISTRY[name]
    except KeyError:
        known = ", ".join(sorted(REGISTRY))
        raise JobSpecError(f"algorithm.name: unknown algorithm {name!r}; known: {known}") from None


def build_algorithm(model: nn.Module, context: NodeContext, loss_fn: nn.Module | None = None) -> Algorithm:
    """The node's algorithm over `model`, minimising `loss_fn` (its task's; default: cross-entropy over labels)."""
    return lookup(context.spec.name)(model, context, loss_fn)


def build_server(spec: JobSpec, info: DatasetInfo) -> ServerHalf:
    """The parameter server of a job of the server family (what the coordinator and the simulator host), its model
    shaped for the data `info` describes (the job's data, as its workers described it)."""
    cls = SERVER_ALGORITHMS.get(spec.algorithm.name)
    if cls is None:
        raise JobSpecError(f"algorithm.name: {spec.algorithm.name} has no parameter server")
    return cls.build_server(spec, info)


__all__ = [
    "REGISTRY", "Algorithm", "Family", "Neighbor", "NodeContext", "Route", "Send", "Snapshot", "build_algorithm",
    "build_server", "lookup",
]
