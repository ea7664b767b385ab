"""Lanes: the peer service's side connections for payload bytes, over real gRPC and TCP on loopback.

Streams on lanes are validated exactly like streams in frames: a bad manifest, a lane of another rank or job, a
stalled or truncated payload, a header out of step: each is rejected whole with INVALID_ARGUMENT, counted, and
leaves the node's inbox and state untouched; the lane is closed and the next stream opens another. Beside a
mutual-TLS channel the lanes are sealed (AES-256-GCM records, the key granted over the channel): a lane without
the key, or a byte changed on the way, delivers nothing.
"""

from __future__ import annotations

import contextlib
import queue
import random
import secrets
import socket
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch

from nodeagent._proto import peer_pb2, peer_pb2_grpc, wire_pb2
from nodeagent.algorithms.base import SendFailed, Snapshot
from nodeagent.metrics import Metrics
from nodeagent.rpc import GRPC_OPTIONS
from nodeagent.runtime.peer_service import GrpcPeers, PeerClient, PeerServicer, ServingState, add_peer_servicer
from nodeagent.security import pki
from nodeagent.security.pki import Role
from nodeagent.security.tls import Credentials, TlsDir, Transport
from nodeagent.wire import Encoding, Kind, Message, TensorSpec, WireError, specs_of
from nodeagent.wire import lane as lane_module
from nodeagent.wire.encoder import plan
from nodeagent.wire.frames import LANE_HEADER, LANE_MAGIC, new_stream_id
from nodeagent.wire.lane import (
    KEY_BYTES,
    MAX_HANDSHAKES,
    MAX_HANDSHAKES_PER_SOURCE,
    READY,
    RECORD_BYTES,
    RECORD_LENGTH,
    SEAL_IN_PLACE_BYTES,
    TOKEN_BYTES,
    LaneHub,
    LaneSocket,
    dial,
)

pytestmark = pytest.mark.integration

JOB = "job-lanes"
N = 300_000  # 1.2 MB: several staging chunks, and more than a loopback socket buffers at once


@pytest.fixture(autouse=True)
def payload_lanes_only(monkeypatch):
    """This module tests payload lanes beside gRPC calls: the path of payloads striped over several lanes, and of
    every call to a peer that serves no direct lanes (tests/test_direct_lanes.py tests those). A client that is
    refused a direct lane takes this path; here it does not ask."""
    monkeypatch.setattr(PeerClient, "_direct_lane", lambda self, state, timeout: None)


def make_state(rank: int, inbox: queue.Queue, served: dict, specs: dict, **fields) -> ServingState:
    def expected(sender: int, kind: Kind) -> list[TensorSpec]:
        if sender not in specs:
            raise WireError("not_neighbor", f"rank {sender} is not a neighbour")
        return specs[sender]

    snapshot = Snapshot(rank=rank, clock=5, loss=0.5, served={(None, Kind.PARAMS): served})
    values = dict(
        job_id=JOB, node_id=f"n{rank}", rank=rank, algorithm_name="test", names={0: "n0", 1: "n1", 2: "n2"},
        expected=expected, snapshot=lambda: snapshot, inbox=inbox, encoding=Encoding.RAW, chunk_bytes=1 << 16,
        max_message_bytes=1 << 30,
    )
    values.update(fields)
    return ServingState(**values)


class Node:
    """Rank 1 serving on loopback with lanes (or without); with a `transport`, gRPC under its mutual TLS and the
    lanes sealed."""

    def __init__(self, lanes: bool = True, transport: Transport | None = None):
        self.inbox: queue.Queue = queue.Queue()
        self.metrics = Metrics()
        self.served = {"w": torch.arange(N, dtype=torch.float32)}
        specs = [TensorSpec("w", torch.float32, (N,))]
        self.state = make_state(1, self.inbox, self.served, {0: specs, 2: specs})
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=GRPC_OPTIONS)
        self.servicer = PeerServicer(lambda: self.state, self.metrics, "test", lane_host="127.0.0.1" if lanes else None,
                                     secure=transport is not None)
        add_peer_servicer(self.servicer, self.server)
        if transport is None:
            port = self.server.add_insecure_port("127.0.0.1:0")
        else:
            port = transport.bind(self.server, "127.0.0.1:0")
        self.address = f"127.0.0.1:{port}"
        self.server.start()

    def close(self) -> None:
        self.servicer.close()
        self.server.stop(grace=None)

    def sample(self, name: str, **labels) -> float:
        return self.metrics.registry.get_sample_value(name, labels) or 0.0

    def rejections(self, reason: str) -> float:
        return self.sample("peertrain_stream_rejections_total", src="unknown", dst="n1", reason=reason)

    def open_lanes(self) -> int:
        assert self.servicer.lanes is not None
        return len(self.servicer.lanes._lanes)


@pytest.fixture
def node():
    served = Node()
    yield served
    served.close()


def client_state(rank: int = 0, **fields) -> ServingState:
    specs = [TensorSpec("w", torch.float32, (N,))]
    return make_state(rank, queue.Queue(), {}, {1: specs}, **fields)


def message(rank: int = 0, seed: int = 0) -> Message:
    generator = torch.Generator().manual_seed(seed)
    return Message(Kind.PARAMS, rank, 1, {"w": torch.randn(N, generator=generator)}, clock=3)


# ------------------------------------------------------------------------------------------- round trips


def test_push_exchange_pull_travel_on_one_lane_and_count_as_before(node):
    client = PeerClient(node.address)
    state, metrics = client_state(), Metrics()
    sent = message()
    client.push(state, sent, timeout=10, metrics=metrics)
    received = node.inbox.get_nowait()
    assert torch.equal(received.tensors["w"], sent.tensors["w"]) and received.clock == 3
    reply = client.exchange(state, sent, timeout=10, metrics=metrics)
    assert torch.equal(reply.tensors["w"], node.served["w"]) and reply.sender == 1 and reply.clock == 5
    assert torch.equal(node.inbox.get_nowait().tensors["w"], sent.tensors["w"])
    pulled = client.pull(state, 1, Kind.PARAMS, timeout=10, metrics=metrics)
    assert torch.equal(pulled.tensors["w"], node.served["w"])
    # All three calls used one lane, granted once.
    assert len(client._idle[(JOB, 0)]) == 1 and node.open_lanes() == 1
    payload = N * 4
    assert node.sample("peertrain_edge_bytes_received_total", job_id=JOB, src="n0", dst="n1") == 2 * payload
    assert node.sample("peertrain_edge_messages_received_total", job_id=JOB, src="n0", dst="n1") == 2
    assert node.sample("peertrain_edge_bytes_sent_total", job_id=JOB, src="n1", dst="n0") == 2 * payload
    assert node.sample("peertrain_edge_messages_sent_total", job_id=JOB, src="n1", dst="n0") == 2
    client_sample = metrics.registry.get_sample_value
    assert client_sample("peertrain_edge_bytes_sent_total", {"job_id": JOB, "src": "n0", "dst": "n1"}) == 2 * payload
    received = client_sample("peertrain_edge_bytes_received_total", {"job_id": JOB, "src": "n1", "dst": "n0"})
    assert received == 2 * payload
    assert client_sample("peertrain_edge_messages_sent_total", {"job_id": JOB, "src": "n0", "dst": "n1"}) == 2
    assert client_sample("peertrain_exchange_seconds_count", {"job_id": JOB, "src": "n0", "dst": "n1"}) == 3
    client.close()


