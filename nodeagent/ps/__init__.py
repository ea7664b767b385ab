"""The parameter-server family's mathematics (ALGORITHMS.md, "Parameter-server algorithms"): the servers'
update rules, ESync's READY decision and aggregation. Pure, deterministic and I/O-free: the coordinator and the
simulator drive them with explicit inputs and a clock value. AdaComp's worker side and compact encoding are
nodeagent.wire.sparse.
"""

from nodeagent.ps.adacomp import AdaCompServer, DeltaPull
from nodeagent.ps.esync import (
    Decision,
    ESyncRound,
    ESyncServer,
    RoundMetrics,
    WorkerReport,
    is_ready,
    steps_before_asking,
)
from nodeagent.ps.rules import ASGDServer, DCASGDServer, ParameterServer, ProtocolError, PushResult, SSGDServer

__all__ = [
    "ASGDServer",
    "AdaCompServer",
    "DCASGDServer",
    "Decision",
    "DeltaPull",
    "ESyncRound",
    "ESyncServer",
    "ParameterServer",
    "ProtocolError",
    "PushResult",
    "RoundMetrics",
    "SSGDServer",
    "WorkerReport",
    "is_ready",
    "steps_before_asking",
]
