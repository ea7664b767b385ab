from . import wire_pb2 as _wire_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LaneRequest(_message.Message):
    __slots__ = ("job_id", "requester_rank", "requester_id", "direct")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    REQUESTER_RANK_FIELD_NUMBER: _ClassVar[int]
    REQUESTER_ID_FIELD_NUMBER: _ClassVar[int]
    DIRECT_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    requester_rank: int
    requester_id: str
    direct: bool
    def __init__(self, job_id: _Optional[str] = ..., requester_rank: _Optional[int] = ..., requester_id: _Optional[str] = ..., direct: _Optional[bool] = ...) -> None: ...

class LaneGrant(_message.Message):
    __slots__ = ("port", "token", "key", "direct")
    PORT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    DIRECT_FIELD_NUMBER: _ClassVar[int]
    port: int
    token: bytes
    key: bytes
    direct: bool
    def __init__(self, port: _Optional[int] = ..., token: _Optional[bytes] = ..., key: _Optional[bytes] = ..., direct: _Optional[bool] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("job_id", "requester_rank", "requester_id", "kind", "lane_token")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    REQUESTER_RANK_FIELD_NUMBER: _ClassVar[int]
    REQUESTER_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    LANE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    requester_rank: int
    requester_id: str
    kind: _wire_pb2.MessageKind
    lane_token: bytes
    def __init__(self, job_id: _Optional[str] = ..., requester_rank: _Optional[int] = ..., requester_id: _Optional[str] = ..., kind: _Optional[_Union[_wire_pb2.MessageKind, str]] = ..., lane_token: _Optional[bytes] = ...) -> None: ...

class PushReply(_message.Message):
    __slots__ = ("bytes_received",)
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    bytes_received: int
    def __init__(self, bytes_received: _Optional[int] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodeDescription(_message.Message):
    __slots__ = ("node_id", "job_id", "rank", "algorithm", "clock", "loss", "neighbor_ranks", "served_tensors", "version")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    NEIGHBOR_RANKS_FIELD_NUMBER: _ClassVar[int]
    SERVED_TENSORS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    job_id: str
    rank: int
    algorithm: str
    clock: int
    loss: float
    neighbor_ranks: _containers.RepeatedScalarFieldContainer[int]
    served_tensors: _containers.RepeatedCompositeFieldContainer[_wire_pb2.TensorHeader]
    version: str
    def __init__(self, node_id: _Optional[str] = ..., job_id: _Optional[str] = ..., rank: _Optional[int] = ..., algorithm: _Optional[str] = ..., clock: _Optional[int] = ..., loss: _Optional[float] = ..., neighbor_ranks: _Optional[_Iterable[int]] = ..., served_tensors: _Optional[_Iterable[_Union[_wire_pb2.TensorHeader, _Mapping]]] = ..., version: _Optional[str] = ...) -> None: ...
