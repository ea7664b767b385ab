"""The frame codec of nodeagent.wire: round trips, headers, hostile streams and memory use.

A receiver in these tests is a dict of tensors that is updated only after `decode` returned, so a rejected
stream must leave it bit-identical.
"""

from __future__ import annotations

import math
import os
import struct
import subprocess
import sys
import textwrap
import tracemalloc
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest
import torch

from nodeagent._proto import wire_pb2
from nodeagent.wire import DTYPES, Encoding, Kind, Message, Reason, Status, TensorSpec, WireError, specs_of
from nodeagent.wire.decoder import MAX_TENSORS, decode
from nodeagent.wire.encoder import encode
from nodeagent.wire.frames import MAX_CONTROL_FRAME_BYTES
from nodeagent.wire.varint import encode_varint

pytestmark = pytest.mark.integration

Frames = list[wire_pb2.Frame]

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

# Bit patterns written at the front of random floating tensors: negative zero, the smallest subnormal, the
# largest finite value, its negative and the smallest normal. (NaN and infinities are refused by the decoder.)
_SPECIAL_BITS = {
    2: [0x8000, 0x0001, 0x7BFF, 0xFBFF, 0x0400],
    4: [0x80000000, 0x00000001, 0x7F7FFFFF, 0xFF7FFFFF, 0x00800000],
    8: [0x8000000000000000, 0x1, 0x7FEFFFFFFFFFFFFF, 0xFFEFFFFFFFFFFFFF, 0x0010000000000000],
}
_BF16_SPECIAL_BITS = [0x8000, 0x0001, 0x7F7F, 0xFF7F, 0x0080]
# The lowest exponent bit: flipping it in a NaN's or an infinity's all-ones exponent makes a finite value.
_LOW_EXPONENT_BIT = {torch.float16: 1 << 10, torch.bfloat16: 1 << 7, torch.float32: 1 << 23, torch.float64: 1 << 52}


# ---------------------------------------------------------------------------------------------- helpers


def _signed(value: int, bits: int) -> int:
    return value - (1 << bits) if value >= 1 << (bits - 1) else value


def sample(dtype: torch.dtype, shape: Sequence[int], seed: int = 0) -> torch.Tensor:
    """A tensor of random bits of `dtype`; floating ones are finite and start with -0, subnormals and the extremes."""
    gen = torch.Generator().manual_seed(seed)
    shape = tuple(shape)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if not dtype.is_floating_point:
        info = torch.iinfo(dtype)
        return torch.randint(info.min, info.max, shape, dtype=dtype, generator=gen)
    size = dtype.itemsize
    int_dtype = _INT_OF_SIZE[size]
    info = torch.iinfo(int_dtype)
    bits = torch.randint(info.min, info.max, shape, dtype=int_dtype, generator=gen)
    specials = _BF16_SPECIAL_BITS if dtype == torch.bfloat16 else _SPECIAL_BITS[size]
    flat = bits.reshape(-1)
    flat[~torch.isfinite(flat.view(dtype))] ^= _LOW_EXPONENT_BIT[dtype]
    for i, pattern in enumerate(specials[: flat.numel()]):
        flat[i] = _signed(pattern, 8 * size)
    return bits.view(dtype)


def finite_sample(dtype: torch.dtype, shape: Sequence[int], seed: int = 0) -> torch.Tensor:
    """Ordinary floating values (plus a few that round coarsely or underflow in half precision)."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(tuple(shape), dtype=torch.float64, generator=gen) * 3
    flat = values.reshape(-1)
    for i, special in enumerate([6e4, -6.5e4, 1e-9, 0.1, -0.0, 3e-8][: flat.numel()]):
        flat[i] = special
    return values.to(dtype)


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor reinterpreted as integers of its width, so that NaN payloads and -0 compare exactly."""
    tensor = tensor.detach()
    if tensor.dtype == torch.bool:
        return tensor.view(torch.uint8)
    if tensor.dtype.is_floating_point:
        return tensor.view(_INT_OF_SIZE[tensor.element_size()])
    return tensor


def assert_bit_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype
    assert tuple(actual.shape) == tuple(expected.shape)
    assert torch.equal(bits(actual), bits(expected))


def c_order_le_bytes(tensor: torch.Tensor) -> bytes:
    """The wire form of a raw tensor per wire.proto, computed independently: little-endian, C order."""
    array = bits(tensor).numpy()
    return array.astype(array.dtype.newbyteorder("<")).tobytes(order="C")


def expect_specs(specs: Sequence[TensorSpec]) -> Callable[[wire_pb2.Manifest], Sequence[TensorSpec]]:
    return lambda manifest: list(specs)


def chunk_frames(frames: Iterable[wire_pb2.Frame]) -> list[bytes]:
    return [f.chunk for f in frames if f.WhichOneof("body") == "chunk"]


def rechunk(frames: Frames, sizes: Iterator[int]) -> Frames:
    """The same stream with its payload cut into chunks of the given sizes, spanning tensor boundaries."""
    payload = b"".join(chunk_frames(frames))
    chunks = []
    start = 0
    while start < len(payload):
        size = next(sizes)
        chunks.append(wire_pb2.Frame(chunk=payload[start : start + size]))
        start += size
    return [frames[0], *chunks, frames[-1]]


