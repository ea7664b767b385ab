"""Tensors on the wire: messages, the frame codec and its encodings."""

from nodeagent.wire.codec import DEFAULT_CHUNK_BYTES, WireError, decode, encode
from nodeagent.wire.message import DTYPES, Encoding, Kind, Message, TensorSpec, specs_of

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "DTYPES",
    "Encoding",
    "Kind",
    "Message",
    "TensorSpec",
    "WireError",
    "decode",
    "encode",
    "specs_of",
]
