from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Encoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ENCODING_RAW: _ClassVar[Encoding]
    ENCODING_FP16: _ClassVar[Encoding]
    ENCODING_BF16: _ClassVar[Encoding]
    ENCODING_TOPK: _ClassVar[Encoding]

class MessageKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KIND_UNSPECIFIED: _ClassVar[MessageKind]
    KIND_PARAMS: _ClassVar[MessageKind]
    KIND_DUAL: _ClassVar[MessageKind]
    KIND_PUSHSUM: _ClassVar[MessageKind]
    KIND_GRADIENT: _ClassVar[MessageKind]
    KIND_DELTA: _ClassVar[MessageKind]
ENCODING_RAW: Encoding
ENCODING_FP16: Encoding
ENCODING_BF16: Encoding
ENCODING_TOPK: Encoding
KIND_UNSPECIFIED: MessageKind
KIND_PARAMS: MessageKind
KIND_DUAL: MessageKind
KIND_PUSHSUM: MessageKind
KIND_GRADIENT: MessageKind
KIND_DELTA: MessageKind

class TensorHeader(_message.Message):
    __slots__ = ("name", "dtype", "shape", "encoding", "byte_length", "topk_count")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    BYTE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    TOPK_COUNT_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    encoding: Encoding
    byte_length: int
    topk_count: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., encoding: _Optional[_Union[Encoding, str]] = ..., byte_length: _Optional[int] = ..., topk_count: _Optional[int] = ...) -> None: ...

class Manifest(_message.Message):
    __slots__ = ("job_id", "sender_id", "sender_rank", "receiver_rank", "kind", "clock", "loss", "weight", "model_version", "tensors")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SENDER_ID_FIELD_NUMBER: _ClassVar[int]
    SENDER_RANK_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_RANK_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    sender_id: str
    sender_rank: int
    receiver_rank: int
    kind: MessageKind
    clock: int
    loss: float
    weight: float
    model_version: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorHeader]
    def __init__(self, job_id: _Optional[str] = ..., sender_id: _Optional[str] = ..., sender_rank: _Optional[int] = ..., receiver_rank: _Optional[int] = ..., kind: _Optional[_Union[MessageKind, str]] = ..., clock: _Optional[int] = ..., loss: _Optional[float] = ..., weight: _Optional[float] = ..., model_version: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorHeader, _Mapping]]] = ...) -> None: ...

class End(_message.Message):
    __slots__ = ("total_bytes",)
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    total_bytes: int
    def __init__(self, total_bytes: _Optional[int] = ...) -> None: ...

class Lane(_message.Message):
    __slots__ = ("token", "stream_id", "total_bytes", "offset")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    token: bytes
    stream_id: bytes
    total_bytes: int
    offset: int
    def __init__(self, token: _Optional[bytes] = ..., stream_id: _Optional[bytes] = ..., total_bytes: _Optional[int] = ..., offset: _Optional[int] = ...) -> None: ...

class Frame(_message.Message):
    __slots__ = ("manifest", "chunk", "end", "lane")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    LANE_FIELD_NUMBER: _ClassVar[int]
    manifest: Manifest
    chunk: bytes
    end: End
    lane: Lane
    def __init__(self, manifest: _Optional[_Union[Manifest, _Mapping]] = ..., chunk: _Optional[bytes] = ..., end: _Optional[_Union[End, _Mapping]] = ..., lane: _Optional[_Union[Lane, _Mapping]] = ...) -> None: ...

class Frames(_message.Message):
    __slots__ = ("frames",)
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    frames: _containers.RepeatedCompositeFieldContainer[Frame]
    def __init__(self, frames: _Optional[_Iterable[_Union[Frame, _Mapping]]] = ...) -> None: ...

class LaneCall(_message.Message):
    __slots__ = ("frames", "answer_wanted", "status", "details")
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    ANSWER_WANTED_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    frames: Frames
    answer_wanted: bool
    status: int
    details: str
    def __init__(self, frames: _Optional[_Union[Frames, _Mapping]] = ..., answer_wanted: _Optional[bool] = ..., status: _Optional[int] = ..., details: _Optional[str] = ...) -> None: ...