def copy_frame(frame: wire_pb2.Frame) -> wire_pb2.Frame:
    return wire_pb2.Frame.FromString(frame.SerializeToString())


def roundtrip(message: Message, **kwargs) -> tuple[Frames, Message]:
    frames = list(encode(message, **kwargs))
    return frames, decode(frames, expect_specs(specs_of(message.tensors)))


# ------------------------------------------------------------------------------------------ round trips

SHAPES = [(), (0,), (3, 0, 2), (17,), (2, 3, 4, 5)]


def _chunk_sizes(nbytes: int) -> list[tuple[str, int]]:
    return [("1", 1), ("7", 7), ("exact", max(nbytes, 1)), ("larger", nbytes + 1000)]


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)) or "scalar")
def test_raw_roundtrip_is_bit_exact(dtype_name: str, shape: tuple[int, ...]) -> None:
    dtype = DTYPES[dtype_name]
    tensor = sample(dtype, shape, seed=len(shape))
    nbytes = tensor.numel() * tensor.element_size()
    for label, chunk_bytes in _chunk_sizes(nbytes):
        message = Message(Kind.PARAMS, 0, 1, {"t": tensor})
        frames, decoded = roundtrip(message, chunk_bytes=chunk_bytes)
        assert list(decoded.tensors) == ["t"], label
        assert_bit_equal(decoded.tensors["t"], tensor)
        header = frames[0].manifest.tensors[0]
        assert (header.dtype, tuple(header.shape), header.encoding) == (dtype_name, shape, Encoding.RAW)
        assert header.byte_length == nbytes
        chunks = chunk_frames(frames)
        assert all(0 < len(c) <= chunk_bytes for c in chunks), label
        assert len(chunks) == math.ceil(nbytes / chunk_bytes), label
        assert b"".join(chunks) == c_order_le_bytes(tensor), label
        assert frames[-1].WhichOneof("body") == "end"
        assert frames[-1].end.total_bytes == nbytes


def _noncontiguous_inputs() -> dict[str, torch.Tensor]:
    base = sample(torch.float32, (6, 8), seed=3)
    return {
        "transpose": base.t(),
        "step_slice": base[::2, 1::3],
        "column": base[:, 5],
        "offset_slice": base[2:],
        "expanded": sample(torch.int16, (1, 5), seed=4).expand(4, 5),
        "permuted_4d": sample(torch.bfloat16, (2, 3, 4, 5), seed=5).permute(3, 1, 0, 2),
        "requires_grad": sample(torch.float64, (3, 3), seed=6).clone().requires_grad_(True)[:, 1:],
    }


@pytest.mark.parametrize("kind", list(_noncontiguous_inputs()))
@pytest.mark.parametrize("chunk_bytes", [1, 7, 1 << 20])
def test_noncontiguous_input_travels_in_c_order(kind: str, chunk_bytes: int) -> None:
    tensor = _noncontiguous_inputs()[kind]
    frames, decoded = roundtrip(Message(Kind.DELTA, 3, 4, {"x": tensor}), chunk_bytes=chunk_bytes)
    result = decoded.tensors["x"]
    assert_bit_equal(result, tensor.detach())
    assert result.is_contiguous()
    assert not result.requires_grad
    assert b"".join(chunk_frames(frames)) == c_order_le_bytes(tensor.detach())


def _mixed_tensors() -> dict[str, torch.Tensor]:
    return {
        "a": sample(torch.float32, (3, 5), seed=10),
        "scalar": sample(torch.float64, (), seed=11),
        "none": sample(torch.int32, (0, 4), seed=12),
        "b": sample(torch.bfloat16, (7,), seed=13),
        "flags": sample(torch.bool, (3, 3), seed=14),
        "c": sample(torch.int8, (5,), seed=15),
        "d": sample(torch.uint8, (2, 2, 2), seed=16),
        "e": sample(torch.int64, (3,), seed=17),
        "f": sample(torch.float16, (1, 1, 1, 3), seed=18),
        "g": sample(torch.int16, (3,), seed=19),
        "tail_empty": sample(torch.float32, (3, 0, 2), seed=20),
    }


@pytest.mark.parametrize("chunk_bytes", [1, 3, 7, 16, 1 << 20])
def test_multiple_tensors_roundtrip(chunk_bytes: int) -> None:
    tensors = _mixed_tensors()
    frames, decoded = roundtrip(Message(Kind.PUSHSUM, 0, 1, tensors), chunk_bytes=chunk_bytes)
    assert list(decoded.tensors) == list(tensors)
    for name, tensor in tensors.items():
        assert_bit_equal(decoded.tensors[name], tensor)
    assert [h.name for h in frames[0].manifest.tensors] == list(tensors)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    assert frames[-1].end.total_bytes == total
    assert b"".join(chunk_frames(frames)) == b"".join(c_order_le_bytes(t) for t in tensors.values())


@pytest.mark.parametrize("sizes", [[1], [5], [13], [2, 9, 1, 30], [0, 4], [10_000]], ids=str)
def test_decode_accepts_chunks_that_span_tensors(sizes: list[int]) -> None:
    tensors = _mixed_tensors()
    frames = list(encode(Message(Kind.PARAMS, 0, 1, tensors), chunk_bytes=64))

    def cycle() -> Iterator[int]:
        while True:
            yield from sizes

    restream = rechunk(frames, cycle())
    decoded = decode(restream, expect_specs(specs_of(tensors)))
    for name, tensor in tensors.items():
        assert_bit_equal(decoded.tensors[name], tensor)


