"""Algorithms by name. Each is one module holding an I/O-free state machine (see base.py)."""

from __future__ import annotations

from torch import nn

from nodeagent.algorithms.adacomp import AdaComp
from nodeagent.algorithms.adpsgd import ADPSGD
from nodeagent.algorithms.allreduce import AllReduceSGD
from nodeagent.algorithms.asgd import ASGD
from nodeagent.algorithms.base import Algorithm, Neighbor, NodeContext, Route, Send, Snapshot
from nodeagent.algorithms.dcasgd import DCASGD
from nodeagent.algorithms.dsgd import DSGD
from nodeagent.algorithms.ecl import ADMMISVR, PDMMISVR
from nodeagent.algorithms.esync import ESync
from nodeagent.algorithms.gossip import PairwiseGossip
from nodeagent.algorithms.sgp import SGP, OverlapSGP
from nodeagent.algorithms.ssgd import SSGD

REGISTRY: dict[str, type[Algorithm]] = {
    cls.name: cls
    for cls in (
        DSGD, PDMMISVR, ADMMISVR, PairwiseGossip, SGP, OverlapSGP, ADPSGD, AllReduceSGD,
        SSGD, ASGD, DCASGD, AdaComp, ESync,
    )
}


def build_algorithm(model: nn.Module, context: NodeContext) -> Algorithm:
    try:
        cls = REGISTRY[context.spec.name]
    except KeyError:
        raise ValueError(
            f"algorithm.name: unknown algorithm {context.spec.name!r}; known: {', '.join(sorted(REGISTRY))}"
        ) from None
    return cls(model, context)


__all__ = ["REGISTRY", "Algorithm", "Neighbor", "NodeContext", "Route", "Send", "Snapshot", "build_algorithm"]