@pytest.mark.parametrize("encoding", [Encoding.FP16, Encoding.BF16], ids=lambda e: e.name)
def test_lossy_encodings_on_a_lane(node, encoding):
    client = PeerClient(node.address)
    sent = message(seed=1)
    client.push(client_state(encoding=encoding), sent, timeout=10, metrics=Metrics())
    wire = {Encoding.FP16: torch.float16, Encoding.BF16: torch.bfloat16}[encoding]
    received = node.inbox.get_nowait().tensors["w"]
    assert received.dtype == torch.float32
    assert torch.equal(received, sent.tensors["w"].to(wire).to(torch.float32))
    assert node.sample("peertrain_edge_bytes_received_total", job_id=JOB, src="n0", dst="n1") == N * 2
    assert client._idle[(JOB, 0)], "the lane was used"
    client.close()


def test_a_peer_without_lanes_gets_frames_and_the_client_remembers():
    plain = Node(lanes=False)
    try:
        client = PeerClient(plain.address)
        state = client_state()
        with pytest.raises(grpc.RpcError) as refused:
            client.stub.OpenLane(peer_pb2.LaneRequest(job_id=JOB, requester_rank=0), timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
        sent = message()
        client.push(state, sent, timeout=10, metrics=Metrics())
        reply = client.exchange(state, sent, timeout=10, metrics=Metrics())
        assert torch.equal(reply.tensors["w"], plain.served["w"])
        assert torch.equal(plain.inbox.get_nowait().tensors["w"], sent.tensors["w"])
        assert client._no_lanes_until > time.monotonic() and not client._idle
        client.close()
    finally:
        plain.close()


# ---------------------------------------------------------------------------------------- receive buffers


def test_receive_buffers_are_reused_only_when_nothing_holds_them(node):
    client = PeerClient(node.address)
    state, metrics = client_state(), Metrics()
    client.push(state, message(seed=1), timeout=10, metrics=metrics)
    first = node.inbox.get_nowait()
    kept = first.tensors["w"]
    kept_copy = kept.clone()
    pointer = kept.data_ptr()
    del first
    # The first message's tensor is still held: the next stream must land elsewhere and leave it intact.
    client.push(state, message(seed=2), timeout=10, metrics=metrics)
    second = node.inbox.get_nowait().tensors["w"]
    assert second.data_ptr() != pointer
    assert torch.equal(kept, kept_copy)
    # Once nothing holds the first buffer, it is reused (no fresh allocation, no page faults).
    del kept
    client.push(state, message(seed=3), timeout=10, metrics=metrics)
    third = node.inbox.get_nowait().tensors["w"]
    assert third.data_ptr() == pointer
    assert torch.equal(third, message(seed=3).tensors["w"])
    assert not torch.equal(second, third)
    client.close()


# ------------------------------------------------------------------------------------------- hostile lanes


def lane_for(node: Node, rank: int) -> tuple[PeerClient, object]:
    """A lane of `rank`'s, opened the way PeerClient opens one."""
    client = PeerClient(node.address)
    (lane,) = client._lanes(client_state(rank), timeout=5, count=1)
    return client, lane


def raw_push(node: Node, frames, lane=None, payload: list[bytes] = (), timeout: float = 5) -> grpc.RpcError | None:
    """Push hand-made frames, writing `payload` on `lane` meanwhile; returns the error, if any."""
    channel = grpc.insecure_channel(node.address, options=GRPC_OPTIONS)
    stub = peer_pb2_grpc.PeerStub(channel)
    writer = None
    if lane is not None and payload:
        def write() -> None:
            try:
                for piece in payload:
                    lane.sock.sendall(piece)
            except OSError:
                pass

        writer = threading.Thread(target=write, daemon=True)
        writer.start()
    try:
        stub.Push(iter(frames), timeout=timeout)
        return None
    except grpc.RpcError as error:
        return error
    finally:
        if writer is not None:
            writer.join(timeout=10)
        channel.close()


def laned_stream(rank: int, token: bytes, stream_id: bytes, tensor: torch.Tensor, **manifest) -> tuple:
    outgoing = plan(Message(Kind.PARAMS, rank, 1, {"w": tensor}), job_id=manifest.pop("job_id", JOB), sender_id="x")
    frames = outgoing.lane_frames([token], stream_id, [(0, outgoing.total)])
    header = LANE_HEADER.pack(LANE_MAGIC, stream_id, outgoing.total)
    return frames, header, tensor.numpy().tobytes()


def assert_rejected(node: Node, error: grpc.RpcError | None, reason: str) -> None:
    assert error is not None, "the stream was accepted"
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert error.details().startswith(reason), error.details()
    assert node.inbox.empty()
    assert node.rejections(reason) == 1


def test_bad_manifest_on_a_lane_is_rejected_and_the_lane_closed(node):
    client = PeerClient(node.address)
    # 16 MB, far more than the sockets buffer: a write that nothing stopped would block until the deadline.
    wrong = Message(Kind.PARAMS, 0, 1, {"w": torch.zeros(4_000_000)})
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as error:
        client.push(client_state(), wrong, timeout=20, metrics=Metrics())
    # Refused on its manifest: the client does not wait for the deadline with its payload half written.
    assert time.monotonic() - started < 5
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "bad_manifest" in error.value.details()
    assert node.inbox.empty() and node.rejections("bad_manifest") == 1
    assert not client._idle.get((JOB, 0))
    # The next stream opens a fresh lane and goes through.
    client.push(client_state(), message(), timeout=10, metrics=Metrics())
    assert torch.equal(node.inbox.get_nowait().tensors["w"], message().tensors["w"])
    client.close()


def test_a_lane_of_another_rank_is_refused(node):
    client, lane = lane_for(node, rank=2)
    frames, _, _ = laned_stream(0, lane.token, new_stream_id(), torch.ones(N))
    assert_rejected(node, raw_push(node, frames), "bad_lane")
    # Rank 2's lane is not disturbed: it still carries rank 2's streams.
    other = Message(Kind.PARAMS, 2, 1, {"w": torch.full((N,), 2.0)})
    client._give_back(lane, True)
    client.push(client_state(2), other, timeout=10, metrics=Metrics())
    assert torch.equal(node.inbox.get_nowait().tensors["w"], other.tensors["w"])
    assert node.open_lanes() == 1
    client.close()


def test_a_lane_of_another_job_is_refused(node):
    client, lane = lane_for(node, rank=0)
    node.state = make_state(1, node.inbox, node.served, {0: [TensorSpec("w", torch.float32, (N,))]}, job_id="job-2")
    frames, _, _ = laned_stream(0, lane.token, new_stream_id(), torch.ones(N), job_id="job-2")
    assert_rejected(node, raw_push(node, frames), "bad_lane")
    client.close()


def test_an_unknown_token_is_refused(node):
    frames, _, _ = laned_stream(0, b"\x07" * 32, new_stream_id(), torch.ones(N))
    assert_rejected(node, raw_push(node, frames), "bad_lane")


@pytest.mark.parametrize(
    "case", ["stream_id", "magic", "total", "truncated", "chunks_and_lane", "stalled", "bad_stream_id_length"]
)
def test_a_payload_out_of_step_with_its_stream_is_rejected(node, case):
    client, lane = lane_for(node, rank=0)
    stream_id = new_stream_id()
    tensor = torch.ones(N)
    frames, header, payload = laned_stream(0, lane.token, stream_id, tensor)
    pieces = [header, payload]
    reason = "bad_lane"
    if case == "stream_id":
        pieces[0] = LANE_HEADER.pack(LANE_MAGIC, new_stream_id(), N * 4)
    elif case == "magic":
        pieces[0] = LANE_HEADER.pack(b"HTTP", stream_id, N * 4)
    elif case == "total":
        pieces[0] = LANE_HEADER.pack(LANE_MAGIC, stream_id, N * 4 - 4)
    elif case == "truncated":
        pieces = [header, payload[: len(payload) // 2]]
        reason = "truncated"

        def close_after_write(pieces=pieces):
            for piece in pieces:
                lane.sock.sendall(piece)
            lane.sock.shutdown(socket.SHUT_WR)

        threading.Thread(target=close_after_write, daemon=True).start()
        pieces = []
    elif case == "chunks_and_lane":
        frames = [frames[0], wire_pb2.Frame(chunk=b"\0" * 4), frames[1], frames[2]]
    elif case == "stalled":
        pieces = [header, payload[:1000]]  # then nothing, until the deadline
        reason = "truncated"
    elif case == "bad_stream_id_length":
        frames[1].lane.stream_id = b"short"
    before = node.state.snapshot().served[(None, Kind.PARAMS)]["w"].clone()
    error = raw_push(node, frames, lane, pieces, timeout=2 if case == "stalled" else 5)
    assert_rejected(node, error, reason)
    assert torch.equal(node.served["w"], before)
    assert node.open_lanes() == 0, "a lane whose byte stream may be out of step is closed"
    client.close()


def test_a_handshake_with_a_wrong_token_gets_no_lane(node):
    assert node.servicer.lanes is not None
    port = node.servicer.lanes.port
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"\x01" * 32)
        assert sock.recv(1) == b"", "the hub closes the connection without answering"
    # A granted token works once, and only once.
    grant = PeerClient(node.address).stub.OpenLane(
        peer_pb2.LaneRequest(job_id=JOB, requester_rank=0, requester_id="n0"), timeout=5
    )
    lane = dial("127.0.0.1", grant.port, grant.token, JOB, 0, timeout=5)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as again:
        again.sendall(grant.token)
        assert again.recv(1) != READY
    lane.close()


def test_open_lane_is_only_for_this_job_and_its_peers(node):
    stub = PeerClient(node.address).stub
    for request, code in [
        (peer_pb2.LaneRequest(job_id="other", requester_rank=0), grpc.StatusCode.FAILED_PRECONDITION),
        (peer_pb2.LaneRequest(job_id=JOB, requester_rank=7), grpc.StatusCode.PERMISSION_DENIED),
        (peer_pb2.LaneRequest(job_id=JOB, requester_rank=1), grpc.StatusCode.PERMISSION_DENIED),
    ]:
        with pytest.raises(grpc.RpcError) as refused:
            stub.OpenLane(request, timeout=5)
        assert refused.value.code() == code


def test_a_hostile_reply_on_a_lane_is_rejected_by_the_client(node):
    """The client validates what comes back on a lane as strictly: a reply whose lane frame names a token the
    call did not offer is refused."""
    client = PeerClient(node.address)
    state = client_state()
    (lane,) = client._lanes(state, timeout=5, count=1)
    replies = [
        wire_pb2.Frame(manifest=wire_pb2.Manifest(
            job_id=JOB, sender_rank=1, receiver_rank=0, kind=Kind.PARAMS,
            tensors=[wire_pb2.TensorHeader(name="w", dtype="float32", shape=[N], byte_length=N * 4)],
        )),
        wire_pb2.Frame(lane=wire_pb2.Lane(token=b"\x02" * 32, stream_id=new_stream_id(), total_bytes=N * 4)),
    ]

    class Replies(list):
        def cancel(self) -> None:
            self.cancelled = True

    stream = Replies(r.SerializeToString() for r in replies)
    with pytest.raises(WireError) as error:
        PeerClient._incoming(state, stream, 1, Metrics(), [lane])
    assert error.value.reason == "bad_lane" and stream.cancelled
    lane.close()
    client.close()


def test_lanes_close_with_the_servicer():
    served = Node()
    client = PeerClient(served.address)
    client.push(client_state(), message(), timeout=10, metrics=Metrics())
    lane = client._idle[(JOB, 0)][0]
    served.close()
    lane.sock.settimeout(5)
    assert lane.sock.recv(1) == b""
    client.close()


def test_an_idle_lane_closed_by_the_peer_is_replaced_before_use(node):
    client = PeerClient(node.address)
    client.push(client_state(), message(), timeout=10, metrics=Metrics())
    node.inbox.get_nowait()
    (old,) = client._idle[(JOB, 0)]
    node.servicer.lanes.forget_job("another job")  # the node moved on: its lanes of this job are closed
    deadline = time.monotonic() + 5
    while old.alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    client.push(client_state(), message(seed=9), timeout=10, metrics=Metrics())
    assert torch.equal(node.inbox.get_nowait().tensors["w"], message(seed=9).tensors["w"])
    assert old.closed and client._idle[(JOB, 0)][0] is not old
    client.close()


@pytest.mark.parametrize(
    ("order", "reason"),
    [
        ([1, 0, 2], "no_manifest"),
        ([0, 2, 1], "truncated"),
        ([0, 1], "truncated"),
        ([0, 1, 2, 2], "after_end"),
        ([0, 0, 1, 2], "second_manifest"),
    ],
    ids=["lane_first", "end_before_lane", "no_end", "two_ends", "two_manifests"],
)
def test_frames_in_one_message_are_checked_like_a_stream(node, order, reason):
    client, lane = lane_for(node, rank=0)
    stream_id = new_stream_id()
    frames, header, payload = laned_stream(0, lane.token, stream_id, torch.ones(N))
    request = wire_pb2.Frames(frames=[frames[i] for i in order])
    writer = threading.Thread(target=lambda: _write_quietly(lane, [header, payload]), daemon=True)
    writer.start()
    with pytest.raises(grpc.RpcError) as error:
        client._push_on_lane(request, timeout=5)
    lane.abort()  # as PeerClient does after a failed call: the writer may be blocked on a lane nobody reads
    writer.join(timeout=10)
    assert not writer.is_alive()
    assert_rejected(node, error.value, reason)
    client.close()


def _write_quietly(lane, pieces) -> None:
    try:
        for piece in pieces:
            lane.sock.sendall(piece)
    except OSError:
        pass


def test_exchange_on_lane_answers_frames_then_the_payload(node):
    client, lane = lane_for(node, rank=0)
    stream_id = new_stream_id()
    sent = message(seed=11)
    frames, header, payload = laned_stream(0, lane.token, stream_id, sent.tensors["w"])
    writer = threading.Thread(target=lambda: _write_quietly(lane, [header, payload]), daemon=True)
    writer.start()
    replies = client._exchange_on_lane(wire_pb2.Frames(frames=frames), timeout=10)
    first = next(replies)
    assert [f.WhichOneof("body") for f in first.frames] == ["manifest", "lane", "end"]
    assert first.frames[1].lane.token == lane.token
    header_back = bytearray(LANE_HEADER.size)
    lane.read_into(memoryview(header_back))
    assert LANE_HEADER.unpack(header_back)[1] == first.frames[1].lane.stream_id
    back = bytearray(N * 4)
    lane.read_into(memoryview(back))
    assert torch.equal(torch.frombuffer(back, dtype=torch.float32), node.served["w"])
    assert list(replies) == []
    writer.join(timeout=10)
    assert torch.equal(node.inbox.get_nowait().tensors["w"], sent.tensors["w"])
    client.close()


# ------------------------------------------------------------------------------------------------- striping


@pytest.fixture
def striped(monkeypatch):
    """Payloads of this module's size striped over three lanes."""
    monkeypatch.setattr("nodeagent.wire.lane.STRIPE_BYTES", 1 << 16)
    monkeypatch.setattr("nodeagent.wire.lane.MAX_STRIPES", 3)
    monkeypatch.setattr("nodeagent.wire.lane.MAX_SEALED_STRIPES", 3)


@pytest.mark.parametrize("encoding", [Encoding.RAW, Encoding.FP16, Encoding.BF16], ids=lambda e: e.name)
def test_a_large_payload_is_striped_over_several_lanes(node, striped, encoding):
    client = PeerClient(node.address)
    state, metrics = client_state(encoding=encoding), Metrics()
    sent = message(seed=12)
    reply = client.exchange(state, sent, timeout=10, metrics=metrics)
    assert torch.equal(reply.tensors["w"], node.served["w"])
    wire = {Encoding.RAW: torch.float32, Encoding.FP16: torch.float16, Encoding.BF16: torch.bfloat16}[encoding]
    assert torch.equal(node.inbox.get_nowait().tensors["w"], sent.tensors["w"].to(wire).float())
    client.push(state, sent, timeout=10, metrics=metrics)
    assert torch.equal(node.inbox.get_nowait().tensors["w"], sent.tensors["w"].to(wire).float())
    assert len(client._idle[(JOB, 0)]) == 3 and node.open_lanes() == 3
    wire_bytes = N * wire.itemsize
    assert node.sample("peertrain_edge_bytes_received_total", job_id=JOB, src="n0", dst="n1") == 2 * wire_bytes
    assert node.sample("peertrain_edge_bytes_sent_total", job_id=JOB, src="n1", dst="n0") == N * 4
    client.close()


def test_a_striped_mixed_message(node, striped):
    """Tensors of several dtypes, one converted on the way: the lane boundaries fall inside the converted tensor
    and inside a raw one, and the tensors are read into their own buffers across them."""
    generator = torch.Generator().manual_seed(13)
    tensors = {
        "w": torch.randn(N, generator=generator),  # 600 kB as fp16
        "steps": torch.arange(N // 8),  # 300 kB of int64
        "mask": torch.rand(N // 3, generator=generator) > 0.5,
        "b": torch.randn(7, generator=generator),
    }
    node.state = make_state(1, node.inbox, node.served, {0: specs_of(tensors)})
    client = PeerClient(node.address)
    client.push(client_state(encoding=Encoding.FP16), Message(Kind.PARAMS, 0, 1, tensors), timeout=10,
                metrics=Metrics())
    received = node.inbox.get_nowait().tensors
    assert len(client._idle[(JOB, 0)]) == 3, "the payload was striped over three lanes"
    assert torch.equal(received["w"], tensors["w"].half().float())
    assert torch.equal(received["b"], tensors["b"].half().float())
    assert torch.equal(received["steps"], tensors["steps"]) and torch.equal(received["mask"], tensors["mask"])
    client.close()


def two_lanes(node: Node) -> tuple[PeerClient, list]:
    client = PeerClient(node.address)
    lanes = client._lanes(client_state(0), timeout=5, count=2)
    assert len(lanes) == 2
    return client, lanes


def striped_request(lanes, tensor: torch.Tensor, shares, stream_ids=None, encoding=Encoding.RAW):
    outgoing = plan(Message(Kind.PARAMS, 0, 1, {"w": tensor}), job_id=JOB, sender_id="n0", encoding=encoding)
    stream_id = new_stream_id()
    frames = outgoing.lane_frames([lane.token for lane in lanes], stream_id, shares)
    for frame, other in zip(frames[1:-1], stream_ids or [], strict=False):
        frame.lane.stream_id = other
    payloads = [list(outgoing.lane_pieces(stream_id, start, stop)) for start, stop in shares]
    return wire_pb2.Frames(frames=frames), [[bytes(p) for p in pieces] for pieces in payloads]


def striped_push(node: Node, client: PeerClient, lanes, request, payloads, timeout: float = 5):
    writers = [
        threading.Thread(target=_write_quietly, args=(lane, pieces), daemon=True)
        for lane, pieces in zip(lanes, payloads, strict=False)
    ]
    for writer in writers:
        writer.start()
    try:
        client._push_on_lane(request, timeout=timeout)
        error = None
    except grpc.RpcError as failed:
        error = failed
    for lane in lanes:
        lane.abort()
    for writer in writers:
        writer.join(timeout=10)
        assert not writer.is_alive()
    return error


def test_a_correct_striped_stream_by_hand_is_accepted(node):
    client, lanes = two_lanes(node)
    tensor = torch.randn(N)
    request, payloads = striped_request(lanes, tensor, [(0, 600_000), (600_000, N * 4)])
    assert striped_push(node, client, lanes, request, payloads) is None
    assert torch.equal(node.inbox.get_nowait().tensors["w"], tensor)
    client.close()


@pytest.mark.parametrize(
    "case", ["gap", "overlap", "reordered", "short", "same_lane_twice", "splits_an_element", "stream_ids",
             "header_length", "one_lane_stalls"],
)
def test_a_striped_stream_out_of_step_is_rejected_and_its_lanes_closed(node, case):
    client, lanes = two_lanes(node)
    tensor = torch.randn(N)
    total = N * 4
    shares = [(0, 600_000), (600_000, total)]
    encoding = Encoding.RAW
    stream_ids = None
    timeout = 5
    reason = "bad_lane"
    if case == "gap":
        shares = [(0, 600_000), (600_064, total)]
    elif case == "overlap":
        shares = [(0, 600_000), (599_936, total)]
    elif case == "reordered":
        shares = [(600_000, total), (0, 600_000)]
    elif case == "short":
        shares = [(0, 600_000), (600_000, total - 64)]
    elif case == "same_lane_twice":
        lanes = [lanes[0], lanes[0]]
    elif case == "splits_an_element":
        encoding = Encoding.FP16  # 2-byte elements on the wire: an odd boundary splits one
        total = N * 2
        shares = [(0, 300_000), (300_000, total)]
    elif case == "stream_ids":
        stream_ids = [new_stream_id(), new_stream_id()]
    elif case == "header_length":
        pass
    elif case == "one_lane_stalls":
        reason = "truncated"
        timeout = 2
    request, payloads = striped_request(lanes, tensor, shares, stream_ids, encoding)
    if case == "header_length":
        payloads[1][0] = LANE_HEADER.pack(LANE_MAGIC, request.frames[2].lane.stream_id, total - 600_000 + 8)
    if case == "one_lane_stalls":
        payloads[1] = payloads[1][:1]  # its header, then nothing
    if case == "splits_an_element":  # a sender would not cut there: the frames and the bytes are made by hand
        for frame, (start, stop) in zip(request.frames[1:-1], [(0, 300_001), (300_001, total)], strict=True):
            frame.lane.offset, frame.lane.total_bytes = start, stop - start
        wire = b"".join(b"".join(p[1:]) for p in payloads)
        stream_id = request.frames[1].lane.stream_id
        payloads = [[LANE_HEADER.pack(LANE_MAGIC, stream_id, stop - start), wire[start:stop]]
                    for start, stop in [(0, 300_001), (300_001, total)]]
    started = time.monotonic()
    error = striped_push(node, client, lanes, request, payloads, timeout=timeout)
    assert time.monotonic() - started < timeout + 1
    assert_rejected(node, error, reason)
    # The lanes the stream named are closed (their byte streams may be out of step); a lane it never got to
    # name is the sender's business, and the next stream on it fails its header check.
    assert lanes[0].token not in node.servicer.lanes._lanes
    if case not in ("reordered", "same_lane_twice"):
        assert node.open_lanes() == 0
    client.close()


# ---------------------------------------------------------------------------------------------- sealed lanes


@dataclass(frozen=True)
class LaneCerts:
    """Credentials directories: nodes n0, n1 and n2 of the cluster CA."""

    root: Path

    def transport(self, holder: str) -> Transport:
        return Transport(TlsDir(self.root / holder))


@pytest.fixture(scope="module")
def lane_certs(tmp_path_factory) -> LaneCerts:
    root = tmp_path_factory.mktemp("lane-certs")
    ca_key, ca = pki.create_ca("cluster CA")
    for name in ("n0", "n1", "n2"):
        key = pki.new_private_key()
        cert = pki.issue(ca_key, ca, key.public_key(), Role.NODE, name)
        TlsDir(root / name).save(Credentials(pki.certificate_pem(ca), pki.certificate_pem(cert),
                                             pki.private_key_pem(key)))
    return LaneCerts(root)


@pytest.fixture
def tls_node(lane_certs):
    served = Node(transport=lane_certs.transport("n1"))
    yield served
    served.close()


@pytest.fixture
def hub():
    """A sealed lane hub, without gRPC: grants are made by hand."""
    lanes = LaneHub("127.0.0.1", sealed=True)
    yield lanes
    lanes.close()


def test_sealed_lanes_move_payloads_byte_exact(tls_node, lane_certs, striped):
    client = PeerClient(tls_node.address, transport=lane_certs.transport("n0"), server_name="n1")
    state, metrics = client_state(), Metrics()
    sent = message(seed=21)
    client.push(state, sent, timeout=10, metrics=metrics)
    assert torch.equal(tls_node.inbox.get_nowait().tensors["w"], sent.tensors["w"])
    # The reply comes back on the same lanes, sealed the other way.
    reply = client.exchange(state, sent, timeout=10, metrics=metrics)
    assert torch.equal(reply.tensors["w"], tls_node.served["w"])
    assert torch.equal(tls_node.inbox.get_nowait().tensors["w"], sent.tensors["w"])
    pulled = client.pull(state, 1, Kind.PARAMS, timeout=10, metrics=metrics)
    assert torch.equal(pulled.tensors["w"], tls_node.served["w"])
    lanes = client._idle[(JOB, 0)]
    assert len(lanes) == 3 and tls_node.open_lanes() == 3, "striped over three sealed lanes"
    assert all(lane.sealed for lane in lanes)
    served = tls_node.servicer.lanes._lanes.values()
    assert all(lane.sealed for lane in served) and {lane.grantee for lane in served} == {"n0"}
    client.close()


def test_grpc_peers_verify_the_neighbour_named_by_the_job(tls_node, lane_certs):
    metrics = Metrics()
    peers = GrpcPeers(client_state(), {1: tls_node.address}, metrics, 10, transport=lane_certs.transport("n0"))
    sent = message(seed=22)
    peers.push(sent)
    assert torch.equal(tls_node.inbox.get_nowait().tensors["w"], sent.tensors["w"])
    assert peers.client(1)._idle[(JOB, 0)], "the payload went on a lane"
    peers.close()
    # A job that says rank 1 is n2: the node at that address proves to be n1, and nothing is sent.
    impostor = GrpcPeers(client_state(names={0: "n0", 1: "n2"}), {1: tls_node.address}, metrics, 5,
                         transport=lane_certs.transport("n0"))
    with pytest.raises(SendFailed):
        impostor.push(sent)
    assert tls_node.inbox.empty()
    impostor.close()


def test_a_plaintext_server_gets_no_lane_from_a_secure_client():
    """A client under TLS never sends payload bytes on a lane without a key: a grant without one gets frames."""
    client = PeerClient("127.0.0.1:1")
    client._secure = True

    class Unsealed:
        def OpenLane(self, request, timeout):
            return peer_pb2.LaneGrant(port=1, token=bytes(TOKEN_BYTES))

    client.stub = Unsealed()
    assert client._lanes(client_state(), timeout=1, count=1) == []
    client.close()


def _send_quietly(lane: LaneSocket, pieces) -> None:
    with contextlib.suppress(OSError):
        lane.send(pieces)


@pytest.mark.parametrize("key", ["none", "another"])
def test_a_lane_opened_with_a_stolen_token_delivers_nothing(tls_node, lane_certs, key):
    """A thief who saw a token on the wire opens the lane with it and writes a payload there, in plaintext or
    sealed with a key of its own; even in a stream that n0 names, the receiver refuses it whole."""
    client = PeerClient(tls_node.address, transport=lane_certs.transport("n0"), server_name="n1")
    grant = client.stub.OpenLane(peer_pb2.LaneRequest(job_id=JOB, requester_rank=0, requester_id="n0"), timeout=5)
    assert len(grant.key) == KEY_BYTES
    thief = dial("127.0.0.1", grant.port, grant.token, JOB, 0, 5,
                 None if key == "none" else secrets.token_bytes(KEY_BYTES))
    tensor = torch.randn(N)
    request, (payload,) = striped_request([thief], tensor, [(0, N * 4)])
    writer = threading.Thread(target=_send_quietly, args=(thief, payload), daemon=True)
    writer.start()
    with pytest.raises(grpc.RpcError) as error:
        client._push_on_lane(request, timeout=5)
    thief.abort()
    writer.join(timeout=10)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and error.value.details().startswith("bad_lane")
    assert tls_node.inbox.empty() and tls_node.open_lanes() == 0
    assert tls_node.sample("peertrain_stream_rejections_total", src="n0", dst="n1", reason="bad_lane") == 1
    # The honest client's next stream goes through on a lane of its own.
    sent = message(seed=24)
    client.push(client_state(), sent, timeout=10, metrics=Metrics())
    assert torch.equal(tls_node.inbox.get_nowait().tensors["w"], sent.tensors["w"])
    thief.close()
    client.close()


def record_byte(record: int, within: int) -> Callable[[bytearray], int | None]:
    """Where byte `within` of sealed record `record` lies in what a lane's dialling side sends (counted from the
    record's length field; negative: from the record's end), once the bytes sent so far tell."""

    def locate(stream: bytearray) -> int | None:
        start = TOKEN_BYTES
        for _ in range(record + (within < 0)):
            if len(stream) < start + RECORD_LENGTH.size:
                return None
            (length,) = RECORD_LENGTH.unpack_from(stream, start)
            start += RECORD_LENGTH.size + length
        return start + within

    return locate


class FlippingRelay:
    """A man in the middle on loopback: relays connections to `port`, flipping the byte that `flip` locates in what
    the dialling side sends on its first connection (None: relays faithfully)."""

    def __init__(self, port: int, flip: Callable[[bytearray], int | None] | None):
        self.port, self.flip = port, flip
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = self.listener.getsockname()
        self.flipped = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        first = True
        while True:
            try:
                near, _ = self.listener.accept()
            except OSError:
                return
            far = socket.create_connection(("127.0.0.1", self.port))
            flip, first = (self.flip if first else None), False
            threading.Thread(target=self._pipe, args=(near, far, flip), daemon=True).start()
            threading.Thread(target=self._pipe, args=(far, near, None), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket,
              flip: Callable[[bytearray], int | None] | None) -> None:
        offset, stream = 0, bytearray()
        with contextlib.suppress(OSError):
            while data := bytearray(source.recv(1 << 16)):
                if flip is not None and not self.flipped.is_set():
                    stream += data
                    target = flip(stream)  # what has come so far, not copied again for every chunk
                    if target is not None and offset <= target < offset + len(data):
                        data[target - offset] ^= 0x01
                        self.flipped.set()
                offset += len(data)
                sink.sendall(data)
        for sock in (source, sink):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.listener.close()


@pytest.mark.parametrize("where", ["length", "ciphertext", "tag", "faithful"])
def test_a_byte_flipped_on_the_way_fails_the_stream(tls_node, lane_certs, monkeypatch, where):
    # Record 0: the call; record 1: the payload's first (its tensor is sealed in records of its own).
    flip = {"length": record_byte(0, 3),  # the first record's length: its bound, or its additional data, fails
            "ciphertext": record_byte(1, RECORD_LENGTH.size + 1000),
            "tag": record_byte(1, -5),
            "faithful": None}[where]
    relay = FlippingRelay(tls_node.servicer.lanes.port, flip)
    dial_direct = lane_module.dial

    def dial_through_relay(host, port, *args):
        return dial_direct(host, relay.address[1], *args)

    monkeypatch.setattr("nodeagent.runtime.peer_service.dial", dial_through_relay)
    client = PeerClient(tls_node.address, transport=lane_certs.transport("n0"), server_name="n1")
    sent = message(seed=25)
    if where == "faithful":
        client.push(client_state(), sent, timeout=10, metrics=Metrics())
        assert torch.equal(tls_node.inbox.get_nowait().tensors["w"], sent.tensors["w"])
    else:
        with pytest.raises(grpc.RpcError) as error:
            client.push(client_state(), sent, timeout=10, metrics=Metrics())
        assert relay.flipped.is_set()
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "bad_lane" in error.value.details()
        assert tls_node.inbox.empty() and tls_node.open_lanes() == 0
    client.close()
    relay.close()


def raw_lane(hub: LaneHub) -> tuple[bytes, socket.socket]:
    """A granted lane opened by hand: its token and the dialling end's bare socket."""
    token = hub.grant(JOB, 0, "n0").token
    sock = socket.create_connection(("127.0.0.1", hub.port), timeout=5)
    sock.sendall(token)
    assert sock.recv(1) == READY
    return token, sock


@pytest.mark.parametrize("length", [2**32 - 1, RECORD_BYTES + 17, 16, 0])
def test_a_record_length_beyond_its_bounds_is_refused_before_anything_is_read(hub, length):
    token, sock = raw_lane(hub)
    sock.sendall(RECORD_LENGTH.pack(length))
    lane = hub.claim(token, JOB, 0)
    lane.set_timeout(5)
    tracemalloc.start()
    try:
        with pytest.raises(WireError) as refused:
            lane.read_into(memoryview(bytearray(64)))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert refused.value.reason == "bad_lane" and "sealed record" in refused.value.detail and lane.closed
    assert peak < 4 * RECORD_BYTES, "no buffer of the claimed length was allocated"
    hub.release(lane, False)
    sock.close()


def sealed_pair(hub: LaneHub) -> tuple[LaneSocket, LaneSocket]:
    """Both ends of one sealed lane: the dialling one and the hub's (claimed)."""
    grant = hub.grant(JOB, 0, "n0")
    dialled = dial("127.0.0.1", hub.port, grant.token, JOB, 0, 5, grant.key)
    accepted = hub.claim(grant.token, JOB, 0)
    for end in (dialled, accepted):
        end.set_timeout(5)
    return dialled, accepted


def test_each_direction_has_its_own_nonces(hub):
    """Both ends start counting records at 0 under one key: a record sent one way and reflected back fails, and
    so does one replayed in its own direction."""
    dialled, accepted = sealed_pair(hub)
    data = bytes(range(256)) * 40
    dialled.send([data])
    received = bytearray(len(data))
    accepted.read_into(memoryview(received))
    accepted.send([received])  # record 0 from the hub, after record 0 to it
    echoed = bytearray(len(data))
    dialled.read_into(memoryview(echoed))
    assert bytes(received) == bytes(echoed) == data
    # The hub's next record, captured on the way and reflected to the hub as if the dialling end had sent it.
    capture_lane, hub_end = sealed_pair(hub)
    hub_end.send([data])
    record = bytearray(RECORD_LENGTH.size + len(data) + 16)
    capture_lane.sock.recv_into(record, len(record), socket.MSG_WAITALL)
    capture_lane.sock.sendall(record)
    with pytest.raises(WireError) as reflected:
        hub_end.read_into(memoryview(bytearray(len(data))))
    assert reflected.value.reason == "bad_lane" and "authentication" in reflected.value.detail
    # A record replayed in its own direction: its count is spent.
    replay_lane, replay_hub = sealed_pair(hub)
    replay_lane.send([data])
    captured = bytearray(RECORD_LENGTH.size + len(data) + 16)
    replay_hub.sock.recv_into(captured, len(captured), socket.MSG_WAITALL)
    replay_lane.sock.sendall(captured)
    replay_lane.sock.sendall(captured)
    replay_hub.read_into(memoryview(bytearray(len(data))))
    with pytest.raises(WireError):
        replay_hub.read_into(memoryview(bytearray(len(data))))
    for end in (dialled, capture_lane, replay_lane):
        end.close()
    for end in (accepted, hub_end, replay_hub):
        hub.release(end, False)


def test_reads_of_any_size_reassemble_the_records(hub):
    """Records of up to RECORD_BYTES, read in pieces smaller and larger than a record."""
    dialled, accepted = sealed_pair(hub)
    data = torch.randint(0, 256, (3 * RECORD_BYTES + 12345,), dtype=torch.uint8).numpy().tobytes()
    pieces = [data[:10], data[10:RECORD_BYTES + 7], data[RECORD_BYTES + 7 :]]
    writer = threading.Thread(target=dialled.send, args=(pieces,), daemon=True)
    writer.start()
    received = bytearray(len(data))
    view, offset = memoryview(received), 0
    for size in (32, RECORD_BYTES - 32, 5, 2 * RECORD_BYTES, len(data)):
        size = min(size, len(data) - offset)
        accepted.read_into(view[offset : offset + size])
        offset += size
    writer.join(timeout=10)
    assert offset == len(data) and bytes(received) == data
    dialled.close()
    hub.release(accepted, True)


def test_a_sealed_write_seals_a_large_piece_from_its_own_memory(hub):
    """A call's header and a payload of 3 MiB: no Python buffer of a record's size is allocated to seal or open
    them (the payload's first MiB was gathered into one after the header)."""
    dialled, accepted = sealed_pair(hub)
    header, payload = b"call" * 30, torch.randint(0, 256, (3 * RECORD_BYTES,), dtype=torch.uint8).numpy()
    received = bytearray(len(header) + payload.nbytes)
    for _ in range(2):  # the first allocates the lane's scratch
        tracemalloc.start()
        try:
            writer = threading.Thread(target=dialled.send, args=([header, memoryview(payload)],), daemon=True)
            writer.start()
            accepted.read_into(memoryview(received)[: len(header)])
            accepted.read_into(memoryview(received)[len(header) :])
            writer.join(timeout=10)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert bytes(received) == header + payload.tobytes()
    assert peak < RECORD_BYTES // 4, f"{peak} bytes allocated to seal and open 3 MiB"
    dialled.close()
    hub.release(accepted, True)


@pytest.mark.parametrize("seed", range(4))
def test_a_sealed_write_of_any_pieces_arrives_as_written(hub, seed):
    """Pieces of any size, below and above SEAL_IN_PLACE_BYTES and a record, some of them in one buffer that the
    writer refills for the next piece (as staging does: a piece may be reused once the next is asked for), read
    back in reads of any size: the byte stream as written."""
    rng = random.Random(seed)
    sizes = [rng.choice([1, 7, 100, 4096, SEAL_IN_PLACE_BYTES - 1, SEAL_IN_PLACE_BYTES, 200_000, RECORD_BYTES + 3])
             for _ in range(12)]
    data = rng.randbytes(sum(sizes))
    refilled = bytearray(max(sizes))

    def pieces() -> Iterator[bytes | memoryview]:
        offset = 0
        for index, size in enumerate(sizes):
            chunk = data[offset : offset + size]
            offset += size
            if index % 3 == 0:
                yield chunk
            else:
                refilled[:size] = chunk
                yield memoryview(refilled)[:size]

    dialled, accepted = sealed_pair(hub)
    writer = threading.Thread(target=dialled.send, args=(pieces(),), daemon=True)
    writer.start()
    received = bytearray(len(data))
    view, offset = memoryview(received), 0
    while offset < len(data):
        size = min(rng.choice([1, 4, 1000, SEAL_IN_PLACE_BYTES, RECORD_BYTES, 3 * RECORD_BYTES]), len(data) - offset)
        accepted.read_into(view[offset : offset + size])
        offset += size
    writer.join(timeout=10)
    assert bytes(received) == data
    dialled.close()
    hub.release(accepted, True)


def test_a_sealed_lane_keeps_its_deadlines(hub):
    dialled, accepted = sealed_pair(hub)
    accepted.set_timeout(0.3)
    with pytest.raises(WireError) as stalled:
        accepted.read_into(memoryview(bytearray(1000)))
    assert stalled.value.reason == "truncated" and accepted.closed
    hub.release(accepted, False)
    # A write nobody reads ends at its deadline too (64 MB: far more than the sockets buffer).
    unread, unread_hub = sealed_pair(hub)
    unread.set_timeout(0.3)
    with pytest.raises(TimeoutError):
        unread.send([bytes(64 << 20)])
    assert unread.closed
    # The hub closed the first lane: the dialling end sees it as gone.
    deadline = time.monotonic() + 5
    while dialled.alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not dialled.alive()
    dialled.close()
    unread.close()
    hub.release(unread_hub, True)


def test_open_lanes_are_bounded_per_node(hub, monkeypatch):
    monkeypatch.setattr("nodeagent.wire.lane.LANES_PER_PEER", 2)

    def grant_and_dial(rank: int = 0) -> tuple[bytes, LaneSocket]:
        grant = hub.grant(JOB, rank, "n0")
        return grant.token, dial("127.0.0.1", hub.port, grant.token, JOB, rank, 5, grant.key)

    (first, a), (second, b) = grant_and_dial(), grant_and_dial()
    busy = [hub.claim(first, JOB, 0), hub.claim(second, JOB, 0)]
    # Both in use: a third lane of n0's is refused, whatever rank it was granted for.
    with pytest.raises(OSError):
        grant_and_dial(rank=2)
    # Once one is idle, the oldest idle one makes room for a new one.
    hub.release(busy[0], True)
    _, c = grant_and_dial()
    assert first not in hub._lanes and second in hub._lanes and len(hub._lanes) == 2
    hub.release(busy[1], True)
    for lane in (a, b, c):
        lane.close()


def test_idle_connections_from_one_address_leave_room_for_an_honest_lane(tls_node, lane_certs):
    """Connections that never present their token hold a slot for up to HANDSHAKE_TIMEOUT_S each. One source
    address that tries to take every slot gets MAX_HANDSHAKES_PER_SOURCE; the others are closed at once."""
    hub = tls_node.servicer.lanes
    idle = [socket.create_connection(("127.0.0.1", hub.port), timeout=5, source_address=("127.0.0.2", 0))
            for _ in range(MAX_HANDSHAKES)]

    def closed_by_the_hub(sock: socket.socket) -> bool:
        sock.setblocking(False)
        try:
            return sock.recv(1, socket.MSG_PEEK) == b""
        except BlockingIOError:
            return False

    refused = MAX_HANDSHAKES - MAX_HANDSHAKES_PER_SOURCE
    deadline = time.monotonic() + 5
    while sum(map(closed_by_the_hub, idle)) < refused and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sum(map(closed_by_the_hub, idle)) == refused
    assert hub._handshaking == {"127.0.0.2": MAX_HANDSHAKES_PER_SOURCE}
    client = PeerClient(tls_node.address, transport=lane_certs.transport("n0"), server_name="n1")
    sent = message(seed=23)
    client.push(client_state(), sent, timeout=10, metrics=Metrics())
    assert torch.equal(tls_node.inbox.get_nowait().tensors["w"], sent.tensors["w"])
    assert client._idle[(JOB, 0)], "the payload went on a lane, not in frames"
    # It did not wait for the idle connections to time out: they still hold their slots.
    assert hub._handshaking == {"127.0.0.2": MAX_HANDSHAKES_PER_SOURCE}
    for sock in idle:
        sock.close()
    client.close()


@pytest.mark.parametrize("sealed", [False, True])
def test_reads_of_any_size_after_a_read_ahead_give_the_byte_stream_as_sent(sealed):
    """A short read takes what has come beyond it (READ_AHEAD_BYTES at most); the reads after it, short or long,
    and `readable`, get the bytes in order, none lost or repeated, across the buffer and the socket."""
    key = secrets.token_bytes(KEY_BYTES) if sealed else None
    with socket.create_server(("127.0.0.1", 0)) as listener:
        left = socket.create_connection(listener.getsockname())
        right, _ = listener.accept()
    sender, receiver = LaneSocket(left, key=key, dialled=True), LaneSocket(right, key=key)
    stream = torch.arange(200_000, dtype=torch.int32).numpy().tobytes()  # 800 kB, several reads ahead
    sizes = [4, 9, 1, 70_000, 3, lane_module.READ_AHEAD_BYTES + 5, 2, 100_000, 16]
    with futures.ThreadPoolExecutor(1) as pool:
        pool.submit(sender.send, [stream[:4], stream[4:150_000], stream[150_000:]])
        received = bytearray()
        for size in [*sizes, len(stream) - sum(sizes)]:
            receiver.readable()  # takes what has come, if anything, ahead of the read
            view = memoryview(bytearray(size))
            receiver.read_into(view)
            received += view
    assert bytes(received) == stream and not receiver.readable()
    sender.close()
    receiver.close()
