"""The parameter-server family, in one package:
- the mathematics, pure and I/O-free: the servers' update rules (rules.py), AdaComp's staleness-aware server
  (adacomp.py; its worker side and compact encoding are nodeagent.wire.sparse), ESync's READY decision and
  aggregation (esync.py); the coordinator and the simulator drive them with explicit inputs and a clock value;
- what a worker and its server say to each other (messages.py) and how a worker reaches it (link.py: one
  ServerLink interface, with a gRPC and a simulated implementation in nodeagent.runtime);
- the two halves every algorithm of the family binds: the server half (server.py) and the worker (worker.py).
The package exports the mathematics; the rest is imported from its module.
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
from nodeagent.ps.rules import (
    ASGDServer,
    DCASGDServer,
    OuterServer,
    ParameterServer,
    ProtocolError,
    PushResult,
    SSGDServer,
)

__all__ = [
    "ASGDServer",
    "AdaCompServer",
    "DCASGDServer",
    "Decision",
    "DeltaPull",
    "ESyncRound",
    "ESyncServer",
    "OuterServer",
    "ParameterServer",
    "ProtocolError",
    "PushResult",
    "RoundMetrics",
    "SSGDServer",
    "WorkerReport",
    "is_ready",
    "steps_before_asking",
]