def test_message_without_tensors_roundtrips() -> None:
    frames, decoded = roundtrip(Message(Kind.DUAL, 2, 3, {}, clock=5))
    assert [f.WhichOneof("body") for f in frames] == ["manifest", "end"]
    assert frames[-1].end.total_bytes == 0
    assert dict(decoded.tensors) == {}
    assert (decoded.kind, decoded.clock) == (Kind.DUAL, 5)


def test_decoded_tensors_are_independent_of_the_input() -> None:
    tensor = sample(torch.float32, (4, 4), seed=1)
    original = tensor.clone()
    _, decoded = roundtrip(Message(Kind.PARAMS, 0, 1, {"t": tensor}), chunk_bytes=8)
    result = decoded.tensors["t"]
    tensor.fill_(0.0)
    assert_bit_equal(result, original)
    result.fill_(1.0)  # writable, and writing it does not reach back into the sender's tensor
    assert torch.equal(tensor, torch.zeros(4, 4))


FLOAT_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
WIRE_DTYPE = {Encoding.FP16: torch.float16, Encoding.BF16: torch.bfloat16}


@pytest.mark.parametrize("encoding", [Encoding.FP16, Encoding.BF16], ids=lambda e: e.name)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (37,), (2, 3, 4, 5)], ids=str)
def test_lossy_encodings_round_to_the_wire_dtype(
    encoding: Encoding, dtype: torch.dtype, shape: tuple[int, ...]
) -> None:
    wire = WIRE_DTYPE[encoding]
    tensor = finite_sample(dtype, shape, seed=7)
    frames, decoded = roundtrip(Message(Kind.GRADIENT, 0, 1, {"t": tensor}), encoding=encoding, chunk_bytes=7)
    result = decoded.tensors["t"]
    assert result.dtype == dtype
    header = frames[0].manifest.tensors[0]
    assert header.dtype == {v: k for k, v in DTYPES.items()}[dtype]
    if dtype == wire:
        # Already in the wire dtype: nothing to gain, it travels raw and exact.
        assert header.encoding == Encoding.RAW
        assert_bit_equal(result, tensor)
    else:
        assert header.encoding == encoding
        assert header.byte_length == tensor.numel() * 2
        assert_bit_equal(result, tensor.to(wire).to(dtype))
    assert frames[-1].end.total_bytes == header.byte_length
    assert sum(map(len, chunk_frames(frames))) == header.byte_length


@pytest.mark.parametrize("encoding", [Encoding.FP16, Encoding.BF16], ids=lambda e: e.name)
def test_lossy_encoding_halves_float32_and_leaves_other_dtypes_raw(encoding: Encoding) -> None:
    tensors = {
        "w": finite_sample(torch.float32, (16, 8), seed=1),
        "steps": sample(torch.int64, (5,), seed=2),
        "ids": sample(torch.int32, (4,), seed=3),
        "small": sample(torch.int8, (3,), seed=4),
        "bytes": sample(torch.uint8, (6,), seed=5),
        "short": sample(torch.int16, (2,), seed=6),
        "mask": sample(torch.bool, (9,), seed=7),
    }
    frames, decoded = roundtrip(Message(Kind.PARAMS, 0, 1, tensors), encoding=encoding, chunk_bytes=5)
    headers = {h.name: h for h in frames[0].manifest.tensors}
    assert headers["w"].encoding == encoding
    assert headers["w"].byte_length == 16 * 8 * 2 == tensors["w"].numel() * 4 // 2
    assert_bit_equal(decoded.tensors["w"], tensors["w"].to(WIRE_DTYPE[encoding]).to(torch.float32))
    for name, tensor in tensors.items():
        if name == "w":
            continue
        assert headers[name].encoding == Encoding.RAW, name
        assert headers[name].byte_length == tensor.numel() * tensor.element_size(), name
        assert_bit_equal(decoded.tensors[name], tensor)
    assert frames[-1].end.total_bytes == sum(h.byte_length for h in headers.values())


def test_fp16_encoding_rounding_error_is_bounded() -> None:
    tensor = torch.linspace(-100, 100, 1001, dtype=torch.float32)
    _, decoded = roundtrip(Message(Kind.PARAMS, 0, 1, {"t": tensor}), encoding=Encoding.FP16)
    error = (decoded.tensors["t"] - tensor).abs()
    assert float(error.max()) <= 100 * 2**-11  # half an ulp of float16 near 100
    assert float(error.max()) > 0  # it really was rounded


def test_encode_rejects_a_dtype_that_cannot_travel_and_a_bad_chunk_size() -> None:
    with pytest.raises(ValueError, match="cannot travel"):
        list(encode(Message(Kind.PARAMS, 0, 1, {"z": torch.zeros(2, dtype=torch.complex64)})))
    with pytest.raises(ValueError):
        list(encode(Message(Kind.PARAMS, 0, 1, {"z": torch.zeros(2)}), chunk_bytes=0))


