"""Frames as bytes, staging and receive buffers: the fast paths of the codec give exactly what the protobuf
path gives, and reject exactly what it rejects."""

from __future__ import annotations

import gc
import itertools
import sys

import numpy as np
import pytest
import torch
from test_codec import HOSTILE, SPECS, _good_frames, assert_bit_equal, finite_sample, sample

from nodeagent._proto import wire_pb2
from nodeagent.wire import BufferPool, Encoding, Kind, Message, WireError, specs_of
from nodeagent.wire.decoder import Receiver, decode
from nodeagent.wire.encoder import encode, plan
from nodeagent.wire.frames import chunk_frame, counted, frame_body, serialize
from nodeagent.wire.staging import RING, STAGE_MIN_BYTES, StagedSink, source_for

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("size", [0, 1, 127, 128, 300, 16_383, 16_384, 1 << 20])
def test_hand_built_chunk_frames_are_protobuf_frames(size):
    payload = bytes(range(256)) * (size // 256) + bytes(size % 256)
    built = chunk_frame(memoryview(payload))
    assert built == wire_pb2.Frame(chunk=payload).SerializeToString()
    body, value = frame_body(built)
    assert body == "chunk" and bytes(value) == payload


def test_reading_a_chunk_frame_does_not_copy_its_payload():
    built = chunk_frame(b"x" * 1000)
    body, value = frame_body(built)
    assert body == "chunk" and isinstance(value, memoryview) and value.obj is built


def test_bytes_that_are_not_one_chunk_field_get_protobuf_semantics():
    end = wire_pb2.Frame(end=wire_pb2.End(total_bytes=4)).SerializeToString()
    # A chunk field followed by an end field: protobuf keeps the last member of the oneof.
    body, value = frame_body(chunk_frame(b"abcd") + end)
    assert body == "end" and value.total_bytes == 4
    assert frame_body(b"") == (None, None)
    with pytest.raises(WireError) as error:
        frame_body(b"\x12\x80")  # a length that never ends
    assert error.value.reason == "bad_frame"
    with pytest.raises(WireError):
        frame_body(b"\x12\x05abc")  # shorter than its length


def test_serialized_frames_are_the_frames_serialized():
    tensors = {"w": sample(torch.float32, (5, 7), seed=1), "b": sample(torch.int8, (9,), seed=2)}
    outgoing = plan(Message(Kind.PARAMS, 0, 1, tensors, clock=4), job_id="j", chunk_bytes=16)
    assert list(outgoing.serialized_frames()) == [f.SerializeToString() for f in outgoing.frames()]
    assert serialize(b"as is") == b"as is"


def test_counted_reports_the_chunk_bytes_of_frames_and_of_serialized_frames():
    tensors = {"w": sample(torch.float32, (5, 7), seed=1), "b": sample(torch.int8, (9,), seed=2)}
    outgoing = plan(Message(Kind.PARAMS, 0, 1, tensors), chunk_bytes=16)
    for frames in (list(outgoing.frames()), list(outgoing.serialized_frames())):
        seen: list[int] = []
        assert list(counted(frames, seen.append)) == frames
        assert seen == [16] * 8 + [12, 9]  # chunks of at most 16 bytes, tensor by tensor


@pytest.mark.parametrize(("build", "reason"), [h[1:3] for h in HOSTILE], ids=[h[0] for h in HOSTILE])
def test_hostile_streams_as_bytes_are_rejected_for_the_same_reason(build, reason):
    frames = [f.SerializeToString() for f in build(_good_frames())]
    with pytest.raises(WireError) as error:
        decode(frames, lambda manifest: list(SPECS))
    assert error.value.reason == reason


def test_good_stream_as_bytes_matches_the_protobuf_path():
    frames = _good_frames()
    as_bytes = decode([f.SerializeToString() for f in frames], lambda manifest: list(SPECS))
    as_frames = decode(frames, lambda manifest: list(SPECS))
    for name in ("w", "b"):
        assert_bit_equal(as_bytes.tensors[name], as_frames.tensors[name])


# ----------------------------------------------------------------------------------------------- staging


@pytest.mark.parametrize("encoding", [Encoding.FP16, Encoding.BF16], ids=lambda e: e.name)
@pytest.mark.parametrize("chunk_bytes", [1000, 1 << 16, 1 << 20])
def test_chunked_conversion_equals_whole_tensor_conversion(encoding, chunk_bytes):
    tensor = finite_sample(torch.float32, (700_001,), seed=3)  # many staging buffers, a ragged last one
    wire = {Encoding.FP16: torch.float16, Encoding.BF16: torch.bfloat16}[encoding]
    outgoing = plan(Message(Kind.PARAMS, 0, 1, {"t": tensor}), encoding=encoding, chunk_bytes=chunk_bytes)
    payload = b"".join(bytes(piece) for piece in outgoing.pieces(chunk_bytes))
    assert payload == tensor.to(wire).view(torch.int16).numpy().tobytes()
    frames = list(outgoing.serialized_frames())
    decoded = decode(frames, lambda manifest: specs_of({"t": tensor})).tensors["t"]
    assert_bit_equal(decoded, tensor.to(wire).to(torch.float32))


def test_staging_buffers_are_a_few_chunks_not_a_tensor():
    tensor = torch.randn(2_000_000)  # 8 MB
    source = source_for(tensor, torch.float16, 1 << 16)
    buffers = {}
    total = 0
    for piece in source.pieces(1 << 16):
        buffers[id(piece.obj)] = piece.obj.nbytes
        total += len(piece)
    assert total == 4_000_000
    assert len(buffers) <= RING and max(buffers.values()) <= max(1 << 16, STAGE_MIN_BYTES)


def test_a_raw_cpu_tensor_is_sent_from_its_own_memory():
    tensor = torch.randn(1000)
    pieces = list(source_for(tensor, torch.float32, 1 << 20).pieces(None))
    assert len(pieces) == 1
    assert np.shares_memory(np.asarray(pieces[0]), tensor.numpy())


@pytest.mark.parametrize("piece_sizes", [[1], [3, 5], [65_537], [1 << 20]], ids=str)
def test_staged_sink_takes_any_piece_boundaries(piece_sizes):
    values = finite_sample(torch.float32, (300_000,), seed=4)
    wire = values.to(torch.bfloat16)
    data = memoryview(wire.view(torch.int16).numpy().tobytes())
    dest = torch.empty(300_000)
    sink = StagedSink(dest, torch.bfloat16, 1 << 16)
    offset = 0
    index = 0
    while offset < len(data):
        size = min(piece_sizes[index % len(piece_sizes)], len(data) - offset)
        if size > 10_000 or index < 2000:
            sink.write(data[offset : offset + size])
            offset += size
        else:  # keep the test quick: the rest in one piece
            sink.write(data[offset:])
            offset = len(data)
        index += 1
    sink.finish()
    assert_bit_equal(dest, wire.to(torch.float32))


def test_a_lane_payload_fills_staged_and_direct_sinks():
    tensors = {"h": finite_sample(torch.float32, (100_000,), seed=5), "i": torch.arange(7)}
    outgoing = plan(Message(Kind.PARAMS, 0, 1, tensors), encoding=Encoding.FP16, chunk_bytes=1 << 16)
    payload = memoryview(b"".join(bytes(p) for p in outgoing.pieces(None)))

    class Reader:
        offset = 0

        def read_into(self, view: memoryview) -> None:
            view[:] = payload[self.offset : self.offset + len(view)]
            self.offset += len(view)

        def abort(self) -> None:
            pass

    stream_id = b"s" * 12
    frames = outgoing.lane_frames([b"t" * 32], stream_id, [(0, outgoing.total)])
    header = next(p for p in outgoing.lane_pieces(stream_id))
    payload = memoryview(bytes(header) + bytes(payload))
    decoded = decode(frames, lambda manifest: specs_of(tensors), lanes=lambda lane, manifest: Reader())
    assert_bit_equal(decoded.tensors["h"], tensors["h"].half().float())
    assert torch.equal(decoded.tensors["i"], tensors["i"])


@pytest.mark.parametrize("count", [1, 2, 3, 4, 7])
def test_shares_tile_the_payload_on_whole_elements(count):
    tensors = {"a": torch.randn(10_001), "flags": torch.ones(13, dtype=torch.bool), "e": torch.empty(0),
               "d": torch.randn(777, dtype=torch.float64), "h": torch.randn(30_000)}
    outgoing = plan(Message(Kind.PARAMS, 0, 1, tensors), encoding=Encoding.FP16)
    shares = outgoing.shares(count)
    assert 1 <= len(shares) <= count
    assert shares[0][0] == 0 and shares[-1][1] == outgoing.total
    assert all(a < b for a, b in shares) and all(s[1] == t[0] for s, t in itertools.pairwise(shares))
    starts = np.cumsum([0] + [s.nbytes for s in outgoing.sources])
    for start, _ in shares[1:]:
        tensor_start = max(t for t in starts if t <= start)
        assert (start - tensor_start) % 64 == 0
    # The parts reassemble the payload.
    whole = b"".join(bytes(p) for p in outgoing.pieces(None))
    parts = b"".join(b"".join(bytes(p) for p in list(outgoing.lane_pieces(b"x" * 12, a, b))[1:]) for a, b in shares)
    assert parts == whole


def test_a_payload_too_small_to_split_is_one_share():
    outgoing = plan(Message(Kind.PARAMS, 0, 1, {"a": torch.randn(3)}))
    assert outgoing.shares(4) == [(0, 12)]
    assert plan(Message(Kind.PARAMS, 0, 1, {})).shares(4) == [(0, 0)]


# --------------------------------------------------------------------------------------------- the pool


def test_pool_reuses_a_buffer_only_when_it_is_free():
    pool = BufferPool(per_size=2)
    first = pool.take(1000)
    held = torch.from_numpy(first[64:128]).view(torch.float32)
    second = pool.take(1000)
    assert not np.shares_memory(first, second)
    del first, second
    third = pool.take(1000)  # the second buffer is free again; the first is held through `held`
    held_array = held.numpy()
    overlaps = np.shares_memory(third, held_array)
    del third, held_array
    assert not overlaps
    assert pool.kept_bytes == 2000
    extra = pool.take(1000), pool.take(1000)  # both kept buffers busy: a third, not kept
    assert pool.kept_bytes == 2000 and len({id(b) for b in extra}) == 2
    del extra, held
    gc.collect()
    assert [sys.getrefcount(buffer) for buffer in pool._buffers[1000]] == [3, 3]  # the list, the loop, the call


def test_decoding_into_a_pool_hands_out_views_of_one_arena():
    tensors = {"w": sample(torch.float32, (33,), seed=6), "flags": sample(torch.bool, (5,), seed=7),
               "d": sample(torch.float64, (3, 3), seed=8)}
    frames = list(encode(Message(Kind.PARAMS, 0, 1, tensors), chunk_bytes=7))
    pool = BufferPool()
    decoded = decode(frames, lambda manifest: specs_of(tensors), pool=pool)
    for name, tensor in tensors.items():
        result = decoded.tensors[name]
        assert torch.equal(result.view(torch.uint8), tensor.view(torch.uint8))
        assert result.data_ptr() % 64 == 0
    del result
    arena = next(iter(pool._buffers.values()))[0]
    held = sys.getrefcount(arena) > 3  # this variable, the call, the pool, and the decoded tensors
    del arena
    assert held
    again = decode(frames, lambda manifest: specs_of(tensors), pool=pool)
    assert again.tensors["w"].data_ptr() != decoded.tensors["w"].data_ptr()
    pointer = decoded.tensors["w"].data_ptr()
    del decoded
    third = decode(frames, lambda manifest: specs_of(tensors), pool=pool)
    assert third.tensors["w"].data_ptr() == pointer


def test_a_rejected_stream_leaves_pooled_buffers_free():
    frames = _good_frames()[:-1]  # no end frame
    pool = BufferPool()
    receiver = Receiver(lambda manifest: list(SPECS), pool=pool)
    for frame in frames:
        receiver.feed(frame)
    with pytest.raises(WireError):
        receiver.result()
    del receiver
    gc.collect()  # the exception's traceback held the receiver's frame
    assert [sys.getrefcount(arena) for arena in next(iter(pool._buffers.values()))] == [3]
