"""Frames as bytes: chunk frames built and read by hand, the lane header, and the count of a stream's payload.

Frames are `wire_pb2.Frame` messages or their serialized bytes: the fast paths build chunk frames by hand (tag,
length, then the payload copied once from the tensor's memory) and read them back by slicing, so payload bytes
never pass through protobuf objects.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

from google.protobuf.message import DecodeError

from nodeagent._proto import wire_pb2
from nodeagent.wire.errors import Reason, WireError
from nodeagent.wire.varint import decode_varint, encode_varint

# Chosen by benchmarks/wire.py (frames over gRPC: 1 MiB beat 256 KiB and 4 MiB; larger chunks also cost receiver
# memory). On a lane the chunk size is the staging granularity of conversions and GPU copies.
DEFAULT_CHUNK_BYTES = 1 << 20

# A frame other than a chunk (a manifest, a lane, an end) is refused above this size before protobuf parses it:
# parsed, a manifest costs several times its size, and an honest one (a few hundred tensors) takes tens of KiB.
MAX_CONTROL_FRAME_BYTES = 1 << 20

LANE_MAGIC = b"PTL1"
LANE_HEADER = struct.Struct("<4s12sQ8x")  # magic, stream id, bytes of the part; 32 bytes
STREAM_ID_BYTES = 12

_CHUNK_TAG = b"\x12"  # field 2 (chunk), wire type 2 (length-delimited)

FrameOrBytes = TypeVar("FrameOrBytes", wire_pb2.Frame, bytes)


def chunk_frame(piece: memoryview | bytes) -> bytes:
    """The serialized Frame{chunk: piece}, built with one copy of the payload."""
    return b"".join((_CHUNK_TAG, encode_varint(len(piece)), piece))


def serialize(frame: wire_pb2.Frame | bytes) -> bytes:
    """A frame as gRPC sends it: pre-serialized bytes pass through untouched."""
    return frame if isinstance(frame, bytes) else frame.SerializeToString()


def _chunk_payload(data: memoryview) -> memoryview | None:
    """The payload of a serialized chunk frame (exactly one field 2), sliced; None for any other bytes."""
    if len(data) > 1 and data[0] == _CHUNK_TAG[0]:
        header = decode_varint(data, 1)
        if header is not None and header[0] + header[1] == len(data):
            return data[header[1] :]
    return None


def frame_body(frame: wire_pb2.Frame | bytes | bytearray | memoryview) -> tuple[str | None, object]:
    """(which body, its value) of a frame object or of serialized frame bytes. A chunk's value is a buffer.

    Serialized chunk frames (exactly one field 2) are sliced, not parsed, so the payload is not copied; any other
    bytes are parsed by protobuf with its full semantics, up to MAX_CONTROL_FRAME_BYTES.
    """
    if isinstance(frame, wire_pb2.Frame):
        body = frame.WhichOneof("body")
        return body, getattr(frame, body) if body else None
    data = memoryview(frame)
    payload = _chunk_payload(data)
    if payload is not None:
        return "chunk", payload
    if len(data) > MAX_CONTROL_FRAME_BYTES:
        raise WireError(Reason.TOO_LARGE, f"a frame of {len(data)} bytes that is not a chunk, at most "
                        f"{MAX_CONTROL_FRAME_BYTES}")
    try:
        parsed = wire_pb2.Frame.FromString(bytes(data))
    except DecodeError as error:
        raise WireError(Reason.BAD_FRAME, f"a frame that does not parse: {error}") from None
    body = parsed.WhichOneof("body")
    return body, getattr(parsed, body) if body else None


def counted(frames: Iterable[FrameOrBytes], count: Callable[[int], None]) -> Iterator[FrameOrBytes]:
    """Pass frames (Frame messages or serialized frames) through, reporting the payload bytes of each chunk as it
    goes by (for traffic accounting)."""
    for frame in frames:
        if isinstance(frame, wire_pb2.Frame):
            if frame.WhichOneof("body") == "chunk":
                count(len(frame.chunk))
        else:
            payload = _chunk_payload(memoryview(frame))
            if payload is not None:
                count(len(payload))
        yield frame


def new_stream_id() -> bytes:
    return os.urandom(STREAM_ID_BYTES)