# ------------------------------------------------------------------------------------------------ header


@pytest.mark.parametrize("kind", list(Kind), ids=lambda k: k.name)
def test_header_fields_survive(kind: Kind) -> None:
    message = Message(
        kind=kind,
        sender=7,
        receiver=2**32 - 1,
        tensors={"t": sample(torch.float32, (3,), seed=1)},
        clock=-(2**40) - 3,
        loss=0.1234567890123,
        weight=2.5e-7,
        model_version=2**64 - 2,
    )
    seen: list[wire_pb2.Manifest] = []

    def expect(manifest: wire_pb2.Manifest) -> list[TensorSpec]:
        seen.append(manifest)
        return specs_of(message.tensors)

    frames = list(encode(message, job_id="job-ü-42", sender_id="node/a:5000"))
    decoded = decode(frames, expect)
    assert decoded.kind is kind
    assert (decoded.sender, decoded.receiver) == (7, 2**32 - 1)
    assert decoded.clock == -(2**40) - 3
    assert decoded.loss == 0.1234567890123
    assert decoded.weight == 2.5e-7
    assert decoded.model_version == 2**64 - 2
    assert len(seen) == 1
    for manifest in (frames[0].manifest, seen[0]):
        assert manifest.job_id == "job-ü-42"
        assert manifest.sender_id == "node/a:5000"
        assert (manifest.sender_rank, manifest.receiver_rank, manifest.kind) == (7, 2**32 - 1, int(kind))


def test_header_nonfinite_loss_and_defaults() -> None:
    # A node that has not trained yet reports a NaN loss; the push-sum weight is mixed into the model, so it must
    # be finite (the hostile streams weight_nan and weight_inf).
    message = Message(Kind.PUSHSUM, 1, 0, {}, loss=math.nan, weight=2.5)
    _, decoded = roundtrip(message)
    assert math.isnan(decoded.loss)
    assert decoded.weight == 2.5
    _, plain = roundtrip(Message(Kind.PARAMS, 1, 0, {}))
    assert (plain.clock, plain.loss, plain.weight, plain.model_version) == (0, 0.0, 1.0, 0)


# ------------------------------------------------------------------------------------------ hostile streams

SPECS = [TensorSpec("w", torch.float32, (4, 5)), TensorSpec("b", torch.int64, (3,))]
TOTAL = 4 * 5 * 4 + 3 * 8  # 104 bytes: w in 5 chunks of 16, b in chunks of 16 and 8


def _good_frames() -> Frames:
    tensors = {"w": sample(torch.float32, (4, 5), seed=21), "b": sample(torch.int64, (3,), seed=22)}
    message = Message(Kind.PARAMS, 1, 2, tensors, clock=9)
    return list(encode(message, job_id="job", sender_id="n1", chunk_bytes=16))


def _initial_state() -> dict[str, torch.Tensor]:
    return {
        "w": torch.full((4, 5), -1.5),
        "b": torch.tensor([10, 20, 30]),
        "other": torch.tensor([math.nan, -0.0]),
    }


def receive(state: dict[str, torch.Tensor], frames: Iterable[wire_pb2.Frame], expect, max_bytes: int = 1 << 30):
    """The receiver: it takes the tensors over only once the whole stream has been accepted."""
    message = decode(frames, expect, max_bytes)
    state.update(message.tensors)
    return message


class CountingStream:
    """An iterable of frames that records how many the decoder pulled."""

    def __init__(self, frames: Frames) -> None:
        self.frames = frames
        self.pulled = 0

    def __iter__(self) -> Iterator[wire_pb2.Frame]:
        for frame in self.frames:
            self.pulled += 1
            yield frame


def _manifest(mutate: Callable[[wire_pb2.Manifest], None]) -> Callable[[Frames], Frames]:
    def build(frames: Frames) -> Frames:
        first = copy_frame(frames[0])
        mutate(first.manifest)
        return [first, *frames[1:]]

    return build


def _set_header(index: int, **fields) -> Callable[[Frames], Frames]:
    def mutate(manifest: wire_pb2.Manifest) -> None:
        header = manifest.tensors[index]
        for key, value in fields.items():
            if key == "shape":
                del header.shape[:]
                header.shape.extend(value)
            else:
                setattr(header, key, value)

    return _manifest(mutate)


def _end(total: int) -> Callable[[Frames], Frames]:
    return lambda f: [*f[:-1], wire_pb2.Frame(end=wire_pb2.End(total_bytes=total))]


def _missing_tensor(frames: Frames) -> Frames:
    # A consistent stream of only "w": the manifest lists one tensor and the bytes and end frame agree.
    first = copy_frame(frames[0])
    del first.manifest.tensors[1]
    return [first, *frames[1:6], wire_pb2.Frame(end=wire_pb2.End(total_bytes=80))]


def _extra_tensor(frames: Frames) -> Frames:
    first = copy_frame(frames[0])
    first.manifest.tensors.add(name="c", dtype="float32", shape=[2], encoding=0, byte_length=8)
    return [first, *frames[1:-1], wire_pb2.Frame(chunk=bytes(8)), wire_pb2.Frame(end=wire_pb2.End(total_bytes=112))]


