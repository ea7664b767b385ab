"""The frame codec: messages of tensors to a stream of frames and back, the one place that does it.

A stream is a Manifest frame, chunk frames carrying the tensors' encoded bytes back to back in manifest order,
and an End frame. The receiver checks the manifest against what it expects for the edge and kind before it
allocates anything, writes chunks straight into preallocated buffers, and only hands the tensors over once the
End frame has confirmed the stream is complete. Any deviation raises `WireError`; nothing outside the decoder's
own buffers has been touched at that point, so callers reject the stream and keep their state.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import grpc
import numpy as np
import torch

from nodeagent._proto import wire_pb2
from nodeagent.wire.message import DTYPE_NAMES, DTYPES, Encoding, Kind, Message, TensorSpec

DEFAULT_CHUNK_BYTES = 1 << 20

# Wire dtypes of the lossy encodings; they apply to floating tensors only, others travel raw.
_ENCODED_DTYPES = {Encoding.FP16: torch.float16, Encoding.BF16: torch.bfloat16}


class WireError(Exception):
    """A stream that cannot be accepted. `reason` is a short label for metrics; `code` the gRPC status."""

    def __init__(self, reason: str, detail: str, code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
        self.code = code


def wire_encoding(dtype: torch.dtype, requested: Encoding) -> Encoding:
    """The encoding a tensor of `dtype` travels in when `requested` is asked for."""
    if requested in _ENCODED_DTYPES and dtype.is_floating_point and dtype != _ENCODED_DTYPES[requested]:
        return requested
    return Encoding.RAW


def wire_dtype(dtype: torch.dtype, encoding: Encoding) -> torch.dtype:
    return _ENCODED_DTYPES.get(encoding, dtype)


def wire_length(spec: TensorSpec, encoding: Encoding) -> int:
    return spec.numel * wire_dtype(spec.dtype, encoding).itemsize


def _byte_view(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's memory as a flat uint8 array, without a copy when it is already contiguous on the CPU."""
    flat = tensor.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.to("cpu")
    return flat.contiguous().view(torch.uint8).numpy()


def encode(
    message: Message,
    *,
    job_id: str = "",
    sender_id: str = "",
    encoding: Encoding = Encoding.RAW,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> Iterator[wire_pb2.Frame]:
    """Frames of one message: manifest, chunks (at most `chunk_bytes` each), end."""
    if chunk_bytes < 1:
        raise ValueError("chunk_bytes must be positive")
    headers = []
    encodings = []
    total = 0
    for name, tensor in message.tensors.items():
        if tensor.dtype not in DTYPE_NAMES:
            raise ValueError(f"tensor {name!r}: dtype {tensor.dtype} cannot travel")
        tensor_encoding = wire_encoding(tensor.dtype, encoding)
        length = wire_length(TensorSpec.of(name, tensor), tensor_encoding)
        headers.append(
            wire_pb2.TensorHeader(
                name=name,
                dtype=DTYPE_NAMES[tensor.dtype],
                shape=list(tensor.shape),
                encoding=int(tensor_encoding),
                byte_length=length,
            )
        )
        encodings.append(tensor_encoding)
        total += length
    yield wire_pb2.Frame(
        manifest=wire_pb2.Manifest(
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
    )
    for tensor, tensor_encoding in zip(message.tensors.values(), encodings, strict=True):
        if tensor_encoding != Encoding.RAW:
            tensor = tensor.detach().to(wire_dtype(tensor.dtype, tensor_encoding))
        data = _byte_view(tensor)
        for start in range(0, data.size, chunk_bytes):
            yield wire_pb2.Frame(chunk=data[start : start + chunk_bytes].tobytes())
    yield wire_pb2.Frame(end=wire_pb2.End(total_bytes=total))


@dataclass
class _Slot:
    """One expected tensor being received: its wire buffer and how much of it is filled."""

    spec: TensorSpec
    encoding: Encoding
    buffer: torch.Tensor
    view: np.ndarray
    filled: int = 0

    @property
    def remaining(self) -> int:
        return self.view.size - self.filled


Expectation = Callable[[wire_pb2.Manifest], Sequence[TensorSpec]]


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
        if header.encoding not in Encoding._value2member_map_:
            raise WireError("bad_manifest", f"tensor {spec.name!r}: unsupported encoding {header.encoding}")
        encoding = Encoding(header.encoding)
        if encoding != wire_encoding(spec.dtype, encoding):
            raise WireError("bad_manifest", f"tensor {spec.name!r}: encoding {encoding.name} does not fit {spec.dtype}")
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


def decode(frames: Iterable[wire_pb2.Frame], expect: Expectation, max_bytes: int = 1 << 30) -> Message:
    """Read one whole stream (the iterator must end right after the End frame) into a Message.

    `expect(manifest)` returns the tensors the receiver accepts for that manifest's edge and kind, or raises
    WireError (for example when the sender is not a neighbour).
    """
    iterator = iter(frames)
    first = next(iterator, None)
    if first is None:
        raise WireError("truncated", "empty stream")
    if first.WhichOneof("body") != "manifest":
        raise WireError("no_manifest", "a stream must start with a manifest frame")
    manifest = first.manifest
    # The kind is checked before `expect` sees the manifest, so expectations may rely on a valid kind.
    if manifest.kind not in Kind._value2member_map_:
        raise WireError("bad_manifest", f"unknown message kind {manifest.kind}")
    expected = expect(manifest)
    encodings = check_manifest(manifest, expected, max_bytes)
    slots = []
    for spec, encoding in zip(expected, encodings, strict=True):
        buffer = torch.empty(spec.numel, dtype=wire_dtype(spec.dtype, encoding))
        slots.append(_Slot(spec, encoding, buffer, buffer.view(torch.uint8).numpy()))
    total = sum(slot.view.size for slot in slots)
    received = 0
    index = 0
    ended = False
    for frame in iterator:
        body = frame.WhichOneof("body")
        if ended:
            raise WireError("after_end", f"a {body or 'empty'} frame follows the end frame")
        if body == "chunk":
            data = frame.chunk
            if received + len(data) > total:
                raise WireError("too_long", f"more than the {total} bytes the manifest announced")
            offset = 0
            while offset < len(data):
                while slots[index].remaining == 0:
                    index += 1
                slot = slots[index]
                take = min(slot.remaining, len(data) - offset)
                slot.view[slot.filled : slot.filled + take] = np.frombuffer(data, np.uint8, take, offset)
                slot.filled += take
                offset += take
            received += len(data)
        elif body == "end":
            if frame.end.total_bytes != total:
                raise WireError("bad_end", f"end frame says {frame.end.total_bytes} bytes, manifest {total}")
            if received != total:
                raise WireError("truncated", f"received {received} of {total} bytes")
            ended = True
        elif body == "manifest":
            raise WireError("second_manifest", "a second manifest inside one stream")
        else:
            raise WireError("empty_frame", "a frame with no body")
    if not ended:
        raise WireError("truncated", f"stream ended without an end frame after {received} of {total} bytes")
    tensors = {}
    for slot in slots:
        tensor = slot.buffer if slot.encoding == Encoding.RAW else slot.buffer.to(slot.spec.dtype)
        tensors[slot.spec.name] = tensor.reshape(slot.spec.shape)
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


def stream_bytes(frames: Iterable[wire_pb2.Frame]) -> Iterator[tuple[wire_pb2.Frame, int]]:
    """Pass frames through, paired with the payload bytes each carries (for traffic accounting)."""
    for frame in frames:
        yield frame, len(frame.chunk) if frame.WhichOneof("body") == "chunk" else 0
