"""The parameter-server family's mathematics (ALGORITHMS.md, "Parameter-server algorithms"): the servers'
update rules, AdaComp's selection and compact encoding, ESync's READY decision and aggregation. Pure,
deterministic and I/O-free: the coordinator and the simulator drive them with explicit inputs and a clock value.
"""

from nodeagent.ps.adacomp import (
    AdaCompServer,
    Codec,
    DeltaPull,
    Residual,
    Sparse,
    Traffic,
    compress,
    decode_sparse,
    densify,
    encode_sparse,
    flat_indices,
    select_topk,
    traffic,
)
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
    "Codec",
    "DCASGDServer",
    "Decision",
    "DeltaPull",
    "ESyncRound",
    "ESyncServer",
    "ParameterServer",
    "ProtocolError",
    "PushResult",
    "Residual",
    "RoundMetrics",
    "SSGDServer",
    "Sparse",
    "Traffic",
    "WorkerReport",
    "compress",
    "decode_sparse",
    "densify",
    "encode_sparse",
    "flat_indices",
    "is_ready",
    "select_topk",
    "steps_before_asking",
    "traffic",
]
