"""Receiving: a stream of frames checked and read into a message of tensors.

The receiver checks the manifest within fixed limits (`check_limits`), then against what it expects for the edge
and kind, before it allocates anything, writes the bytes straight into the destination buffers (one per expected
tensor, or one arena from a `BufferPool`), and only hands the tensors over once the End frame has confirmed the
stream is complete and every floating tensor is finite (checked as the bytes land where they can be: staging.py).
Any deviation raises `WireError`; nothing outside the decoder's own buffers has been touched at that point, so
callers reject the stream and keep their state.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Sequence
from concurrent import futures

import torch

from nodeagent._proto import wire_pb2
from nodeagent.wire.encodings import wire_dtype, wire_encoding, wire_length
from nodeagent.wire.errors import Reason, WireError
from nodeagent.wire.frames import DEFAULT_CHUNK_BYTES, LANE_HEADER, LANE_MAGIC, STREAM_ID_BYTES, frame_body
from nodeagent.wire.message import DTYPE_NAMES, DTYPES, Encoding, Kind, Message, TensorSpec, all_finite
from nodeagent.wire.pool import BufferPool, aligned
from nodeagent.wire.staging import DirectSink, Sink, StagedSink, byte_view
from nodeagent.wire.striping import overlaps, run_on_lanes

# The parts of a striped payload beyond the first are read by these threads (the first by the caller).
_LANE_READERS = futures.ThreadPoolExecutor(max_workers=32, thread_name_prefix="lane-reader")

Expectation = Callable[[wire_pb2.Manifest], Sequence[TensorSpec]]


class LaneReader:
    """The receiving end of a lane for one stream (lane.py implements it over a socket)."""

    def read_into(self, view: memoryview) -> None:
        """Fill `view` completely, or raise WireError."""
        raise NotImplementedError

    def abort(self) -> None:
        """Make a read in progress in another thread fail at once (the stream is rejected anyway)."""


LaneResolver = Callable[[wire_pb2.Lane, wire_pb2.Manifest], LaneReader]


# What a manifest is held to before anything is built from it or compared with what the receiver expects, so
# that walking it and the errors about it stay small. Its frame was parsed only once
# its size was checked (frames.MAX_CONTROL_FRAME_BYTES).
MAX_TENSORS = 4096  # the largest models peertrain runs have a few hundred parameter tensors
MAX_DIMS = 32  # of one tensor's shape
MAX_STRING_CHARS = 256  # a tensor's name and dtype, the job id, the sender's id


def check_limits(manifest: wire_pb2.Manifest) -> None:
    """Refuse a manifest beyond the limits above (reason "manifest_limit"), naming no unbounded field."""
    if len(manifest.tensors) > MAX_TENSORS:
        raise WireError(Reason.MANIFEST_LIMIT, f"a manifest of {len(manifest.tensors)} tensors, at most {MAX_TENSORS}")
    if max(len(manifest.job_id), len(manifest.sender_id)) > MAX_STRING_CHARS:
        raise WireError(Reason.MANIFEST_LIMIT, f"a job or sender id longer than {MAX_STRING_CHARS} characters")
    for index, header in enumerate(manifest.tensors):
        if max(len(header.name), len(header.dtype)) > MAX_STRING_CHARS:
            raise WireError(Reason.MANIFEST_LIMIT, f"tensor {index}: a name or dtype longer than {MAX_STRING_CHARS} "
                            "characters")
        if len(header.shape) > MAX_DIMS:
            raise WireError(Reason.MANIFEST_LIMIT,
                            f"tensor {index}: a shape of {len(header.shape)} dimensions, at most "
                            f"{MAX_DIMS}")


def check_manifest(manifest: wire_pb2.Manifest, expected: Sequence[TensorSpec], max_bytes: int) -> list[Encoding]:
    """Compare a manifest (within the limits of `check_limits`) with the tensors the receiver expects; returns each
    tensor's encoding."""
    if len(manifest.tensors) != len(expected):
        raise WireError(Reason.BAD_MANIFEST, f"expected {len(expected)} tensors, got {len(manifest.tensors)}")
    encodings = []
    total = 0
    for header, spec in zip(manifest.tensors, expected, strict=True):
        if header.name != spec.name:
            raise WireError(Reason.BAD_MANIFEST, f"expected tensor {spec.name!r}, got {header.name!r}")
        if DTYPES.get(header.dtype) != spec.dtype:
            raise WireError(
                Reason.BAD_MANIFEST,
                f"tensor {spec.name!r}: expected dtype {DTYPE_NAMES[spec.dtype]}, got {header.dtype!r}"
            )
        if tuple(header.shape) != spec.shape:
            raise WireError(
                Reason.BAD_MANIFEST,
                f"tensor {spec.name!r}: expected shape {list(spec.shape)}, got {list(header.shape)}"
            )
        # ENCODING_TOPK (3) and topk_count stay in the proto for compatibility; no sender uses them any more, so
        # encoding 3 is refused like any unknown encoding, and so is a non-zero topk_count.
        if header.encoding not in Encoding._value2member_map_:
            raise WireError(Reason.BAD_MANIFEST, f"tensor {spec.name!r}: unsupported encoding {header.encoding}")
        encoding = Encoding(header.encoding)
        if encoding != wire_encoding(spec.dtype, encoding):
            raise WireError(Reason.BAD_MANIFEST,
                            f"tensor {spec.name!r}: encoding {encoding.name} does not fit {spec.dtype}")
        if header.topk_count:
            raise WireError(
                Reason.BAD_MANIFEST,
                f"tensor {spec.name!r}: topk_count {header.topk_count} with encoding {encoding.name}"
            )
        length = wire_length(spec, encoding)
        if header.byte_length != length:
            raise WireError(
                Reason.BAD_MANIFEST, f"tensor {spec.name!r}: byte_length {header.byte_length}, expected {length}"
            )
        encodings.append(encoding)
        total += length
    if total > max_bytes:
        raise WireError(Reason.TOO_LARGE, f"stream of {total} bytes exceeds the limit of {max_bytes}")
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
        check_limits(manifest)
        # The kind is checked before `expect` sees the manifest, so expectations may rely on a valid kind.
        if manifest.kind not in Kind._value2member_map_:
            raise WireError(Reason.BAD_MANIFEST, f"unknown message kind {manifest.kind}")
        expected = list(self.expect(manifest))
        encodings = check_manifest(manifest, expected, self.max_bytes)
        self.manifest = manifest
        self.specs = expected
        self.destinations = self._allocate(expected)
        for spec, encoding, destination in zip(expected, encodings, self.destinations, strict=True):
            wire = wire_dtype(spec.dtype, encoding)
            if wire == spec.dtype and not destination.is_cuda:
                sink: Sink = DirectSink(byte_view(destination), spec.dtype, spec.name)
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
                raise WireError(Reason.NO_MANIFEST, "a stream must start with a manifest frame")
            assert isinstance(value, wire_pb2.Manifest)
            self._open(value)
            return
        if self.ended:
            raise WireError(Reason.AFTER_END, f"a {body or 'empty'} frame follows the end frame")
        if body == "chunk":
            self._chunk(memoryview(value))  # type: ignore[arg-type]
        elif body == "end":
            assert isinstance(value, wire_pb2.End)
            if value.total_bytes != self.total:
                raise WireError(Reason.BAD_END, f"end frame says {value.total_bytes} bytes, manifest {self.total}")
            if self.shares:
                self._read_lanes()
            if self.received != self.total:
                raise WireError(Reason.TRUNCATED, f"received {self.received} of {self.total} bytes")
            for sink in self.sinks:
                sink.finish()
            self.ended = True
        elif body == "lane":
            assert isinstance(value, wire_pb2.Lane)
            self._lane(value)
        elif body == "manifest":
            raise WireError(Reason.SECOND_MANIFEST, "a second manifest inside one stream")
        else:
            raise WireError(Reason.EMPTY_FRAME, "a frame with no body")

    def _chunk(self, data: memoryview) -> None:
        if self.shares:
            raise WireError(Reason.BAD_LANE, "chunk frames in a stream whose payload is on a lane")
        n = len(data)
        if self.received + n > self.total:
            raise WireError(Reason.TOO_LONG, f"more than the {self.total} bytes the manifest announced")
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
            raise WireError(Reason.BAD_LANE, "this receiver accepts no lanes here")
        assert self.manifest is not None
        # The lane is taken first, so that a stream refused below still gets its lane closed: the sender may
        # have written to it already.
        reader = self.lanes(lane, self.manifest)
        if self.received:
            raise WireError(Reason.BAD_LANE, "a lane frame after payload bytes in chunks")
        if any(reader is share[0] for share in self.shares):
            raise WireError(Reason.BAD_LANE, "one lane named twice in a stream")
        self.shares.append((reader, lane.offset, lane.total_bytes, lane.stream_id))
        if len(lane.stream_id) != STREAM_ID_BYTES:
            raise WireError(Reason.BAD_LANE, f"stream id of {len(lane.stream_id)} bytes, expected {STREAM_ID_BYTES}")
        if lane.stream_id != self.shares[0][3]:
            raise WireError(Reason.BAD_LANE, "the lanes of one stream name different stream ids")
        if lane.offset != self.laned_to or (lane.total_bytes == 0 and self.total) \
                or lane.total_bytes > self.total - self.laned_to:
            raise WireError(
                Reason.BAD_LANE, f"a lane with bytes [{lane.offset}, {lane.offset + lane.total_bytes}) after "
                f"[0, {self.laned_to}) of {self.total}: lanes must tile the payload in order"
            )
        self.laned_to += lane.total_bytes

    def _parts(self, start: int, stop: int) -> list[Sink]:
        """The sinks (or parts of them) that payload bytes [start, stop) go to."""
        parts = []
        for index, low, high in overlaps([sink.nbytes for sink in self.sinks], start, stop):
            sink = self.sinks[index]
            if (low, high) == (0, sink.nbytes):
                parts.append(sink)
            else:
                try:
                    parts.append(sink.part(low, high))
                except ValueError as error:
                    raise WireError(Reason.BAD_LANE, f"a lane boundary splits an element: {error}") from None
        return parts

    @staticmethod
    def _read_share(reader: LaneReader, length: int, stream_id: bytes, parts: list[Sink]) -> None:
        header = bytearray(LANE_HEADER.size)
        reader.read_into(memoryview(header))
        magic, header_id, header_length = LANE_HEADER.unpack(header)
        if magic != LANE_MAGIC or header_id != stream_id or header_length != length:
            raise WireError(Reason.BAD_LANE, "a lane's header does not match the stream")
        for part in parts:
            part.read_from(reader.read_into, part.nbytes)
            part.finish()

    def _read_lanes(self) -> None:
        """Read every lane's part of the payload, the lanes concurrently; on any failure all of them stop."""
        if self.laned_to != self.total:
            raise WireError(Reason.BAD_LANE, f"the lanes carry {self.laned_to} of the stream's {self.total} bytes")
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
            raise WireError(Reason.TRUNCATED, "empty stream")
        if not self.ended:
            raise WireError(
                Reason.TRUNCATED, f"stream ended without an end frame after {self.received} of {self.total} bytes"
            )
        manifest = self.manifest
        assert manifest is not None
        # One NaN or infinity mixed into a model spreads to every model of the job within a few exchanges. Lossy
        # encodings are checked as decoded: a float32 beyond float16's range arrives as an infinity.
        if not math.isfinite(manifest.weight):
            raise WireError(Reason.NON_FINITE, "the push-sum weight is not finite")
        for spec, destination, sink in zip(self.specs, self.destinations, self.sinks, strict=True):
            if not (isinstance(sink, DirectSink) and sink.checks_finite) and not all_finite(destination):
                raise WireError(Reason.NON_FINITE, f"tensor {spec.name!r} has non-finite values")
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
