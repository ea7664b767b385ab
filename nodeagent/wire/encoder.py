"""Sending: a message of tensors planned as a stream of frames.

A stream is a Manifest frame, chunk frames carrying the tensors' encoded bytes back to back in manifest order,
and an End frame; or, between peers that opened lanes, a Manifest frame, Lane frames (the same bytes then travel
on those lanes, each carrying a contiguous part, see lane.py) and an End frame. Nothing is read from a tensor
until its bytes are asked for: a chunk is converted, or copied off the GPU, when its frame is built.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from nodeagent._proto import wire_pb2
from nodeagent.wire.encodings import wire_dtype, wire_encoding, wire_length
from nodeagent.wire.frames import DEFAULT_CHUNK_BYTES, LANE_HEADER, LANE_MAGIC, chunk_frame
from nodeagent.wire.message import DTYPE_NAMES, Encoding, Message, TensorSpec
from nodeagent.wire.staging import Source, source_for
from nodeagent.wire.striping import overlaps, split


@dataclass
class Outgoing:
    """One message planned for the wire: its manifest, and the tensors' wire bytes produced on demand."""

    manifest: wire_pb2.Manifest
    sources: list[Source]
    total: int
    chunk_bytes: int

    def manifest_frame(self) -> wire_pb2.Frame:
        return wire_pb2.Frame(manifest=self.manifest)

    def end_frame(self) -> wire_pb2.Frame:
        return wire_pb2.Frame(end=wire_pb2.End(total_bytes=self.total))

    def pieces(self, limit: int | None) -> Iterator[memoryview]:
        """The payload in order, each piece at most `limit` bytes (None: as large as the staging allows) and
        valid only until the next one is asked for."""
        for source in self.sources:
            yield from source.pieces(limit)

    def frames(self) -> Iterator[wire_pb2.Frame]:
        yield self.manifest_frame()
        for piece in self.pieces(self.chunk_bytes):
            yield wire_pb2.Frame(chunk=bytes(piece))
        yield self.end_frame()

    def serialized_frames(self) -> Iterator[bytes]:
        """The same stream as serialized frames, each chunk frame built with one copy of its payload."""
        yield self.manifest_frame().SerializeToString()
        for piece in self.pieces(self.chunk_bytes):
            yield chunk_frame(piece)
        yield self.end_frame().SerializeToString()

    def shares(self, count: int) -> list[tuple[int, int]]:
        """The payload split into at most `count` contiguous parts of about equal size, one per lane; a boundary
        inside a tensor falls on a whole element of its wire dtype (striping.split)."""
        return split([source.nbytes for source in self.sources], count)

    def lane_frames(self, tokens: Sequence[bytes], stream_id: bytes,
                    shares: Sequence[tuple[int, int]]) -> list[wire_pb2.Frame]:
        """Manifest, Lane frames (one per share, on the lane of the same index) and End frame of a stream whose
        payload travels on lanes."""
        lanes = [
            wire_pb2.Frame(lane=wire_pb2.Lane(token=token, stream_id=stream_id, total_bytes=stop - start,
                                              offset=start))
            for token, (start, stop) in zip(tokens, shares, strict=True)
        ]
        return [self.manifest_frame(), *lanes, self.end_frame()]

    def lane_pieces(self, stream_id: bytes, start: int = 0, stop: int | None = None) -> Iterator[memoryview | bytes]:
        """What goes on the lane that carries payload bytes [start, stop): the header, then those bytes."""
        stop = self.total if stop is None else stop
        yield LANE_HEADER.pack(LANE_MAGIC, stream_id, stop - start)
        for index, low, high in overlaps([source.nbytes for source in self.sources], start, stop):
            source = self.sources[index]
            whole = (low, high) == (0, source.nbytes)
            yield from (source if whole else source.part(low, high)).pieces(None)


def plan(
    message: Message,
    *,
    job_id: str = "",
    sender_id: str = "",
    encoding: Encoding = Encoding.RAW,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> Outgoing:
    """Check a message and plan its stream. Nothing is copied yet."""
    if chunk_bytes < 1:
        raise ValueError("chunk_bytes must be positive")
    headers = []
    sources: list[Source] = []
    total = 0
    for name, value in message.tensors.items():
        if value.dtype not in DTYPE_NAMES:
            raise ValueError(f"tensor {name!r}: dtype {value.dtype} cannot travel")
        tensor_encoding = wire_encoding(value.dtype, encoding)
        source = source_for(value, wire_dtype(value.dtype, tensor_encoding), chunk_bytes)
        length = wire_length(TensorSpec.of(name, value), tensor_encoding)
        headers.append(
            wire_pb2.TensorHeader(
                name=name,
                dtype=DTYPE_NAMES[value.dtype],
                shape=list(value.shape),
                encoding=int(tensor_encoding),
                byte_length=length,
            )
        )
        sources.append(source)
        total += length
    manifest = wire_pb2.Manifest(
        job_id=job_id,
        sender_id=sender_id,
        sender_rank=message.sender,
        receiver_rank=message.receiver,
        kind=int(message.kind),
        clock=message.clock,
        loss=float(message.loss),
        weight=message.weight,
        model_version=message.model_version,
        tensors=headers,
    )
    return Outgoing(manifest, sources, total, chunk_bytes)


def encode(
    message: Message,
    *,
    job_id: str = "",
    sender_id: str = "",
    encoding: Encoding = Encoding.RAW,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> Iterator[wire_pb2.Frame]:
    """Frames of one message: manifest, chunks (at most `chunk_bytes` each), end. Lazy: a chunk is read from the
    tensor (converted, or copied off the GPU) only when its frame is asked for."""
    outgoing = plan(message, job_id=job_id, sender_id=sender_id, encoding=encoding, chunk_bytes=chunk_bytes)
    yield from outgoing.frames()
