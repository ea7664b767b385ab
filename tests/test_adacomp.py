"""AdaComp: top-k selection, residual, the compact encoding against hostile input, and the server's staleness."""

import io
import struct

import pytest
import torch

from nodeagent.jobspec import ModelSpec
from nodeagent.ps import AdaCompServer, ProtocolError
from nodeagent.training.models import build_model
from nodeagent.wire import WireError
from nodeagent.wire.sparse import Codec, Residual, compress, decode_sparse, densify, encode_sparse, select_topk, traffic

pytestmark = pytest.mark.unit


def vec(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def idx(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


# -- selection and residual -------------------------------------------------------------------------------------


def test_topk_per_tensor_keeps_at_least_one_entry_of_tiny_tensors():
    grad = torch.cat([vec(-0.5), vec(0.1, -0.3, 0.2), torch.arange(250, dtype=torch.float32) / 100])
    selected = select_topk(grad, [1, 3, 250], rate=0.01)
    assert [i.tolist() for i, _ in selected] == [[0], [1], [248, 249]]
    assert [v.tolist() for _, v in selected] == [[-0.5], pytest.approx([-0.3]), pytest.approx([2.48, 2.49])]


def test_topk_breaks_ties_at_the_threshold_by_lowest_index():
    selected = select_topk(vec(1, -3, 3, 2, -3, 5, 3, 3), [5, 3], rate=0.4)  # k = 2 and 1
    assert [i.tolist() for i, _ in selected] == [[1, 2], [0]]
    assert [v.tolist() for _, v in selected] == [[-3.0, 3.0], [5.0]]
    above_and_ties = select_topk(vec(5, -3, 3, 3), [4], rate=0.5)
    assert above_and_ties[0][0].tolist() == [0, 1]
    with pytest.raises(ValueError, match="non-finite"):
        select_topk(vec(1, float("nan")), [2], rate=0.5)
    with pytest.raises(ValueError, match="add up to 3"):
        select_topk(vec(1, 2), [1, 2], rate=0.5)


def test_residual_adds_what_was_not_sent_to_the_next_gradient():
    residual = Residual(4)
    _, sent = compress(vec(1, 0.5, 0.25, 0.125), [4], rate=0.25, codec=Codec.FP32, residual=residual)
    assert sent[0][0].tolist() == [0] and residual.error.tolist() == [0, 0.5, 0.25, 0.125]
    _, sent = compress(vec(0, 0.125, 0.25, 0.375), [4], rate=0.25, codec=Codec.FP32, residual=residual)
    assert sent[0][0].tolist() == [1] and sent[0][1].tolist() == [0.625]
    assert residual.error.tolist() == [0, 0, 0.5, 0.5]
    _, sent = compress(vec(0, 0, 0, 0), [4], rate=0.25, codec=Codec.FP32)  # off: nothing carried over
    assert sent[0][1].tolist() == [0.0]


def test_residual_feeds_back_the_quantisation_error_too():
    generator = torch.Generator().manual_seed(3)
    residual, total_sent, total_grad = Residual(300), torch.zeros(300), torch.zeros(300)
    for _ in range(20):
        grad = torch.randn(300, generator=generator)
        total_grad += grad
        _, sent = compress(grad, [100, 200], rate=0.05, codec=Codec.INT8, residual=residual)
        total_sent += densify(sent, [100, 200])
    # Nothing is lost: what was sent plus what is still owed is exactly the sum of the gradients.
    torch.testing.assert_close(total_sent + residual.error, total_grad, atol=1e-5, rtol=0)


# -- the compact encoding ---------------------------------------------------------------------------------------


def random_sparse(sizes, rate, seed):
    grad = torch.randn(sum(sizes), generator=torch.Generator().manual_seed(seed))
    return select_topk(grad, sizes, rate)


@pytest.mark.parametrize("codec", list(Codec))
def test_encoding_round_trip(codec):
    sizes = [3, 70000, 130, 1]
    sparse = random_sparse(sizes, 0.02, seed=1)
    decoded = decode_sparse(encode_sparse(sparse, sizes, codec), sizes)
    for (indices, values), (got_indices, got_values) in zip(sparse, decoded, strict=True):
        assert torch.equal(got_indices, indices) and got_values.dtype == torch.float32
        if codec == Codec.FP32:
            assert torch.equal(got_values, values)
        elif codec == Codec.FP16:
            assert torch.equal(got_values, values.half().float())
        else:
            step = values.abs().max() / 127
            assert (got_values - values).abs().max() <= step / 2 + 1e-7
    empty = [(idx(), vec()), (idx(4), vec(2.5))]
    assert [v.tolist() for _, v in decode_sparse(encode_sparse(empty, [2, 5], codec), [2, 5])] == [[], [2.5]]


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def payload(codec: int, tensors: list[tuple[list[int], bytes]], count: int | None = None, scale: bytes = b"") -> bytes:
    """A hand-built payload: per tensor its gaps and raw value bytes, after `scale` (int8)."""
    parts = [bytes([codec]), varint(len(tensors) if count is None else count)]
    for gaps, raw in tensors:
        parts += [varint(len(gaps)), scale, *map(varint, gaps), raw]
    return b"".join(parts)


def f32(*values: float) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


def test_the_format_is_the_documented_one():
    sparse = [(idx(1, 2, 300), vec(1.0, -2.0, 0.5))]
    assert encode_sparse(sparse, [400], Codec.FP32) == payload(0, [([1, 0, 297], f32(1.0, -2.0, 0.5))])
    int8 = encode_sparse(sparse, [400], Codec.INT8)
    assert int8 == b"\x02\x01\x03" + f32(2.0 / 127) + b"\x01\x00\xa9\x02" + bytes([64, 256 - 127, 32])


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "empty payload"),
        (b"\x07\x01", "unknown codec 7"),
        (payload(0, [([4], f32(1.0))]), r"tensor 0: index gap 4 out of range for a tensor of 4"),
        (payload(0, [([2, 1], f32(1.0, 1.0))]), r"tensor 0: index 4 out of range \[0, 4\)"),
        (payload(0, [([0, 0, 0, 0, 0], f32(*[1.0] * 5))]), "tensor 0: 5 entries for a tensor of 4"),
        (payload(0, [([1], f32(1.0))]) + b"\x00", "1 trailing bytes after the last tensor"),
        (payload(0, [([1], f32(1.0))], count=2), "payload has 2 tensors, the model 1"),
        (payload(2, [([1], b"\x01")], scale=f32(-1.0)), "tensor 0: scale -1.0 is not a finite non-negative number"),
        (b"\x00\x01\x01\x80\x00" + f32(1.0), "tensor 0 indices: non-canonical varint"),
        (b"\x00\x01\x01" + b"\xff" * 12, "tensor 0 indices: a varint at byte 3 or after is longer than 9 bytes"),
        (b"\x00\x01\x81", r"truncated tensor 0 count: 0 of 1 varints at byte 2"),
    ],
)
def test_decoder_rejects_hostile_payloads(data, message):
    with pytest.raises(ValueError, match=message):
        decode_sparse(data, [4])


