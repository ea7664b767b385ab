"""Tensors on the wire: messages and their errors (message.py, errors.py: no protobuf, no gRPC), frames
(frames.py), the encoder and decoder (encoder.py, decoder.py), striping over lanes (striping.py, lane.py), receive
buffers (pool.py), CUDA staging (staging.py) and AdaComp's sparse codec (sparse.py). The package exports only the
protobuf-free names, so importing it loads neither protobuf nor gRPC; the rest is imported from its module."""

from nodeagent.wire.errors import Reason, Status, WireError
from nodeagent.wire.message import DTYPES, Encoding, Kind, Message, TensorSpec, specs_of
from nodeagent.wire.pool import BufferPool

__all__ = [
    "DTYPES", "BufferPool", "Encoding", "Kind", "Message", "Reason", "Status", "TensorSpec", "WireError", "specs_of",
]
