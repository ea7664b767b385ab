"""The top-k encoding (ENCODING_TOPK): the selection shared with AdaComp, the round trip dense or sparse, and
the receiver's checks of indices and counts."""

from __future__ import annotations

import pytest
import torch

from nodeagent._proto import wire_pb2
from nodeagent.wire import Encoding, Kind, Message, Status, TensorSpec, TopK, WireError, decode, encode, specs_of
from nodeagent.wire.message import _sampled_topk


def distinct(n: int, seed: int = 0) -> torch.Tensor:
    """n values of distinct magnitudes, in random order and with random signs."""
    generator = torch.Generator().manual_seed(seed)
    magnitudes = torch.randperm(n, generator=generator).float() + 1
    signs = torch.randint(0, 2, (n,), generator=generator).float() * 2 - 1
    return magnitudes * signs


@pytest.mark.parametrize("n,k", [(10, 3), (1000, 10), (1000, 1000), (5, 0), (1 << 20, 1000), (1 << 18, 5000)])
def test_select_keeps_the_largest_magnitudes_in_index_order(n, k):
    tensor = distinct(n, seed=n + k)
    chosen = TopK.select(tensor.view(-1, 1) if n % 2 == 0 else tensor, k)
    assert chosen.indices.dtype == torch.int32 and chosen.count == k
    assert bool((chosen.indices[1:] > chosen.indices[:-1]).all())
    expected = set(torch.topk(tensor.abs(), k).indices.tolist())
    assert set(chosen.indices.tolist()) == expected
    assert torch.equal(chosen.values, tensor[chosen.indices.long()])


