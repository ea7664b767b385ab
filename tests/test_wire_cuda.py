"""The staging path for device tensors: chunk by chunk through a ring of pinned host buffers, on a side stream with
CUDA events. The same code is the CPU path when there is no GPU; each test here runs on the CPU always, and again
on CUDA when a device is present (those runs are marked `cuda`)."""

from __future__ import annotations

import queue
from concurrent import futures

import grpc
import pytest
import torch
from devices import DEVICES
from test_codec import assert_bit_equal, finite_sample

from nodeagent.algorithms.base import Snapshot
from nodeagent.metrics import Metrics
from nodeagent.rpc import GRPC_OPTIONS
from nodeagent.runtime.peer_service import PeerClient, PeerServicer, ServingState, add_peer_servicer
from nodeagent.wire import Encoding, Kind, Message, TensorSpec, specs_of
from nodeagent.wire.decoder import decode
from nodeagent.wire.encoder import plan
from nodeagent.wire.staging import StagedSink, StagedSource, source_for

pytestmark = pytest.mark.integration

WIRE = {Encoding.RAW: None, Encoding.FP16: torch.float16, Encoding.BF16: torch.bfloat16}
CHUNK = 1 << 16  # many staging buffers for the sizes below, so the ring wraps several times


def expected_after(tensor: torch.Tensor, encoding: Encoding) -> torch.Tensor:
    wire = WIRE[encoding]
    cpu = tensor.detach().cpu()
    return cpu if wire is None else cpu.to(wire).to(cpu.dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("encoding", list(WIRE), ids=lambda e: e.name)
def test_a_device_tensor_streams_chunk_by_chunk(device, encoding):
    tensor = finite_sample(torch.float32, (250_001,), seed=1).to(device)
    outgoing = plan(Message(Kind.PARAMS, 0, 1, {"w": tensor}), encoding=encoding, chunk_bytes=CHUNK)
    source = outgoing.sources[0]
    if device == "cuda" or encoding != Encoding.RAW:
        assert isinstance(source, StagedSource)
    decoded = decode(outgoing.serialized_frames(), lambda manifest: specs_of({"w": tensor}))
    assert decoded.tensors["w"].device.type == "cpu"
    assert_bit_equal(decoded.tensors["w"], expected_after(tensor, encoding))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("encoding", list(WIRE), ids=lambda e: e.name)
def test_a_stream_lands_on_the_device_chunk_by_chunk(device, encoding):
    tensor = finite_sample(torch.float32, (250_001,), seed=2)
    outgoing = plan(Message(Kind.PARAMS, 0, 1, {"w": tensor, "n": torch.arange(5)}), encoding=encoding,
                    chunk_bytes=CHUNK)
    specs = [TensorSpec("w", torch.float32, (250_001,)), TensorSpec("n", torch.int64, (5,))]
    decoded = decode(outgoing.serialized_frames(), lambda manifest: specs, device=device)
    result = decoded.tensors["w"]
    assert result.device.type == device
    assert_bit_equal(result.cpu(), expected_after(tensor, encoding))
    assert torch.equal(decoded.tensors["n"].cpu(), torch.arange(5))


@pytest.mark.parametrize("device", DEVICES)
def test_staged_sink_ring_takes_odd_pieces(device):
    values = finite_sample(torch.float32, (200_000,), seed=3)
    data = memoryview(values.to(torch.float16).view(torch.int16).numpy().tobytes())
    dest = torch.empty(200_000, device=device)
    sink = StagedSink(dest, torch.float16, CHUNK)
    for start in range(0, len(data), 99_999):
        sink.write(data[start : start + 99_999])
    sink.finish()
    assert_bit_equal(dest.cpu(), values.to(torch.float16).float())


@pytest.mark.parametrize("device", DEVICES)
def test_a_push_between_devices_over_a_lane(device):
    n = 400_000
    inbox: queue.Queue = queue.Queue()
    specs = [TensorSpec("w", torch.float32, (n,))]

    def state(rank: int, box: queue.Queue, encoding: Encoding = Encoding.RAW) -> ServingState:
        served = {(None, Kind.PARAMS): {"w": torch.ones(n, device=device)}}
        snapshot = Snapshot(rank=rank, clock=0, loss=0.0, served=served)
        return ServingState(
            job_id="j", node_id=f"n{rank}", rank=rank, algorithm_name="t", names={0: "n0", 1: "n1"},
            expected=lambda sender, kind: specs, snapshot=lambda: snapshot, inbox=box, encoding=encoding,
            chunk_bytes=CHUNK, max_message_bytes=1 << 30, device=device,
        )

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=GRPC_OPTIONS)
    served = state(1, inbox)
    servicer = PeerServicer(lambda: served, Metrics(), "test", lane_host="127.0.0.1")
    add_peer_servicer(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        client = PeerClient(f"127.0.0.1:{port}")
        tensor = finite_sample(torch.float32, (n,), seed=5).to(device)
        for encoding in WIRE:
            reply = client.exchange(state(0, queue.Queue(), encoding), Message(Kind.PARAMS, 0, 1, {"w": tensor}),
                                    timeout=20, metrics=Metrics())
            assert reply.tensors["w"].device.type == device
            assert torch.equal(reply.tensors["w"].cpu(), torch.ones(n))
            received = inbox.get_nowait().tensors["w"]
            assert received.device.type == device
            assert_bit_equal(received.cpu(), expected_after(tensor, encoding))
        assert client._direct, "the transfers used a (direct) lane"
        client.close()
    finally:
        servicer.close()
        server.stop(grace=None)


def test_without_a_gpu_everything_stays_on_the_cpu_path():
    tensor = torch.randn(100_000)
    assert not isinstance(source_for(tensor, torch.float32, CHUNK), StagedSource)  # sent from its own memory
    staged = source_for(tensor, torch.float16, CHUNK)
    assert isinstance(staged, StagedSource) and not staged.flat.is_cuda
    sink = StagedSink(torch.empty(100_000), torch.float16, CHUNK)
    sink.write(memoryview(torch.ones(100_000, dtype=torch.float16).view(torch.uint8).numpy()))
    sink.finish()
    assert not sink.cuda and sink.ring and all(not buffer.is_pinned() for buffer in sink.ring)
    assert torch.equal(sink.dest, torch.ones(100_000))
