"""Tensors on the wire: messages, the frame codec and its encodings."""

from nodeagent.wire.codec import DEFAULT_CHUNK_BYTES, Receiver, decode, encode, plan
from nodeagent.wire.errors import Status, WireError
from nodeagent.wire.message import DTYPES, Encoding, Kind, Message, TensorSpec, specs_of
from nodeagent.wire.pool import BufferPool

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "DTYPES",
    "BufferPool",
    "Encoding",
    "Kind",
    "Message",
    "Receiver",
    "Status",
    "TensorSpec",
    "WireError",
    "decode",
    "encode",
    "plan",
    "specs_of",
]
