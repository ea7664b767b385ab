"""Tensors on the wire: messages (message.py), frames (frames.py), the encoder and decoder, striping over lanes,
and AdaComp's sparse codec (sparse.py).

The names of the modules that need protobuf (the encoder, the decoder, frames) are imported on first use, so that
importing the protobuf-free modules (message, errors) loads neither protobuf nor gRPC.
"""

import importlib

from nodeagent.wire.errors import Status, WireError
from nodeagent.wire.message import DTYPES, Encoding, Kind, Message, TensorSpec, specs_of
from nodeagent.wire.pool import BufferPool

_LAZY = {
    "DEFAULT_CHUNK_BYTES": "nodeagent.wire.frames",
    "Receiver": "nodeagent.wire.decoder",
    "decode": "nodeagent.wire.decoder",
    "encode": "nodeagent.wire.encoder",
    "plan": "nodeagent.wire.encoder",
}


def __getattr__(name: str) -> object:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)


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