def _longer_last_chunk(frames: Frames) -> Frames:
    return [*frames[:-2], wire_pb2.Frame(chunk=frames[-2].chunk + b"\0"), frames[-1]]


def _swapped_tensors(frames: Frames) -> Frames:
    first = copy_frame(frames[0])
    w, b = (wire_pb2.TensorHeader.FromString(h.SerializeToString()) for h in first.manifest.tensors)
    del first.manifest.tensors[:]
    first.manifest.tensors.extend([b, w])
    return [first, *frames[6:8], *frames[1:6], frames[-1]]


def _poison(value: float) -> Callable[[Frames], Frames]:
    """The stream with the first element of "w" (float32, the first chunk's first 4 bytes) set to `value`."""

    def build(frames: Frames) -> Frames:
        chunk = struct.pack("<f", value) + frames[1].chunk[4:]
        return [frames[0], wire_pb2.Frame(chunk=chunk), *frames[2:]]

    return build


def _many_tensors(count: int) -> Callable[[Frames], Frames]:
    def mutate(manifest: wire_pb2.Manifest) -> None:
        for index in range(count - len(manifest.tensors)):
            manifest.tensors.add(name=f"t{index}", dtype="float32", shape=[1], byte_length=4)

    return _manifest(mutate)


EMPTY = wire_pb2.Frame()
JUNK = wire_pb2.Frame(chunk=b"\x00")

# (id, stream builder, reason, whether the stream must be rejected on its manifest alone)
HOSTILE: list[tuple[str, Callable[[Frames], Frames], str, bool]] = [
    ("empty_stream", lambda f: [], "truncated", False),
    ("starts_with_chunk", lambda f: f[1:], "no_manifest", False),
    ("starts_with_end", lambda f: [f[-1]], "no_manifest", False),
    ("starts_with_empty_frame", lambda f: [EMPTY, *f], "no_manifest", False),
    ("end_dropped", lambda f: f[:-1], "truncated", False),
    ("only_manifest", lambda f: f[:1], "truncated", False),
    ("first_chunk_dropped", lambda f: [f[0], *f[2:]], "truncated", False),
    ("middle_chunk_dropped", lambda f: [*f[:3], *f[4:]], "truncated", False),
    ("last_chunk_dropped", lambda f: [*f[:-2], f[-1]], "truncated", False),
    ("stops_mid_tensor", lambda f: f[:3], "truncated", False),
    ("stops_between_tensors", lambda f: f[:6], "truncated", False),
    ("extra_chunk", lambda f: [*f[:-1], JUNK, f[-1]], "too_long", False),
    ("duplicated_chunk", lambda f: [*f[:2], f[1], *f[2:]], "too_long", False),
    ("last_chunk_one_byte_long", _longer_last_chunk, "too_long", False),
    ("chunk_after_end", lambda f: [*f, JUNK], "after_end", False),
    ("empty_chunk_after_end", lambda f: [*f, wire_pb2.Frame(chunk=b"")], "after_end", False),
    ("end_after_end", lambda f: [*f, f[-1]], "after_end", False),
    ("manifest_after_end", lambda f: [*f, f[0]], "after_end", False),
    ("empty_frame_after_end", lambda f: [*f, EMPTY], "after_end", False),
    ("second_manifest", lambda f: [*f[:2], f[0], *f[2:]], "second_manifest", False),
    ("second_manifest_before_end", lambda f: [*f[:-1], f[0], f[-1]], "second_manifest", False),
    ("end_total_high", _end(TOTAL + 1), "bad_end", False),
    ("end_total_low", _end(TOTAL - 1), "bad_end", False),
    ("end_total_zero", _end(0), "bad_end", False),
    ("empty_frame_mid_stream", lambda f: [*f[:2], EMPTY, *f[2:]], "empty_frame", False),
    ("empty_frame_before_end", lambda f: [*f[:-1], EMPTY, f[-1]], "empty_frame", False),
    ("byte_length_high", _set_header(0, byte_length=81), "bad_manifest", True),
    ("byte_length_zero", _set_header(1, byte_length=0), "bad_manifest", True),
    ("byte_length_huge", _set_header(0, byte_length=2**64 - 1), "bad_manifest", True),
    ("shape_transposed", _set_header(0, shape=[5, 4]), "bad_manifest", True),
    ("shape_flattened", _set_header(0, shape=[20]), "bad_manifest", True),
    ("shape_extra_dim", _set_header(1, shape=[3, 1]), "bad_manifest", True),
    ("shape_negative", _set_header(1, shape=[-3]), "bad_manifest", True),
    ("dtype_wider", _set_header(0, dtype="float64", byte_length=160), "bad_manifest", True),
    ("dtype_same_width", _set_header(0, dtype="int32"), "bad_manifest", True),
    ("dtype_unknown", _set_header(1, dtype="complex64"), "bad_manifest", True),
    ("dtype_empty", _set_header(1, dtype=""), "bad_manifest", True),
    ("unknown_name", _set_header(0, name="W"), "bad_manifest", True),
    ("tensors_reordered", _swapped_tensors, "bad_manifest", True),
    ("missing_tensor", _missing_tensor, "bad_manifest", True),
    ("extra_tensor", _extra_tensor, "bad_manifest", True),
    ("encoding_topk", _set_header(0, encoding=3), "bad_manifest", True),
    ("encoding_topk_with_its_count", _set_header(0, encoding=3, topk_count=2, byte_length=16), "bad_manifest", True),
    ("topk_count_on_raw", _set_header(0, topk_count=1), "bad_manifest", True),
    ("encoding_99", _set_header(0, encoding=99), "bad_manifest", True),
    ("encoding_fp16_on_int", _set_header(1, encoding=1, byte_length=6), "bad_manifest", True),
    ("encoding_bf16_on_int", _set_header(1, encoding=2, byte_length=6), "bad_manifest", True),
    ("fp16_header_raw_payload", _set_header(0, encoding=1, byte_length=40), "too_long", False),
    ("kind_unknown", _manifest(lambda m: setattr(m, "kind", 99)), "bad_manifest", True),
    ("kind_unspecified", _manifest(lambda m: setattr(m, "kind", 0)), "bad_manifest", True),
    ("nan_in_a_tensor", _poison(math.nan), "non_finite", False),
    ("inf_in_a_tensor", _poison(math.inf), "non_finite", False),
    ("minus_inf_in_a_tensor", _poison(-math.inf), "non_finite", False),
    ("weight_nan", _manifest(lambda m: setattr(m, "weight", math.nan)), "non_finite", False),
    ("weight_inf", _manifest(lambda m: setattr(m, "weight", math.inf)), "non_finite", False),
    ("tensors_over_the_limit", _many_tensors(MAX_TENSORS + 1), "manifest_limit", True),
    ("name_of_300_chars", _set_header(0, name="w" * 300), "manifest_limit", True),
    ("dtype_of_300_chars", _set_header(1, dtype="int64" * 60), "manifest_limit", True),
    ("shape_of_33_dims", _set_header(0, shape=[1] * 33), "manifest_limit", True),
    ("job_id_of_300_chars", _manifest(lambda m: setattr(m, "job_id", "j" * 300)), "manifest_limit", True),
    ("sender_id_of_300_chars", _manifest(lambda m: setattr(m, "sender_id", "n" * 300)), "manifest_limit", True),
]