@pytest.mark.parametrize(
    "data",
    [
        payload(0, [([1], f32(float("nan")))]),
        payload(1, [([1], struct.pack("<e", float("inf")))]),
        payload(2, [([1], bytes([127]))], scale=f32(3e38)),  # 127 * 3e38 overflows float32
    ],
    ids=["fp32_nan", "fp16_inf", "int8_overflow"],
)
def test_decoder_refuses_nonfinite_values_as_any_stream(data):
    with pytest.raises(WireError) as refused:
        decode_sparse(data, [4])
    assert refused.value.reason == "non_finite" and "tensor 0: values have non-finite entries" in str(refused.value)


@pytest.mark.parametrize("codec", list(Codec))
def test_every_truncation_of_a_valid_payload_is_rejected(codec):
    sizes = [300, 5]
    valid = encode_sparse(random_sparse(sizes, 0.03, seed=2), sizes, codec)
    for end in range(len(valid)):
        with pytest.raises(ValueError):
            decode_sparse(valid[:end], sizes)


def test_encoder_refuses_what_it_cannot_represent():
    with pytest.raises(ValueError, match="strictly increasing"):
        encode_sparse([(idx(2, 1), vec(1, 1))], [4], Codec.FP32)
    with pytest.raises(ValueError, match="strictly increasing in \\[0, 4\\)"):
        encode_sparse([(idx(4), vec(1))], [4], Codec.FP32)
    with pytest.raises(ValueError, match="overflow FP16"):
        encode_sparse([(idx(0), vec(1e6))], [4], Codec.FP16)


