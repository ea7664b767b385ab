"""The frame codec: messages of tensors to a stream of frames and back, the one place that does it.

A stream is a Manifest frame, chunk frames carrying the tensors' encoded bytes back to back in manifest order,
and an End frame; or, between peers that opened lanes, a Manifest frame, Lane frames (the same bytes then travel
on those lanes, each carrying a contiguous part, see lane.py) and an End frame. The receiver checks the manifest
against what it expects for the edge and kind before it allocates anything, writes the bytes straight into the
destination buffers (one per expected tensor, or one arena from a `BufferPool`), and only hands the tensors over
once the End frame has confirmed the stream is complete. Any deviation raises `WireError`; nothing outside the
decoder's own buffers has been touched at that point, so callers reject the stream and keep their state.

Frames are `wire_pb2.Frame` messages or their serialized bytes: the fast paths build chunk frames by hand (tag,
length, then the payload copied once from the tensor's memory) and read them back by slicing, so payload bytes
never pass through protobuf objects.
"""

from __future__ import annotations

import functools
import itertools
import os
import struct
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent import futures
from dataclasses import dataclass

import torch
from google.protobuf.message import DecodeError

from nodeagent._proto import wire_pb2
from nodeagent.wire.errors import WireError
from nodeagent.wire.message import DTYPE_NAMES, DTYPES, Encoding, Kind, Message, TensorSpec
from nodeagent.wire.pool import BufferPool, aligned
from nodeagent.wire.staging import DirectSink, Sink, Source, StagedSink, byte_view, source_for

# Chosen by benchmarks/wire.py (frames over gRPC: 1 MiB beat 256 KiB and 4 MiB; larger chunks also cost receiver
# memory). On a lane the chunk size is the staging granularity of conversions and GPU copies.
DEFAULT_CHUNK_BYTES = 1 << 20

# Wire dtypes of the lossy encodings; they apply to floating tensors only, others travel raw.
_ENCODED_DTYPES = {Encoding.FP16: torch.float16, Encoding.BF16: torch.bfloat16}

LANE_MAGIC = b"PTL1"
LANE_HEADER = struct.Struct("<4s12sQ8x")  # magic, stream id, bytes of the part; 32 bytes
STREAM_ID_BYTES = 12
SHARE_ALIGN = 64  # a payload split between lanes inside a tensor: at a multiple of this from the tensor's start

# The parts of a striped payload beyond the first are read by these threads (the first by the caller).
_LANE_READERS = futures.ThreadPoolExecutor(max_workers=32, thread_name_prefix="lane-reader")


def wire_encoding(dtype: torch.dtype, requested: Encoding) -> Encoding:
    """The encoding a tensor of `dtype` travels in when `requested` is asked for."""
    if requested in _ENCODED_DTYPES and dtype.is_floating_point and dtype != _ENCODED_DTYPES[requested]:
        return requested
    return Encoding.RAW


def wire_dtype(dtype: torch.dtype, encoding: Encoding) -> torch.dtype:
    return _ENCODED_DTYPES.get(encoding, dtype)


def wire_length(spec: TensorSpec, encoding: Encoding) -> int:
    return spec.numel * wire_dtype(spec.dtype, encoding).itemsize


# ------------------------------------------------------------------------------------------------ frames


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


_CHUNK_TAG = b"\x12"  # field 2 (chunk), wire type 2 (length-delimited)


def chunk_frame(piece: memoryview | bytes) -> bytes:
    """The serialized Frame{chunk: piece}, built with one copy of the payload."""
    return b"".join((_CHUNK_TAG, _varint(len(piece)), piece))


def serialize(frame: wire_pb2.Frame | bytes) -> bytes:
    """A frame as gRPC sends it: pre-serialized bytes pass through untouched."""
    return frame if isinstance(frame, bytes) else frame.SerializeToString()


def _read_varint(data: memoryview, pos: int) -> tuple[int, int] | None:
    value = 0
    shift = 0
    while pos < len(data) and shift < 64:
        byte = data[pos]
        value |= (byte & 0x7F) << shift
        pos += 1
        if not byte & 0x80:
            return value, pos
        shift += 7
    return None