@pytest.mark.parametrize(("build", "reason", "manifest_only"), [h[1:] for h in HOSTILE], ids=[h[0] for h in HOSTILE])
def test_hostile_stream_is_rejected_and_state_kept(build, reason: str, manifest_only: bool) -> None:
    state = _initial_state()
    objects = dict(state)
    snapshot = {name: tensor.clone() for name, tensor in state.items()}
    stream = CountingStream(build(_good_frames()))
    calls = []

    def expect(manifest: wire_pb2.Manifest) -> list[TensorSpec]:
        calls.append(manifest)
        return list(SPECS)

    with pytest.raises(WireError) as excinfo:
        receive(state, stream, expect)
    error = excinfo.value
    assert error.reason == reason, str(error)
    assert error.status == Status.INVALID_ARGUMENT
    assert error.detail and str(error).startswith(f"{reason}: ")
    assert len(str(error)) < 300, "an error must not echo unbounded input"
    assert len(calls) <= 1
    if reason == "manifest_limit":
        assert not calls, "the limits are checked before the expectation sees the manifest"
    if manifest_only:
        assert stream.pulled == 1, "a bad manifest must be rejected before any chunk is read"
    assert state.keys() == snapshot.keys()
    for name, tensor in state.items():
        assert tensor is objects[name]
        assert_bit_equal(tensor, snapshot[name])


def test_good_stream_updates_the_receiver() -> None:
    # The counterpart of the hostile cases: the same stream, unmodified, is taken over in full.
    state = _initial_state()
    frames = _good_frames()
    message = receive(state, frames, expect_specs(SPECS))
    assert_bit_equal(state["w"], sample(torch.float32, (4, 5), seed=21))
    assert_bit_equal(state["b"], sample(torch.int64, (3,), seed=22))
    assert (message.kind, message.sender, message.receiver, message.clock) == (Kind.PARAMS, 1, 2, 9)
    assert len(frames) == 9 and frames[-1].end.total_bytes == TOTAL


@pytest.mark.parametrize(("max_bytes", "ok"), [(TOTAL, True), (TOTAL - 1, False), (0, False)])
def test_max_bytes_limits_the_announced_stream(max_bytes: int, ok: bool) -> None:
    state = _initial_state()
    snapshot = {name: tensor.clone() for name, tensor in state.items()}
    stream = CountingStream(_good_frames())
    if ok:
        receive(state, stream, expect_specs(SPECS), max_bytes=max_bytes)
        assert_bit_equal(state["b"], sample(torch.int64, (3,), seed=22))
        return
    with pytest.raises(WireError) as excinfo:
        receive(state, stream, expect_specs(SPECS), max_bytes=max_bytes)
    assert excinfo.value.reason == "too_large"
    assert excinfo.value.status == Status.INVALID_ARGUMENT
    assert stream.pulled == 1, "an oversized stream must be refused on its manifest"
    for name, tensor in state.items():
        assert_bit_equal(tensor, snapshot[name])