def test_cnn_push_is_150x_smaller_than_dense_asgd():
    sizes = [p.numel() for p in build_model(ModelSpec(name="cnn")).parameters()]
    assert sum(sizes) == 421_642
    grad = torch.randn(sum(sizes), generator=torch.Generator().manual_seed(0))
    rows = {}
    for rate in (0.01, 0.005):
        for codec in Codec:
            rows[rate, codec] = traffic(compress(grad, sizes, rate, codec)[0], sizes)
            t = rows[rate, codec]
            print(
                f"rate {rate} {codec.name}: {t.entries} entries, {t.sparse_bytes} B, "
                f"{t.bytes_per_entry:.2f} B/entry, {t.ratio:.1f}x below dense {t.dense_bytes} B"
            )
    naive = rows[0.01, Codec.INT8].dense_bytes / (8 * rows[0.01, Codec.INT8].entries)  # int32 index + fp32 value
    assert 49 < naive < 51
    assert rows[0.01, Codec.FP16].ratio < 150 < rows[0.01, Codec.INT8].ratio  # rate 0.01 needs 8-bit values
    assert rows[0.005, Codec.FP16].ratio > 150  # or half the rate (with the residual) and fp16 values
    assert rows[0.01, Codec.INT8].bytes_per_entry < 2.4


# -- the server -------------------------------------------------------------------------------------------------


SIZES = [8, 4]


def push_ones(server: AdaCompServer, worker: int, version: int, first: list[int], second: list[int]):
    """Push gradient 1 at the given indices of the two tensors; return the result and w's change (lr = 1)."""
    before = server.w.clone()
    update = [(idx(*first), torch.ones(len(first))), (idx(*second), torch.ones(len(second)))]
    result = server.push(worker, update, version)
    change = before - server.w
    return result, [change[:8].tolist(), change[8:].tolist()]


def test_staleness_counts_only_the_last_delay_pushes():
    server = AdaCompServer(torch.zeros(12), num_workers=3, tensor_sizes=SIZES, lr=1.0, max_delay=3)
    script = [
        # worker, version, tensor 0 indices, tensor 1 indices, expected change of tensor 0 and tensor 1
        (0, 0, [0, 1, 2], [0], [1, 1, 1, 0, 0, 0, 0, 0], [1, 0, 0, 0]),  # delay 0
        (1, 0, [1, 2, 3], [0], [0, 1, 1, 1, 0, 0, 0, 0], [1, 0, 0, 0]),  # delay 1: staleness 1, 1, 0 | 1
        (2, 0, [1, 2, 5], [0, 1], [0, 0.5, 0.5, 0, 0, 1, 0, 0], [0.5, 1, 0, 0]),  # delay 2: overlap with both
        (0, 1, [1, 2, 3], [0], [0, 0.5, 0.5, 1, 0, 0, 0, 0], [0.5, 0, 0, 0]),  # delay 2: push 1 is out of range
        (1, 4, [1, 2], [0], [0, 1, 1, 0, 0, 0, 0, 0], [1, 0, 0, 0]),  # delay 0: the history does not count
        (2, 2, [2, 6], [3], [0, 0, 1 / 3, 0, 0, 0, 1, 0], [0, 0, 0, 1]),  # delay 3 = window; disjoint 6 and 3
    ]
    for step, (worker, version, first, second, change_0, change_1) in enumerate(script):
        result, change = push_ones(server, worker, version, first, second)
        assert result.applied and result.release == (worker,)
        assert (result.version, result.delay) == (step + 1, step - version)
        assert change == [pytest.approx(change_0), pytest.approx(change_1)], f"push {step + 1}"
    assert len(server.window) == 3  # bounded: only the last max_delay pushes are kept
    stale, change = push_ones(server, 0, 2, [0], [0])  # delay 4 > window of 3
    assert not stale.applied and stale.version == 6 and "delay 4 exceeds" in stale.rejected
    assert change == [[0.0] * 8, [0.0] * 4]