def frame_body(frame: wire_pb2.Frame | bytes | bytearray | memoryview) -> tuple[str | None, object]:
    """(which body, its value) of a frame object or of serialized frame bytes. A chunk's value is a buffer.

    Serialized chunk frames (exactly one field 2) are sliced, not parsed, so the payload is not copied; any other
    bytes are parsed by protobuf with its full semantics.
    """
    if isinstance(frame, wire_pb2.Frame):
        body = frame.WhichOneof("body")
        return body, getattr(frame, body) if body else None
    data = memoryview(frame)
    if len(data) > 1 and data[0] == _CHUNK_TAG[0]:
        header = _read_varint(data, 1)
        if header is not None and header[0] + header[1] == len(data):
            return "chunk", data[header[1] :]
    try:
        parsed = wire_pb2.Frame.FromString(bytes(data))
    except DecodeError as error:
        raise WireError("bad_frame", f"a frame that does not parse: {error}") from None
    body = parsed.WhichOneof("body")
    return body, getattr(parsed, body) if body else None


# ---------------------------------------------------------------------------------------------- sending


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
        inside a tensor falls on a multiple of SHARE_ALIGN bytes from the tensor's start (a whole element of any
        wire dtype)."""
        if count <= 1 or self.total == 0:
            return [(0, self.total)]
        bounds = [0]
        starts = []
        offset = 0
        for source in self.sources:
            starts.append(offset)
            offset += source.nbytes
        for index in range(1, count):
            target = self.total * index // count
            start = max(s for s, source in zip(starts, self.sources, strict=True) if s <= target and source.nbytes)
            bound = start + (target - start) // SHARE_ALIGN * SHARE_ALIGN
            if bound > bounds[-1]:
                bounds.append(bound)
        if self.total > bounds[-1]:
            bounds.append(self.total)
        return list(itertools.pairwise(bounds))

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
        offset = 0
        for source in self.sources:
            low, high = max(start, offset), min(stop, offset + source.nbytes)
            if low < high:
                whole = (low, high) == (offset, offset + source.nbytes)
                yield from (source if whole else source.part(low - offset, high - offset)).pieces(None)
            offset += source.nbytes


def new_stream_id() -> bytes:
    return os.urandom(STREAM_ID_BYTES)


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
        loss=message.loss,
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


# -------------------------------------------------------------------------------------------- receiving

Expectation = Callable[[wire_pb2.Manifest], Sequence[TensorSpec]]


class LaneReader:
    """The receiving end of a lane for one stream (lane.py implements it over a socket)."""

    def read_into(self, view: memoryview) -> None:
        """Fill `view` completely, or raise WireError."""
        raise NotImplementedError

    def abort(self) -> None:
        """Make a read in progress in another thread fail at once (the stream is rejected anyway)."""


LaneResolver = Callable[[wire_pb2.Lane, wire_pb2.Manifest], LaneReader]


def run_on_lanes(tasks: Sequence[Callable[[], None]], lanes: Sequence[LaneReader], pool: futures.Executor) -> None:
    """Run one task per lane at once, the first in this thread and the others in `pool`. When one fails, every
    lane is aborted (the others stop waiting on their sockets), all tasks are waited for, and the first WireError
    is raised, else the first error."""
    pending = [pool.submit(task) for task in tasks[1:]]
    errors: list[BaseException] = []
    try:
        tasks[0]()
    except BaseException as error:
        errors.append(error)
    for future in pending:
        if errors:
            for lane in lanes:
                lane.abort()
        try:
            future.result()
        except BaseException as error:
            errors.append(error)
    if errors:
        for lane in lanes:
            lane.abort()
        raise next((e for e in errors if isinstance(e, WireError)), errors[0])


def check_manifest(manifest: wire_pb2.Manifest, expected: Sequence[TensorSpec], max_bytes: int) -> list[Encoding]:
    """Compare a manifest with the tensors the receiver expects; returns each tensor's encoding."""
    if len(manifest.tensors) != len(expected):
        names = [h.name for h in manifest.tensors]
        raise WireError("bad_manifest", f"expected {len(expected)} tensors {[s.name for s in expected]}, got {names}")
    encodings = []
    total = 0
    for header, spec in zip(manifest.tensors, expected, strict=True):
        if header.name != spec.name:
            raise WireError("bad_manifest", f"expected tensor {spec.name!r}, got {header.name!r}")
        if DTYPES.get(header.dtype) != spec.dtype:
            raise WireError(
                "bad_manifest", f"tensor {spec.name!r}: expected dtype {DTYPE_NAMES[spec.dtype]}, got {header.dtype!r}"
            )
        if tuple(header.shape) != spec.shape:
            raise WireError(
                "bad_manifest", f"tensor {spec.name!r}: expected shape {list(spec.shape)}, got {list(header.shape)}"
            )
        # ENCODING_TOPK (3) and topk_count stay in the proto for compatibility; no sender uses them any more, so
        # encoding 3 is refused like any unknown encoding, and so is a non-zero topk_count.
        if header.encoding not in Encoding._value2member_map_:
            raise WireError("bad_manifest", f"tensor {spec.name!r}: unsupported encoding {header.encoding}")
        encoding = Encoding(header.encoding)
        if encoding != wire_encoding(spec.dtype, encoding):
            raise WireError("bad_manifest", f"tensor {spec.name!r}: encoding {encoding.name} does not fit {spec.dtype}")
        if header.topk_count:
            raise WireError(
                "bad_manifest", f"tensor {spec.name!r}: topk_count {header.topk_count} with encoding {encoding.name}"
            )
        length = wire_length(spec, encoding)
        if header.byte_length != length:
            raise WireError(
                "bad_manifest", f"tensor {spec.name!r}: byte_length {header.byte_length}, expected {length}"
            )
        encodings.append(encoding)
        total += length
    if total > max_bytes:
        raise WireError("too_large", f"stream of {total} bytes exceeds the limit of {max_bytes}")
    return encodings