def test_max_bytes_counts_wire_bytes_of_encoded_tensors() -> None:
    tensor = finite_sample(torch.float32, (100,), seed=2)
    frames = list(encode(Message(Kind.PARAMS, 0, 1, {"t": tensor}), encoding=Encoding.FP16))
    decode(frames, expect_specs(specs_of({"t": tensor})), max_bytes=200)
    with pytest.raises(WireError) as excinfo:
        decode(frames, expect_specs(specs_of({"t": tensor})), max_bytes=199)
    assert excinfo.value.reason == "too_large"


def test_unknown_kind_is_rejected_before_a_per_kind_expectation_sees_it() -> None:
    """A receiver's expectation naturally dispatches on the message kind (the docstring says it returns the
    tensors accepted "for that manifest's edge and kind"); a stream with a kind outside MessageKind must come
    back as WireError(bad_manifest), not as whatever the lookup raises."""
    accepted = {Kind.PARAMS: list(SPECS), Kind.DELTA: list(SPECS)}

    def expect(manifest: wire_pb2.Manifest) -> list[TensorSpec]:
        kind = Kind(manifest.kind)
        if kind not in accepted:
            raise WireError("unexpected_kind", f"{kind.name} is not accepted here")
        return accepted[kind]

    state = _initial_state()
    snapshot = {name: tensor.clone() for name, tensor in state.items()}
    for value in (0, 99):
        frames = _manifest(lambda m, value=value: setattr(m, "kind", value))(_good_frames())
        with pytest.raises(WireError) as excinfo:
            receive(state, frames, expect)
        assert excinfo.value.reason == "bad_manifest"
        assert excinfo.value.status == Status.INVALID_ARGUMENT
    for name, tensor in state.items():
        assert_bit_equal(tensor, snapshot[name])


# ------------------------------------------------------------------------------------------- expectation


def test_expectation_error_propagates_unchanged() -> None:
    refusal = WireError("not_neighbour", "rank 1 is not a neighbour of rank 2", status=Status.PERMISSION_DENIED)
    seen = []

    def expect(manifest: wire_pb2.Manifest) -> list[TensorSpec]:
        seen.append((manifest.sender_rank, manifest.receiver_rank, manifest.sender_id))
        raise refusal

    state = _initial_state()
    snapshot = {name: tensor.clone() for name, tensor in state.items()}
    stream = CountingStream(_good_frames())
    with pytest.raises(WireError) as excinfo:
        receive(state, stream, expect)
    assert excinfo.value is refusal
    assert excinfo.value.reason == "not_neighbour"
    assert excinfo.value.status == Status.PERMISSION_DENIED
    assert seen == [(1, 2, "n1")]
    assert stream.pulled == 1
    for name, tensor in state.items():
        assert_bit_equal(tensor, snapshot[name])


def test_expectation_sees_the_manifest_and_selects_the_specs() -> None:
    # The receiver decides per sender: the same stream passes for one expectation and not for another.
    frames = _good_frames()

    def expect(manifest: wire_pb2.Manifest) -> list[TensorSpec]:
        if manifest.sender_rank == 1 and manifest.job_id == "job":
            return list(SPECS)
        return [SPECS[0]]

    assert set(decode(frames, expect).tensors) == {"w", "b"}
    other = _manifest(lambda m: setattr(m, "sender_rank", 5))(frames)
    with pytest.raises(WireError) as excinfo:
        decode(other, expect)
    assert excinfo.value.reason == "bad_manifest"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("encoding", list(Encoding), ids=lambda e: e.name)
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=str)
def test_a_nonfinite_value_is_refused_in_every_dtype_and_encoding(dtype, encoding, value) -> None:
    tensor = finite_sample(dtype, (50,), seed=3)
    tensor[37] = value
    frames = list(encode(Message(Kind.PARAMS, 0, 1, {"t": tensor}), encoding=encoding, chunk_bytes=64))
    with pytest.raises(WireError) as excinfo:
        decode(frames, expect_specs(specs_of({"t": tensor})))
    assert excinfo.value.reason == "non_finite" and excinfo.value.status == Status.INVALID_ARGUMENT
    assert "'t'" in excinfo.value.detail


def test_a_float32_beyond_float16s_range_is_refused_once_decoded_as_an_infinity() -> None:
    tensor = torch.tensor([1.0, 7e4])
    frames = list(encode(Message(Kind.PARAMS, 0, 1, {"t": tensor}), encoding=Encoding.FP16))
    with pytest.raises(WireError) as excinfo:
        decode(frames, expect_specs(specs_of({"t": tensor})))
    assert excinfo.value.reason == "non_finite"
    frames = list(encode(Message(Kind.PARAMS, 0, 1, {"t": tensor}), encoding=Encoding.BF16))  # float32's range
    assert_bit_equal(decode(frames, expect_specs(specs_of({"t": tensor}))).tensors["t"], tensor.bfloat16().float())