def test_push_validation():
    server = AdaCompServer(torch.zeros(12), num_workers=2, tensor_sizes=SIZES, lr=1.0, max_delay=3)
    with pytest.raises(ProtocolError, match="update has 1 tensors, the model 2"):
        server.push(0, [(idx(0), vec(1))], 0)
    with pytest.raises(ProtocolError, match="strictly increasing"):
        server.push(0, [(idx(1, 1), vec(1, 1)), (idx(), vec())], 0)
    with pytest.raises(ProtocolError, match="strictly increasing in \\[0, 4\\)"):
        server.push(0, [(idx(), vec()), (idx(4), vec(1))], 0)
    with pytest.raises(ProtocolError, match="non-finite"):
        server.push(0, [(idx(0), vec(float("inf"))), (idx(), vec())], 0)
    with pytest.raises(ProtocolError, match="worker version 1"):
        server.push(0, [(idx(0), vec(1)), (idx(), vec())], 1)
    assert server.version == 0 and not server.window


def test_delta_pull_carries_the_entries_changed_since_the_workers_version():
    w0 = torch.arange(12, dtype=torch.float32)
    server = AdaCompServer(w0, num_workers=2, tensor_sizes=SIZES, lr=0.5, max_delay=2)
    models = [server.pull(0)[0]]
    for first, second in [([0, 3], [1]), ([3, 7], []), ([5], [2, 3])]:
        push_ones(server, 1, server.version, first, second)
        models.append(server.pull(0)[0])
    for since in (3, 2, 1):
        delta = server.pull_delta(0, since)
        assert delta.version == 3 and delta.indices is not None
        model = models[since].clone()
        model[delta.indices] = delta.values
        assert torch.equal(model, server.w)
    assert server.pull_delta(0, 3).indices.numel() == 0
    assert server.pull_delta(0, 1).indices.tolist() == [3, 5, 7, 10, 11]
    full = server.pull_delta(0, 0)  # older than the window: the full model
    assert full.indices is None and torch.equal(full.values, server.w)
    # The delta travels in the compact encoding, with exact fp32 values.
    delta = server.pull_delta(0, 1)
    encoded = encode_sparse([(delta.indices, delta.values)], [12], Codec.FP32)
    assert torch.equal(decode_sparse(encoded, [12])[0][1], delta.values)


def test_state_round_trip_restores_the_window():
    def make():
        return AdaCompServer(torch.zeros(12), num_workers=3, tensor_sizes=SIZES, lr=1.0, max_delay=3)

    original = make()
    for worker, version, first, second in [(0, 0, [0, 1], [0]), (1, 0, [1], []), (2, 1, [1, 2], [0]), (0, 2, [1], [3])]:
        push_ones(original, worker, version, first, second)
    buffer = io.BytesIO()
    torch.save(original.state_dict(), buffer)
    buffer.seek(0)
    restored = make()
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    for server in (original, restored):
        outcomes = [push_ones(server, 1, 1, [1, 2], [0, 3]), push_ones(server, 2, 4, [1], [3])]
        # delay 3: index 1 was touched by the 3 pushes of the window, the others by one
        assert outcomes[0][1] == [pytest.approx([0, 1 / 3, 1, 0, 0, 0, 0, 0]), [1, 0, 0, 1]]
    assert torch.equal(original.w, restored.w) and original.version == restored.version == 6
    bad = original.state_dict()
    bad["window_lengths"] = bad["window_lengths"][:-1]
    with pytest.raises(ValueError, match="window_lengths"):
        make().load_state_dict(bad)
