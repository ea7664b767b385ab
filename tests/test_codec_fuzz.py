"""Seeded random tests of the frame codec: random messages round trip, corrupted streams never crash it."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch

from nodeagent._proto import wire_pb2
from nodeagent.wire import DTYPES, Encoding, Kind, Message, Status, TensorSpec, WireError, specs_of
from nodeagent.wire.decoder import decode
from nodeagent.wire.encoder import encode
from nodeagent.wire.message import all_finite

pytestmark = pytest.mark.unit

Frames = list[wire_pb2.Frame]

REASONS = {
    "truncated",
    "no_manifest",
    "bad_manifest",
    "too_large",
    "too_long",
    "after_end",
    "bad_end",
    "second_manifest",
    "empty_frame",
    "non_finite",
}
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# The lowest exponent bit: flipping it in a NaN's or an infinity's all-ones exponent makes a finite value.
_LOW_EXPONENT_BIT = {torch.float16: 1 << 10, torch.bfloat16: 1 << 7, torch.float32: 1 << 23, torch.float64: 1 << 52}


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.dtype == torch.bool:
        return tensor.view(torch.uint8)
    if tensor.dtype.is_floating_point:
        return tensor.view(_INT_OF_SIZE[tensor.element_size()])
    return tensor


def _random_shape(rng: random.Random) -> tuple[int, ...]:
    ndim = rng.choice([0, 1, 1, 2, 3, 4])
    return tuple(rng.choice([0, 1, 2, 3, 5]) if rng.random() < 0.1 else rng.randint(1, 5) for _ in range(ndim))


def _random_tensor(rng: random.Random, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    gen = torch.Generator().manual_seed(rng.getrandbits(32))
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    int_dtype = _INT_OF_SIZE[dtype.itemsize] if dtype.is_floating_point else dtype
    info = torch.iinfo(int_dtype)
    values = torch.randint(info.min, info.max, shape, dtype=int_dtype, generator=gen)
    if dtype.is_floating_point:  # random finite bits (the decoder refuses NaN and infinities)
        values[~torch.isfinite(values.view(dtype))] ^= _LOW_EXPONENT_BIT[dtype]
        values = values.view(dtype)
    if rng.random() < 0.3 and values.dim() >= 2:
        values = values.transpose(0, 1)  # a non-contiguous input
    return values


def _random_message(rng: random.Random) -> Message:
    names = rng.sample(["w", "b", "mask", "steps", "emb", "bias.0", "layer/1", "ü"], rng.randint(1, 5))
    tensors = {name: _random_tensor(rng, DTYPES[rng.choice(list(DTYPES))], _random_shape(rng)) for name in names}
    return Message(
        kind=rng.choice(list(Kind)),
        sender=rng.randint(0, 2**32 - 1),
        receiver=rng.randint(0, 2**32 - 1),
        tensors=tensors,
        clock=rng.randint(-(2**63), 2**63 - 1),
        loss=rng.uniform(-1e3, 1e3),
        weight=rng.random(),
        model_version=rng.randint(0, 2**64 - 1),
    )


def _rechunk(frames: Frames, rng: random.Random) -> Frames:
    payload = b"".join(f.chunk for f in frames if f.WhichOneof("body") == "chunk")
    chunks, start = [], 0
    while start < len(payload):
        size = rng.choice([0, 1, 2, 3, 7, 16, 100, 10_000])
        chunks.append(wire_pb2.Frame(chunk=payload[start : start + size]))
        start += size
    return [frames[0], *chunks, frames[-1]]


@pytest.mark.parametrize("seed", range(150))
def test_random_messages_roundtrip(seed: int) -> None:
    rng = random.Random(seed)
    message = _random_message(rng)
    encoding = rng.choice(list(Encoding))
    frames = list(encode(message, encoding=encoding, chunk_bytes=rng.choice([1, 3, 8, 64, 1 << 20])))
    if rng.random() < 0.5:
        frames = _rechunk(frames, rng)
    lossy = {Encoding.FP16: torch.float16, Encoding.BF16: torch.bfloat16}.get(encoding)
    expected = {
        name: tensor.to(lossy).to(tensor.dtype)
        if lossy is not None and tensor.dtype.is_floating_point and tensor.dtype != lossy else tensor
        for name, tensor in message.tensors.items()
    }
    if not all(all_finite(tensor) for tensor in expected.values()):  # a value beyond float16's range
        with pytest.raises(WireError) as refused:
            decode(iter(frames), lambda manifest: specs_of(message.tensors))
        assert refused.value.reason == "non_finite"
        return
    decoded = decode(iter(frames), lambda manifest: specs_of(message.tensors))
    assert (decoded.kind, decoded.sender, decoded.receiver, decoded.clock) == (
        message.kind,
        message.sender,
        message.receiver,
        message.clock,
    )
    assert (decoded.loss, decoded.weight, decoded.model_version) == (
        message.loss,
        message.weight,
        message.model_version,
    )
    assert list(decoded.tensors) == list(message.tensors)
    for name, tensor in message.tensors.items():
        result = decoded.tensors[name]
        assert result.dtype == tensor.dtype, name
        assert result.shape == tensor.shape, name
        assert torch.equal(_bits(result), _bits(expected[name])), name


# ---------------------------------------------------------------------------------------- corruptions


def _copy(frame: wire_pb2.Frame) -> wire_pb2.Frame:
    return wire_pb2.Frame.FromString(frame.SerializeToString())


def _chunk_indices(frames: Frames) -> list[int]:
    return [i for i, f in enumerate(frames) if f.WhichOneof("body") == "chunk" and f.chunk]


def flip_byte(frames: Frames, rng: random.Random) -> bool:
    indices = _chunk_indices(frames)
    if not indices:
        return True
    i = rng.choice(indices)
    data = bytearray(frames[i].chunk)
    data[rng.randrange(len(data))] ^= rng.randint(1, 255)
    frames[i] = wire_pb2.Frame(chunk=bytes(data))
    return True


def split_chunk(frames: Frames, rng: random.Random) -> bool:
    indices = _chunk_indices(frames)
    if not indices:
        return True
    i = rng.choice(indices)
    data = frames[i].chunk
    cut = rng.randint(0, len(data))
    frames[i : i + 1] = [wire_pb2.Frame(chunk=data[:cut]), wire_pb2.Frame(chunk=data[cut:])]
    return True


def merge_chunks(frames: Frames, rng: random.Random) -> bool:
    pairs = [
        i
        for i in range(len(frames) - 1)
        if frames[i].WhichOneof("body") == "chunk" and frames[i + 1].WhichOneof("body") == "chunk"
    ]
    if pairs:
        i = rng.choice(pairs)
        frames[i : i + 2] = [wire_pb2.Frame(chunk=frames[i].chunk + frames[i + 1].chunk)]
    return True


def header_only(frames: Frames, rng: random.Random) -> bool:
    """Change a header field the receiver does not check against its expectation."""
    if not frames or frames[0].WhichOneof("body") != "manifest":
        return True
    first = _copy(frames[0])
    field = rng.choice(["sender_rank", "receiver_rank", "clock", "loss", "weight", "model_version", "job_id"])
    value = {
        "sender_rank": rng.randint(0, 2**32 - 1),
        "receiver_rank": rng.randint(0, 2**32 - 1),
        "clock": rng.randint(-(2**63), 2**63 - 1),
        "loss": rng.uniform(-1e9, 1e9),
        "weight": rng.uniform(0, 1),
        "model_version": rng.randint(0, 2**64 - 1),
        "job_id": "other",
    }[field]
    setattr(first.manifest, field, value)
    frames[0] = first
    return True


def drop_frame(frames: Frames, rng: random.Random) -> bool:
    if frames:
        del frames[rng.randrange(len(frames))]
    return False


def duplicate_frame(frames: Frames, rng: random.Random) -> bool:
    if frames:
        frames.insert(rng.randrange(len(frames) + 1), frames[rng.randrange(len(frames))])
    return False


def swap_frames(frames: Frames, rng: random.Random) -> bool:
    if len(frames) >= 2:
        i, j = rng.sample(range(len(frames)), 2)
        frames[i], frames[j] = frames[j], frames[i]
    return False


def move_frame(frames: Frames, rng: random.Random) -> bool:
    if frames:
        frame = frames.pop(rng.randrange(len(frames)))
        frames.insert(rng.randrange(len(frames) + 1), frame)
    return False


def truncate(frames: Frames, rng: random.Random) -> bool:
    del frames[rng.randrange(len(frames) + 1) :]
    return False


def insert_empty(frames: Frames, rng: random.Random) -> bool:
    frames.insert(rng.randrange(len(frames) + 1), wire_pb2.Frame())
    return False


def resize_chunk(frames: Frames, rng: random.Random) -> bool:
    indices = _chunk_indices(frames)
    if indices:
        i = rng.choice(indices)
        data = frames[i].chunk
        data = data[: rng.randrange(len(data))] if rng.random() < 0.5 else data + bytes(rng.randint(1, 9))
        frames[i] = wire_pb2.Frame(chunk=data)
    return False


def mutate_end(frames: Frames, rng: random.Random) -> bool:
    ends = [i for i, f in enumerate(frames) if f.WhichOneof("body") == "end"]
    if ends:
        i = rng.choice(ends)
        total = frames[i].end.total_bytes
        total = rng.choice([0, min(total + 1, 2**64 - 1), max(total - 1, 0), 2**64 - 1])
        frames[i] = wire_pb2.Frame(end=wire_pb2.End(total_bytes=total))
    return False


def mutate_manifest(frames: Frames, rng: random.Random) -> bool:
    if not frames or frames[0].WhichOneof("body") != "manifest":
        return False
    first = _copy(frames[0])
    manifest = first.manifest
    choice = rng.choice(["kind", "shape", "byte_length", "encoding", "dtype", "name", "drop", "add", "clear_shape"])
    if choice == "kind":
        manifest.kind = rng.choice([0, 6, 7, 99, 2**31 - 1, -1])
    elif choice == "add":
        manifest.tensors.add(name="extra", dtype="float32", shape=[1], encoding=0, byte_length=4)
    elif manifest.tensors:
        header = manifest.tensors[rng.randrange(len(manifest.tensors))]
        if choice == "shape":
            if header.shape:
                header.shape[rng.randrange(len(header.shape))] = rng.choice([-1, 0, 2**62, rng.randint(0, 9)])
            else:
                header.shape.append(rng.randint(0, 3))
        elif choice == "clear_shape":
            del header.shape[:]
        elif choice == "byte_length":
            length = header.byte_length
            header.byte_length = rng.choice([0, min(length + 1, 2**64 - 1), length // 2, 2**64 - 1])
        elif choice == "encoding":
            header.encoding = rng.choice([0, 1, 2, 3, 4, 99, -5])
        elif choice == "dtype":
            header.dtype = rng.choice([*DTYPES, "complex64", "", "Float32", "torch.float32"])
        elif choice == "name":
            header.name = rng.choice(["", "W", header.name + "x"])
        elif choice == "drop":
            del manifest.tensors[rng.randrange(len(manifest.tensors))]
    frames[0] = first
    return False


# Each returns True when the stream stays acceptable by construction (payload corruption is not detectable,
# unless it makes a NaN or an infinity).
BENIGN: list[Callable[[Frames, random.Random], bool]] = [flip_byte, split_chunk, merge_chunks, header_only]
STRUCTURAL: list[Callable[[Frames, random.Random], bool]] = [
    drop_frame,
    duplicate_frame,
    swap_frames,
    move_frame,
    truncate,
    insert_empty,
    resize_chunk,
    mutate_end,
    mutate_manifest,
]


def test_corrupted_streams_either_decode_to_the_expected_specs_or_raise_wire_error() -> None:
    outcomes = {"ok": 0, "rejected": 0}
    reasons = set()
    for seed in range(300):
        rng = random.Random(1000 + seed)
        message = _random_message(rng)
        specs: list[TensorSpec] = specs_of(message.tensors)
        encoding = rng.choice(list(Encoding))
        frames = list(encode(message, encoding=encoding, chunk_bytes=rng.choice([1, 5, 16, 64])))
        ops = [rng.choice(BENIGN if rng.random() < 0.3 else STRUCTURAL) for _ in range(rng.randint(1, 3))]
        benign = all([op(frames, rng) for op in ops])
        label = f"seed {seed}: {[op.__name__ for op in ops]}"
        try:
            decoded = decode(iter(frames), lambda manifest, specs=specs: list(specs))
        except WireError as error:
            assert not benign or error.reason == "non_finite", f"{label}: an acceptable stream was rejected: {error}"
            assert error.reason in REASONS, label
            assert error.status == Status.INVALID_ARGUMENT, label
            outcomes["rejected"] += 1
            reasons.add(error.reason)
            continue
        outcomes["ok"] += 1
        assert list(decoded.tensors) == [s.name for s in specs], label
        for spec in specs:
            tensor = decoded.tensors[spec.name]
            assert tensor.dtype == spec.dtype, label
            assert tuple(tensor.shape) == spec.shape, label
        assert decoded.kind in set(Kind), label
    # Both sides were exercised, and most structural reasons came up.
    assert outcomes["ok"] >= 30 and outcomes["rejected"] >= 100, outcomes
    assert len(reasons) >= 7, reasons
