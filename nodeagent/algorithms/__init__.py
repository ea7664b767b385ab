"""Algorithms by name: the registry, the one list of them. Each is one module holding an I/O-free state machine
(see base.py) with typed options and a `check()`; adding one is adding its module here."""

from __future__ import annotations

from torch import nn

from nodeagent.algorithms.adacomp import AdaComp
from nodeagent.algorithms.adpsgd import ADPSGD
from nodeagent.algorithms.allreduce import AllReduceSGD
from nodeagent.algorithms.asgd import ASGD
from nodeagent.algorithms.base import Algorithm, Family, Neighbor, NodeContext, Route, Send, Snapshot
from nodeagent.algorithms.dcasgd import DCASGD
from nodeagent.algorithms.dsgd import DSGD
from nodeagent.algorithms.ecl import ADMMISVR, PDMMISVR
from nodeagent.algorithms.esync import ESync
from nodeagent.algorithms.gossip import PairwiseGossip
from nodeagent.algorithms.sgp import SGP, OverlapSGP
from nodeagent.algorithms.ssgd import SSGD
from nodeagent.jobspec import JobSpec, JobSpecError
from nodeagent.ps.server import ServerHalf
from nodeagent.ps.worker import PSWorker

REGISTRY: dict[str, type[Algorithm]] = {
    cls.name: cls
    for cls in (
        DSGD, PDMMISVR, ADMMISVR, PairwiseGossip, SGP, OverlapSGP, ADPSGD, AllReduceSGD,
        SSGD, ASGD, DCASGD, AdaComp, ESync,
    )
}
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


def build_algorithm(model: nn.Module, context: NodeContext) -> Algorithm:
    return lookup(context.spec.name)(model, context)


def build_server(spec: JobSpec) -> ServerHalf:
    """The parameter server of a job of the server family (what the coordinator and the simulator host)."""
    cls = SERVER_ALGORITHMS.get(spec.algorithm.name)
    if cls is None:
        raise JobSpecError(f"algorithm.name: {spec.algorithm.name} has no parameter server")
    return cls.build_server(spec)


__all__ = [
    "REGISTRY", "Algorithm", "Family", "Neighbor", "NodeContext", "Route", "Send", "Snapshot", "build_algorithm",
    "build_server", "lookup",
]