class Receiver:
    """Decodes one stream fed frame by frame; `result()` hands the message over once the stream is complete.

    `pool` supplies reusable CPU buffers (see pool.py); `device` is where tensors are delivered (CUDA destinations
    are filled through pinned staging buffers); `lanes` resolves a Lane frame to the lane its payload travels on
    (None: lanes are refused).
    """

    def __init__(
        self,
        expect: Expectation,
        max_bytes: int = 1 << 30,
        *,
        pool: BufferPool | None = None,
        device: torch.device | str | None = None,
        lanes: LaneResolver | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ):
        self.expect = expect
        self.max_bytes = max_bytes
        self.pool = pool
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.lanes = lanes
        self.chunk_bytes = chunk_bytes
        self.manifest: wire_pb2.Manifest | None = None
        self.specs: list[TensorSpec] = []
        self.destinations: list[torch.Tensor] = []  # 1-D, one per expected tensor
        self.sinks: list[Sink] = []
        self.index = 0
        self.total = 0
        self.received = 0
        self.ended = False
        self.shares: list[tuple[LaneReader, int, int, bytes]] = []  # (lane, offset, length, stream id)
        self.laned_to = 0  # the payload bytes the lane frames so far cover
        self.frames = 0

    # -- the manifest ----------------------------------------------------------------------------------------

    def _open(self, manifest: wire_pb2.Manifest) -> None:
        # The kind is checked before `expect` sees the manifest, so expectations may rely on a valid kind.
        if manifest.kind not in Kind._value2member_map_:
            raise WireError("bad_manifest", f"unknown message kind {manifest.kind}")
        expected = list(self.expect(manifest))
        encodings = check_manifest(manifest, expected, self.max_bytes)
        self.manifest = manifest
        self.specs = expected
        self.destinations = self._allocate(expected)
        for spec, encoding, destination in zip(expected, encodings, self.destinations, strict=True):
            wire = wire_dtype(spec.dtype, encoding)
            if wire == spec.dtype and not destination.is_cuda:
                sink: Sink = DirectSink(byte_view(destination))
            else:
                sink = StagedSink(destination, wire, self.chunk_bytes)
            self.sinks.append(sink)
        self.total = sum(sink.nbytes for sink in self.sinks)

    def _allocate(self, specs: list[TensorSpec]) -> list[torch.Tensor]:
        """1-D destinations of the specs: one pooled arena for all on the CPU when there is a pool."""
        if self.device.type != "cpu" or self.pool is None:
            return [torch.empty(spec.numel, dtype=spec.dtype, device=self.device) for spec in specs]
        offsets = []
        end = 0
        for spec in specs:
            offsets.append(aligned(end))
            end = offsets[-1] + spec.numel * spec.dtype.itemsize
        arena = self.pool.take(end)
        return [
            torch.from_numpy(arena[offset : offset + spec.numel * spec.dtype.itemsize]).view(spec.dtype)
            for spec, offset in zip(specs, offsets, strict=True)
        ]

    # -- frames ------------------------------------------------------------------------------------------------

    def feed(self, frame: wire_pb2.Frame | bytes) -> None:
        body, value = frame_body(frame)
        self.frames += 1
        if self.frames == 1:
            if body != "manifest":
                raise WireError("no_manifest", "a stream must start with a manifest frame")
            assert isinstance(value, wire_pb2.Manifest)
            self._open(value)
            return
        if self.ended:
            raise WireError("after_end", f"a {body or 'empty'} frame follows the end frame")
        if body == "chunk":
            self._chunk(memoryview(value))  # type: ignore[arg-type]
        elif body == "end":
            assert isinstance(value, wire_pb2.End)
            if value.total_bytes != self.total:
                raise WireError("bad_end", f"end frame says {value.total_bytes} bytes, manifest {self.total}")
            if self.shares:
                self._read_lanes()
            if self.received != self.total:
                raise WireError("truncated", f"received {self.received} of {self.total} bytes")
            for sink in self.sinks:
                sink.finish()
            self.ended = True
        elif body == "lane":
            assert isinstance(value, wire_pb2.Lane)
            self._lane(value)
        elif body == "manifest":
            raise WireError("second_manifest", "a second manifest inside one stream")
        else:
            raise WireError("empty_frame", "a frame with no body")

    def _chunk(self, data: memoryview) -> None:
        if self.shares:
            raise WireError("bad_lane", "chunk frames in a stream whose payload is on a lane")
        n = len(data)
        if self.received + n > self.total:
            raise WireError("too_long", f"more than the {self.total} bytes the manifest announced")
        offset = 0
        while offset < n:
            while self.sinks[self.index].remaining == 0:
                self.index += 1
            sink = self.sinks[self.index]
            take = min(sink.remaining, n - offset)
            sink.write(data[offset : offset + take])
            offset += take
        self.received += n

    def _lane(self, lane: wire_pb2.Lane) -> None:
        if self.lanes is None:
            raise WireError("bad_lane", "this receiver accepts no lanes here")
        assert self.manifest is not None
        # The lane is taken first, so that a stream refused below still gets its lane closed: the sender may
        # have written to it already.
        reader = self.lanes(lane, self.manifest)
        if self.received:
            raise WireError("bad_lane", "a lane frame after payload bytes in chunks")
        if any(reader is share[0] for share in self.shares):
            raise WireError("bad_lane", "one lane named twice in a stream")
        self.shares.append((reader, lane.offset, lane.total_bytes, lane.stream_id))
        if len(lane.stream_id) != STREAM_ID_BYTES:
            raise WireError("bad_lane", f"stream id of {len(lane.stream_id)} bytes, expected {STREAM_ID_BYTES}")
        if lane.stream_id != self.shares[0][3]:
            raise WireError("bad_lane", "the lanes of one stream name different stream ids")
        if lane.offset != self.laned_to or (lane.total_bytes == 0 and self.total) \
                or lane.total_bytes > self.total - self.laned_to:
            raise WireError(
                "bad_lane", f"a lane with bytes [{lane.offset}, {lane.offset + lane.total_bytes}) after "
                f"[0, {self.laned_to}) of {self.total}: lanes must tile the payload in order"
            )
        self.laned_to += lane.total_bytes

    def _parts(self, start: int, stop: int) -> list[Sink]:
        """The sinks (or parts of them) that payload bytes [start, stop) go to."""
        parts = []
        offset = 0
        for sink in self.sinks:
            low, high = max(start, offset), min(stop, offset + sink.nbytes)
            if low < high:
                if (low, high) == (offset, offset + sink.nbytes):
                    parts.append(sink)
                else:
                    try:
                        parts.append(sink.part(low - offset, high - offset))
                    except ValueError as error:
                        raise WireError("bad_lane", f"a lane boundary splits an element: {error}") from None
            offset += sink.nbytes
        return parts

    @staticmethod
    def _read_share(reader: LaneReader, length: int, stream_id: bytes, parts: list[Sink]) -> None:
        header = bytearray(LANE_HEADER.size)
        reader.read_into(memoryview(header))
        magic, header_id, header_length = LANE_HEADER.unpack(header)
        if magic != LANE_MAGIC or header_id != stream_id or header_length != length:
            raise WireError("bad_lane", "a lane's header does not match the stream")
        for part in parts:
            part.read_from(reader.read_into, part.nbytes)
            part.finish()

    def _read_lanes(self) -> None:
        """Read every lane's part of the payload, the lanes concurrently; on any failure all of them stop."""
        if self.laned_to != self.total:
            raise WireError("bad_lane", f"the lanes carry {self.laned_to} of the stream's {self.total} bytes")
        jobs = [
            (reader, length, stream_id, self._parts(offset, offset + length))
            for reader, offset, length, stream_id in self.shares
        ]
        run_on_lanes([functools.partial(self._read_share, *job) for job in jobs],
                     [reader for reader, *_ in self.shares], _LANE_READERS)
        for sink in self.sinks:
            sink.filled = sink.nbytes
        self.received = self.total

    def result(self) -> Message:
        if self.frames == 0:
            raise WireError("truncated", "empty stream")
        if not self.ended:
            raise WireError(
                "truncated", f"stream ended without an end frame after {self.received} of {self.total} bytes"
            )
        manifest = self.manifest
        assert manifest is not None
        tensors = {
            spec.name: destination.view(spec.shape)
            for spec, destination in zip(self.specs, self.destinations, strict=True)
        }
        return Message(
            kind=Kind(manifest.kind),
            sender=manifest.sender_rank,
            receiver=manifest.receiver_rank,
            tensors=tensors,
            clock=manifest.clock,
            loss=manifest.loss,
            weight=manifest.weight,
            model_version=manifest.model_version,
        )


def decode(
    frames: Iterable[wire_pb2.Frame | bytes],
    expect: Expectation,
    max_bytes: int = 1 << 30,
    *,
    pool: BufferPool | None = None,
    device: torch.device | str | None = None,
    lanes: LaneResolver | None = None,
) -> Message:
    """Read one whole stream (the iterator must end right after the End frame) into a Message.

    `expect(manifest)` returns the tensors the receiver accepts for that manifest's edge and kind, or raises
    WireError (for example when the sender is not a neighbour). Frames may be Frame messages or serialized bytes.
    See Receiver for the keyword arguments.
    """
    receiver = Receiver(expect, max_bytes, pool=pool, device=device, lanes=lanes)
    for frame in frames:
        receiver.feed(frame)
    return receiver.result()


def stream_bytes(frames: Iterable[wire_pb2.Frame]) -> Iterator[tuple[wire_pb2.Frame, int]]:
    """Pass frames through, paired with the payload bytes each carries (for traffic accounting)."""
    for frame in frames:
        yield frame, len(frame.chunk) if frame.WhichOneof("body") == "chunk" else 0