def manifest_frame_bytes(megabytes: int) -> bytes:
    """A serialized manifest frame of about `megabytes` MB: small tensor headers, many of them (built by hand, so
    that no protobuf object is made)."""
    header = wire_pb2.TensorHeader(name="layer.0.weight", dtype="float32", shape=[4, 5], byte_length=80)
    entry = serialized_field(10, header.SerializeToString())
    return serialized_field(1, entry * (megabytes * 1_000_000 // len(entry)))


def serialized_field(number: int, value: bytes) -> bytes:
    """A length-delimited protobuf field."""
    return encode_varint(number << 3 | 2) + encode_varint(len(value)) + value


def test_a_manifest_of_100k_tensors_is_refused_before_protobuf_parses_it(monkeypatch) -> None:
    frame = manifest_frame_bytes(3)  # about 110 000 tensors
    parsed = []
    monkeypatch.setattr(wire_pb2.Frame, "FromString", lambda data: parsed.append(data))
    with pytest.raises(WireError) as excinfo:
        decode([frame], expect_specs(SPECS))
    assert excinfo.value.reason == "too_large" and not parsed
    assert str(MAX_CONTROL_FRAME_BYTES) in excinfo.value.detail


def test_a_61mb_manifest_is_refused_without_growing_the_process() -> None:
    # In a fresh process, so that its peak resident size says what the refusal cost: parsed, the frame alone
    # grows the process by about 240 MiB, and walking its headers costs more.
    script = textwrap.dedent("""
        import resource
        from test_codec import manifest_frame_bytes
        from nodeagent.wire import WireError
        from nodeagent.wire.decoder import decode
        frame = manifest_frame_bytes(61)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        try:
            decode([frame], lambda manifest: [])
        except WireError as error:
            print(error.reason, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
    """)
    tests = Path(__file__).parent
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True,
                            env={**os.environ, "PYTHONPATH": f"{tests}{os.pathsep}{tests.parent}"})
    reason, grown_kib = result.stdout.split()
    assert reason == "too_large"
    assert int(grown_kib) < 8 * 1024, f"the refusal grew the process by {grown_kib} KiB"


def test_the_manifest_limits_hold_for_frames_already_parsed() -> None:
    # Frame objects (made by a caller that parsed them) meet the same limits before the expectation sees them.
    frames = _many_tensors(100_000)(_good_frames())
    calls = []
    with pytest.raises(WireError) as excinfo:
        decode(frames, lambda manifest: calls.append(manifest) or list(SPECS))
    assert excinfo.value.reason == "manifest_limit" and not calls
    assert "100000 tensors" in excinfo.value.detail and len(str(excinfo.value)) < 100


# ------------------------------------------------------------------------------------------------ memory

MB4 = 4 * 1024 * 1024
CHUNK64K = 64 * 1024


def test_decode_4mb_keeps_one_copy_of_the_payload() -> None:
    tensor = sample(torch.float32, (1024, 1024), seed=5)
    message = Message(Kind.PARAMS, 0, 1, {"w": tensor})
    yielded: list[wire_pb2.Frame] = []
    retained = []

    def stream() -> Iterator[wire_pb2.Frame]:
        # When the decoder asks for the next frame it may still hold the manifest and the current frame, but no
        # earlier chunk.
        for frame in encode(message, chunk_bytes=CHUNK64K):
            retained.append(sum(sys.getrefcount(yielded[i]) > 2 for i in range(1, len(yielded) - 1)))
            yielded.append(frame)
            yield frame
        del frame

    tracemalloc.start()
    try:
        decoded = decode(stream(), expect_specs(specs_of(message.tensors)), max_bytes=MB4)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()

    result = decoded.tensors["w"]
    assert_bit_equal(result, tensor)
    assert len(yielded) == 2 + MB4 // CHUNK64K
    assert max(retained) == 0, "the decoder keeps earlier chunk frames alive"
    assert all(sys.getrefcount(yielded[i]) == 2 for i in range(len(yielded))), "the message keeps frames alive"
    # The result owns exactly one payload-sized storage, separate from the sender's tensor.
    assert result.untyped_storage().nbytes() == MB4
    assert result.untyped_storage().data_ptr() != tensor.untyped_storage().data_ptr()
    assert result.is_contiguous()
    # No payload-sized Python object (a joined bytes, a list of chunks' bytes) was built along the way.
    assert peak < MB4 // 4, f"peak Python allocation {peak} bytes"


def test_decode_fp16_4mb_result_is_a_single_float32_storage() -> None:
    tensor = finite_sample(torch.float32, (1024, 1024), seed=6)
    frames = list(encode(Message(Kind.PARAMS, 0, 1, {"w": tensor}), encoding=Encoding.FP16, chunk_bytes=CHUNK64K))
    assert len(frames) == 2 + (MB4 // 2) // CHUNK64K
    result = decode(frames, expect_specs(specs_of({"w": tensor}))).tensors["w"]
    assert result.dtype == torch.float32
    assert result.untyped_storage().nbytes() == MB4
    assert_bit_equal(result, tensor.to(torch.float16).to(torch.float32))


def test_lossless_check_uses_numpy_view() -> None:
    # c_order_le_bytes, the independent reference used above, really is little-endian C order.
    tensor = torch.tensor([[1, 2], [3, 4]], dtype=torch.int16).t()
    assert c_order_le_bytes(tensor) == np.array([1, 0, 3, 0, 2, 0, 4, 0], dtype=np.uint8).tobytes()


def test_every_reason_a_receiver_gives_is_explained_to_operators():
    """The `reason` label of peertrain_stream_rejections_total is what an operator sees: each is in the guide."""
    guide = (Path(__file__).resolve().parent.parent / "docs" / "operations.md").read_text()
    assert [reason.value for reason in Reason if f"`{reason.value}`" not in guide] == []