def test_sampled_selection_falls_back_when_the_sample_misleads():
    # Mostly zeros with k large entries: a sampled threshold of 0 keeps everything, and the exact top-k follows.
    tensor = torch.zeros(1 << 17)
    tensor[torch.arange(0, 1 << 17, 97)] = torch.arange(1, (1 << 17) // 97 + 2).float()[: len(range(0, 1 << 17, 97))]
    k = 500
    index = _sampled_topk(tensor.abs(), k)
    assert set(index.tolist()) == set(torch.topk(tensor.abs(), k).indices.tolist())


def test_rate_is_adacomps_rule():
    assert TopK.rate(torch.randn(1000), 0.01).count == 10
    assert TopK.rate(torch.randn(50), 0.01).count == 1  # at least one entry
    assert TopK.rate(torch.randn(0), 0.01).count == 0
    assert TopK.rate(torch.randn(3, 7), 1.0).count == 21


def test_dense_puts_values_back_in_place():
    tensor = torch.tensor([[0.0, -5.0, 1.0], [4.0, 0.5, -3.0]])
    chosen = TopK.select(tensor, 3)
    assert chosen.shape == (2, 3)
    assert torch.equal(chosen.dense(), torch.tensor([[0.0, -5.0, 0.0], [4.0, 0.0, -3.0]]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16], ids=str)
def test_a_topk_value_travels_as_indices_and_values(dtype):
    tensor = distinct(4000, seed=1).view(40, 100).to(dtype)
    chosen = TopK.select(tensor, 40)
    message = Message(Kind.GRADIENT, 0, 1, {"g": chosen, "b": torch.ones(3)}, model_version=7)
    frames = list(encode(message, chunk_bytes=64))
    header = frames[0].manifest.tensors[0]
    assert (header.encoding, header.topk_count) == (Encoding.TOPK, 40)
    assert header.byte_length == 40 * (4 + dtype.itemsize)
    assert list(header.shape) == [40, 100] and header.dtype == str(dtype).removeprefix("torch.")
    specs = [TensorSpec("g", dtype, (40, 100)), TensorSpec("b", torch.float32, (3,))]
    dense = decode(frames, lambda manifest: specs)
    assert torch.equal(dense.tensors["g"], chosen.dense())
    assert dense.tensors["g"].dtype == dtype and dense.model_version == 7
    sparse = decode(frames, lambda manifest: specs, sparse=True)
    received = sparse.tensors["g"]
    assert isinstance(received, TopK)
    assert torch.equal(received.indices, chosen.indices) and torch.equal(received.values, chosen.values)
    assert received.shape == (40, 100)
    assert torch.equal(sparse.tensors["b"], torch.ones(3))  # raw tensors stay dense


def test_the_stream_encoding_selects_by_rate_for_floating_tensors_only():
    tensors = {"w": distinct(10_000, seed=3), "steps": torch.arange(5)}
    frames = list(encode(Message(Kind.DELTA, 0, 1, tensors), encoding=Encoding.TOPK, topk_rate=0.05))
    headers = {h.name: h for h in frames[0].manifest.tensors}
    assert headers["w"].encoding == Encoding.TOPK and headers["w"].topk_count == 500
    assert headers["steps"].encoding == Encoding.RAW and headers["steps"].topk_count == 0
    decoded = decode(frames, lambda manifest: specs_of(tensors))
    assert torch.equal(decoded.tensors["w"], TopK.rate(tensors["w"], 0.05).dense())
    assert torch.equal(decoded.tensors["steps"], tensors["steps"])


def test_encode_refuses_a_topk_of_a_non_floating_tensor():
    with pytest.raises(ValueError, match="floating"):
        list(encode(Message(Kind.GRADIENT, 0, 1, {"g": TopK(torch.tensor([0]), torch.tensor([3]), (4,))})))


# ------------------------------------------------------------------------------------------- hostile streams

SPEC = [TensorSpec("g", torch.float32, (10,))]


def topk_frames(indices: list[int], count: int | None = None, **header) -> list[wire_pb2.Frame]:
    values = torch.arange(1, len(indices) + 1, dtype=torch.float32)
    payload = torch.tensor(indices, dtype=torch.int32).numpy().tobytes() + values.numpy().tobytes()
    fields = dict(name="g", dtype="float32", shape=[10], encoding=Encoding.TOPK, topk_count=len(indices),
                  byte_length=len(payload))
    if count is not None:
        fields["topk_count"] = count
    fields.update(header)
    manifest = wire_pb2.Manifest(job_id="j", sender_rank=0, receiver_rank=1, kind=Kind.GRADIENT,
                                 tensors=[wire_pb2.TensorHeader(**fields)])
    return [
        wire_pb2.Frame(manifest=manifest),
        wire_pb2.Frame(chunk=payload),
        wire_pb2.Frame(end=wire_pb2.End(total_bytes=fields["byte_length"])),
    ]


@pytest.mark.parametrize(
    ("frames", "reason"),
    [
        (topk_frames([3, 1]), "bad_topk"),  # not increasing
        (topk_frames([2, 2]), "bad_topk"),  # repeated
        (topk_frames([0, 10]), "bad_topk"),  # out of range
        (topk_frames([-1, 4]), "bad_topk"),  # negative
        (topk_frames([0, 1], count=11, byte_length=88), "bad_manifest"),  # more entries than the tensor holds
        (topk_frames([0, 1], count=3), "bad_manifest"),  # byte_length does not fit the count
        (topk_frames([0, 1], dtype="int32"), "bad_manifest"),  # dtype differs from the spec
        (topk_frames([0, 1], encoding=Encoding.RAW), "bad_manifest"),  # topk_count on a raw tensor
    ],
    ids=["unsorted", "repeated", "past_the_end", "negative", "count_too_large", "count_vs_length", "dtype",
         "count_on_raw"],
)
def test_hostile_topk_streams_are_rejected(frames, reason):
    state = {"g": torch.full((10,), -1.0)}
    with pytest.raises(WireError) as error:
        state.update(decode(frames, lambda manifest: SPEC).tensors)
    assert error.value.reason == reason and error.value.status == Status.INVALID_ARGUMENT
    assert torch.equal(state["g"], torch.full((10,), -1.0))
    with pytest.raises(WireError):
        decode(frames, lambda manifest: SPEC, sparse=True)


def test_topk_is_refused_for_integer_specs():
    frames = topk_frames([0, 1], dtype="int32")
    with pytest.raises(WireError) as error:
        decode(frames, lambda manifest: [TensorSpec("g", torch.int32, (10,))])
    assert error.value.reason == "bad_manifest" and "does not fit" in error.value.detail


def test_an_empty_and_a_full_selection_are_valid():
    assert torch.equal(decode(topk_frames([]), lambda manifest: SPEC).tensors["g"], torch.zeros(10))
    full = decode(topk_frames(list(range(10))), lambda manifest: SPEC).tensors["g"]
    assert torch.equal(full, torch.arange(1, 11, dtype=torch.float32))


def test_an_unsorted_selection_is_sorted_for_the_wire_and_a_bad_one_refused():
    chosen = TopK(torch.tensor([7, 2, 5]), torch.tensor([7.0, 2.0, 5.0]), (10,))
    frames = list(encode(Message(Kind.GRADIENT, 0, 1, {"g": chosen})))
    received = decode(frames, lambda manifest: SPEC, sparse=True).tensors["g"]
    assert received.indices.tolist() == [2, 5, 7] and received.values.tolist() == [2.0, 5.0, 7.0]
    with pytest.raises(ValueError, match="repeat"):
        list(encode(Message(Kind.GRADIENT, 0, 1, {"g": TopK(torch.tensor([3, 3]), torch.ones(2), (10,))})))
    with pytest.raises(ValueError, match="outside"):
        list(encode(Message(Kind.GRADIENT, 0, 1, {"g": TopK(torch.tensor([3, 10]), torch.ones(2), (10,))})))
