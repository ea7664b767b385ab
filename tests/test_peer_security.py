"""The peer service under mutual TLS, attacked over real gRPC on loopback: a stream is accepted only from the
certificate of the neighbour assigned its edge, requests and descriptions only for neighbours, and one caller's
streams, however many and however slow, neither take every server thread nor hold one for long.

Node n1 (rank 1) serves; n0 (rank 0) and n2 (rank 2) are its neighbours; n3 is a node of the cluster that is not.
The attacking side speaks only gRPC and the generated proto modules: what an attacker with a certificate has.
"""

from __future__ import annotations

import math
import queue
import struct
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch
from hostile import channel_as
from torch import nn

from nodeagent._proto import peer_pb2, peer_pb2_grpc, wire_pb2
from nodeagent.algorithms import Neighbor, NodeContext, build_algorithm
from nodeagent.jobspec import AlgorithmSpec
from nodeagent.metrics import Metrics
from nodeagent.rpc import SERVER_OPTIONS
from nodeagent.runtime.limits import DEFAULT_LIMITS, PEER_SERVER_THREADS, StreamLimits
from nodeagent.runtime.peer_service import MAX_DETAIL_CHARS, PEER_RULES, PeerServicer, ServingState, add_peer_servicer
from nodeagent.security.authz import Authorizer
from nodeagent.security.pki import Role, certificate_pem, create_ca, issue, new_private_key, private_key_pem
from nodeagent.security.tls import Credentials, TlsDir, Transport
from nodeagent.wire import Encoding

pytestmark = pytest.mark.integration

JOB = "job-1"
NAMES = {0: "n0", 1: "n1", 2: "n2"}
CALL_TIMEOUT_S = 10.0


# -- the served node ----------------------------------------------------------------------------------------------


@dataclass
class Node:
    address: str
    algorithm: object
    inbox: queue.Queue
    metrics: Metrics

    def state(self) -> list[torch.Tensor]:
        return [self.algorithm.w.clone(), *(t.clone() for t in self.algorithm.last_copy.values())]

    def rejections(self, src: str, reason: str) -> float:
        labels = {"src": src, "dst": "n1", "reason": reason}
        return self.metrics.registry.get_sample_value("peertrain_stream_rejections_total", labels) or 0.0


@pytest.fixture
def start_node(cluster_pki) -> Iterator[Callable[..., Node]]:
    """`start(limits, secure)`: n1 served on loopback as the daemon serves it (its thread pool and call limit, the
    Authorizer, lanes), with TLS unless `secure` is False."""
    stops: list[Callable[[], None]] = []

    def start(limits: StreamLimits = DEFAULT_LIMITS, secure: bool = True) -> Node:
        torch.manual_seed(0)
        context = NodeContext(1, 3, (Neighbor(0, 1, 0, 1 / 3), Neighbor(2, -1, 0, 1 / 3)), AlgorithmSpec(name="dsgd"),
                              self_weight=1 / 3)
        algorithm = build_algorithm(nn.Linear(4, 3), context)
        inbox: queue.Queue = queue.Queue()
        metrics = Metrics()
        state = ServingState(
            job_id=JOB, node_id="n1", rank=1, algorithm_name="dsgd", names=NAMES, expected=algorithm.expected,
            snapshot=algorithm.snapshot, inbox=inbox, encoding=Encoding.RAW, chunk_bytes=16,
            max_message_bytes=1 << 20,
        )
        transport = Transport(cluster_pki(Role.NODE, "n1")) if secure else Transport.insecure()
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=PEER_SERVER_THREADS), options=SERVER_OPTIONS,
            interceptors=[Authorizer(PEER_RULES, lambda identity: False)] if secure else [],
            maximum_concurrent_rpcs=PEER_SERVER_THREADS,
        )
        servicer = PeerServicer(lambda: state, metrics, "test", node_id=lambda: "n1", lane_host="127.0.0.1",
                                secure=secure, limits=limits)
        add_peer_servicer(servicer, server)
        port = transport.bind(server, "127.0.0.1:0")
        server.start()
        stops.append(lambda: (server.stop(grace=None), servicer.close()))
        return Node(f"127.0.0.1:{port}", algorithm, inbox, metrics)

    yield start
    for stop in stops:
        stop()


# -- the attacking side: gRPC and the generated proto modules only -----------------------------------------------


def stub_as(address: str, credentials: Path | None, ca: Path) -> peer_pb2_grpc.PeerStub:
    """A stub dialling n1 with the certificate in `credentials` (None: no certificate), trusting the CA of `ca`."""
    return peer_pb2_grpc.PeerStub(channel_as(address, credentials, "n1", ca))


def manifest(sender_rank: int, sender_id: str, job_id: str = JOB) -> wire_pb2.Frame:
    """The manifest of a PARAMS stream to rank 1 of the served model (nn.Linear(4, 3)), as Describe publishes it."""
    headers = [
        wire_pb2.TensorHeader(name="weight", dtype="float32", shape=[3, 4], byte_length=48),
        wire_pb2.TensorHeader(name="bias", dtype="float32", shape=[3], byte_length=12),
    ]
    return wire_pb2.Frame(manifest=wire_pb2.Manifest(
        job_id=job_id, sender_id=sender_id, sender_rank=sender_rank, receiver_rank=1, kind=wire_pb2.KIND_PARAMS,
        clock=3, weight=1.0, tensors=headers,
    ))


def params_stream(sender_rank: int, sender_id: str, value: float = math.nan) -> list[wire_pb2.Frame]:
    """A whole stream of parameters all `value` (NaN: a forgery that would poison the receiver's model)."""
    payload = struct.pack("<15f", *[value] * 15)
    return [manifest(sender_rank, sender_id), wire_pb2.Frame(chunk=payload),
            wire_pb2.Frame(end=wire_pb2.End(total_bytes=len(payload)))]


def send(stub: peer_pb2_grpc.PeerStub, method: str, frames: list[wire_pb2.Frame]) -> None:
    """Send a stream with one of the four stream methods, reading any answer."""
    if method == "Exchange":
        list(stub.Exchange(iter(frames), timeout=CALL_TIMEOUT_S))
    elif method == "Push":
        stub.Push(iter(frames), timeout=CALL_TIMEOUT_S)
    elif method == "ExchangeOnLane":
        list(stub.ExchangeOnLane(wire_pb2.Frames(frames=frames), timeout=CALL_TIMEOUT_S))
    else:
        stub.PushOnLane(wire_pb2.Frames(frames=frames), timeout=CALL_TIMEOUT_S)


def refusal(call: Callable[[], object]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as error:
        call()
    return error.value


def trickle(first: wire_pb2.Frame, stop: threading.Event, every_s: float) -> Iterator[wire_pb2.Frame]:
    """`first`, then one payload byte every `every_s` until `stop`."""
    yield first
    while not stop.wait(every_s):
        yield wire_pb2.Frame(chunk=b"\0")


# -- who may send -------------------------------------------------------------------------------------------------


STREAM_METHODS = ["Exchange", "Push", "ExchangeOnLane", "PushOnLane"]


@pytest.mark.parametrize("method", STREAM_METHODS)
def test_a_node_that_is_no_neighbour_cannot_send_as_one(start_node, cluster_pki, method):
    node = start_node()
    n3 = cluster_pki(Role.NODE, "n3").path
    before = node.state()
    error = refusal(lambda: send(stub_as(node.address, n3, n3), method, params_stream(0, "n0")))
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "not_neighbor" in error.details()
    assert node.inbox.empty()
    assert all(torch.equal(a, b) for a, b in zip(before, node.state(), strict=True))
    assert node.rejections("n3", "not_neighbor") == 1


@pytest.mark.parametrize("method", STREAM_METHODS)
@pytest.mark.parametrize(("rank", "sender_id"), [(0, "n0"), (0, "n2"), (2, "n0"), (1, "n1"), (1, "n2")])
def test_a_neighbour_sends_only_as_itself(start_node, cluster_pki, method, rank, sender_id):
    """n2 claiming n0's rank, n0's id, or the receiver's own rank."""
    node = start_node()
    n2 = cluster_pki(Role.NODE, "n2").path
    before = node.state()
    error = refusal(lambda: send(stub_as(node.address, n2, n2), method, params_stream(rank, sender_id)))
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "wrong_identity" in error.details()
    assert node.inbox.empty()
    assert all(torch.equal(a, b) for a, b in zip(before, node.state(), strict=True))


@pytest.mark.parametrize("method", ["Exchange", "Push"])
def test_the_assigned_neighbour_is_accepted(start_node, cluster_pki, method):
    node = start_node()
    n0 = cluster_pki(Role.NODE, "n0").path
    send(stub_as(node.address, n0, n0), method, params_stream(0, "n0", 7.0))
    received = node.inbox.get_nowait()
    assert received.sender == 0 and received.clock == 3


def test_pull_serves_a_neighbour_its_own_edge_only(start_node, cluster_pki):
    node = start_node()
    n0, n2, n3 = (cluster_pki(Role.NODE, name).path for name in ("n0", "n2", "n3"))

    def pull(credentials: Path, rank: int, requester_id: str) -> list[wire_pb2.Frame]:
        request = peer_pb2.PullRequest(job_id=JOB, requester_rank=rank, requester_id=requester_id,
                                       kind=wire_pb2.KIND_PARAMS)
        return list(stub_as(node.address, credentials, credentials).Pull(request, timeout=CALL_TIMEOUT_S))

    frames = pull(n0, 0, "n0")
    assert frames[0].manifest.receiver_rank == 0 and frames[-1].WhichOneof("body") == "end"
    for credentials, rank, requester_id, reason in [(n3, 0, "n0", "not_neighbor"), (n2, 0, "n0", "wrong_identity"),
                                                    (n2, 2, "n0", "wrong_identity")]:
        error = refusal(lambda credentials=credentials, rank=rank, requester_id=requester_id:
                        pull(credentials, rank, requester_id))
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED
        assert reason in error.details()


def test_open_lane_only_for_the_callers_own_rank(start_node, cluster_pki):
    node = start_node()
    n0, n2, n3 = (cluster_pki(Role.NODE, name).path for name in ("n0", "n2", "n3"))

    def open_lane(credentials: Path, rank: int, requester_id: str) -> peer_pb2.LaneGrant:
        request = peer_pb2.LaneRequest(job_id=JOB, requester_rank=rank, requester_id=requester_id)
        return stub_as(node.address, credentials, credentials).OpenLane(request, timeout=CALL_TIMEOUT_S)

    assert open_lane(n0, 0, "n0").token
    for credentials, rank, requester_id in [(n3, 0, "n0"), (n2, 0, "n0"), (n2, 2, "n0")]:
        error = refusal(lambda credentials=credentials, rank=rank, requester_id=requester_id:
                        open_lane(credentials, rank, requester_id))
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED


def test_describe_tells_neighbours_all_the_coordinator_the_id_and_others_nothing(start_node, cluster_pki):
    node = start_node()
    n0, n3 = cluster_pki(Role.NODE, "n0").path, cluster_pki(Role.NODE, "n3").path
    coordinator = cluster_pki(Role.COORDINATOR, "coordinator").path

    def describe(credentials: Path) -> peer_pb2.NodeDescription:
        return stub_as(node.address, credentials, credentials).Describe(peer_pb2.DescribeRequest(),
                                                                       timeout=CALL_TIMEOUT_S)

    full = describe(n0)
    assert (full.node_id, full.job_id, full.rank, list(full.neighbor_ranks)) == ("n1", JOB, 1, [0, 2])
    probe = describe(coordinator)
    assert (probe.node_id, probe.version, probe.job_id, len(probe.served_tensors)) == ("n1", "test", "", 0)
    error = refusal(lambda: describe(n3))
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED


def test_an_operator_certificate_is_refused_even_with_a_nodes_name(start_node, cluster_pki):
    node = start_node()
    operator = cluster_pki(Role.OPERATOR, "n0").path
    stub = stub_as(node.address, operator, operator)
    error = refusal(lambda: send(stub, "Exchange", params_stream(0, "n0")))
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    error = refusal(lambda: stub.Describe(peer_pb2.DescribeRequest(), timeout=CALL_TIMEOUT_S))
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert node.inbox.empty()


def test_no_certificate_or_another_cas_fails_the_handshake(start_node, cluster_pki, tmp_path):
    node = start_node()
    ours = cluster_pki(Role.NODE, "n0").path
    ca_key, ca_cert = create_ca("another cluster")
    key = new_private_key()
    cert = issue(ca_key, ca_cert, key.public_key(), Role.NODE, "n0")
    theirs = TlsDir(tmp_path / "foreign")
    theirs.save(Credentials(certificate_pem(ca_cert), certificate_pem(cert), private_key_pem(key)))
    for stub in (stub_as(node.address, None, ours), stub_as(node.address, theirs.path, ours)):
        error = refusal(lambda stub=stub: send(stub, "Exchange", params_stream(0, "n0")))
        assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert node.inbox.empty()


def test_every_peer_method_has_its_roles():
    methods = peer_pb2.DESCRIPTOR.services_by_name["Peer"].methods
    assert set(PEER_RULES) == {f"/peertrain.v1.Peer/{method.name}" for method in methods}


# -- limits ---------------------------------------------------------------------------------------------------------


def test_one_neighbours_trickling_streams_are_capped_and_others_keep_exchanging(start_node, cluster_pki):
    node = start_node()
    n0, n2 = cluster_pki(Role.NODE, "n0").path, cluster_pki(Role.NODE, "n2").path
    attacker = stub_as(node.address, n2, n2)
    stop = threading.Event()
    calls = [attacker.Exchange(trickle(manifest(2, "n2"), stop, 1.0), timeout=60) for _ in range(20)]
    try:
        held = DEFAULT_LIMITS.streams_per_peer
        deadline = time.monotonic() + CALL_TIMEOUT_S
        while sum(call.done() for call in calls) < len(calls) - held and time.monotonic() < deadline:
            time.sleep(0.05)
        refused = [call for call in calls if call.done()]
        assert len(refused) == len(calls) - held
        assert all(call.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for call in refused)
        # Pulls share the cap of the caller's streams.
        pull = peer_pb2.PullRequest(job_id=JOB, requester_rank=2, requester_id="n2", kind=wire_pb2.KIND_PARAMS)
        error = refusal(lambda: list(attacker.Pull(pull, timeout=CALL_TIMEOUT_S)))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        honest = stub_as(node.address, n0, n0)
        for _ in range(5):
            reply = list(honest.Exchange(iter(params_stream(0, "n0", 7.0)), timeout=CALL_TIMEOUT_S))
            assert reply[-1].WhichOneof("body") == "end"
        assert node.inbox.qsize() == 5
        assert node.rejections("n2", "too_many_streams") == len(calls) - held + 1
    finally:
        stop.set()
        for call in calls:
            call.cancel()


def test_an_idle_stream_is_ended_and_its_place_freed(start_node, cluster_pki):
    node = start_node(StreamLimits(streams_per_peer=1, idle_s=0.5))
    n0 = cluster_pki(Role.NODE, "n0").path
    stub = stub_as(node.address, n0, n0)
    stop = threading.Event()
    try:
        # The manifest, then nothing: the first wait for a frame never ends.
        error = refusal(lambda: list(stub.Exchange(trickle(manifest(0, "n0"), stop, 60.0), timeout=CALL_TIMEOUT_S)))
    finally:
        stop.set()
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "idle_timeout" in error.details()
    assert node.rejections("n0", "idle_timeout") == 1
    assert node.inbox.empty()
    # The caller's one stream is free again (the handler let go once the call ended).
    deadline = time.monotonic() + CALL_TIMEOUT_S
    while True:
        try:
            list(stub.Exchange(iter(params_stream(0, "n0", 7.0)), timeout=CALL_TIMEOUT_S))
            break
        except grpc.RpcError as refused:
            assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < deadline
            time.sleep(0.05)
    assert node.inbox.qsize() == 1


def test_a_trickle_slower_than_the_minimum_rate_is_ended(start_node, cluster_pki):
    """A byte every 0.1 s never leaves the stream idle for 0.5 s, but 60 bytes at 60 bytes/s have 1.5 s."""
    node = start_node(StreamLimits(idle_s=0.5, min_bytes_per_s=60.0))
    n0 = cluster_pki(Role.NODE, "n0").path
    stop = threading.Event()
    try:
        error = refusal(lambda: stub_as(node.address, n0, n0).Push(trickle(manifest(0, "n0"), stop, 0.1),
                                                                   timeout=CALL_TIMEOUT_S))
    finally:
        stop.set()
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "too_slow" in error.details()
    assert node.inbox.empty()


def test_an_insecure_server_caps_the_streams_of_one_connection(start_node):
    node = start_node(secure=False)
    stub = peer_pb2_grpc.PeerStub(grpc.insecure_channel(node.address))
    stop = threading.Event()
    calls = [stub.Exchange(trickle(manifest(0, "n0"), stop, 1.0), timeout=60)
             for _ in range(DEFAULT_LIMITS.streams_per_peer + 1)]
    try:
        deadline = time.monotonic() + CALL_TIMEOUT_S
        while not any(call.done() for call in calls) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [call.code() for call in calls if call.done()] == [grpc.StatusCode.RESOURCE_EXHAUSTED]
    finally:
        stop.set()
        for call in calls:
            call.cancel()


def test_refusals_do_not_echo_what_the_caller_sent(start_node, cluster_pki):
    node = start_node()
    n0 = cluster_pki(Role.NODE, "n0").path
    frames = params_stream(0, "n0", 7.0)
    frames[0].manifest.job_id = "x" * 100_000
    error = refusal(lambda: send(stub_as(node.address, n0, n0), "Exchange", frames))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT  # beyond the manifest's limits, before anything else
    assert len(error.details()) <= MAX_DETAIL_CHARS + 3
    frames = params_stream(0, "n0", 7.0)
    frames[0].manifest.tensors.extend(wire_pb2.TensorHeader(name="y" * 1000) for _ in range(100))
    error = refusal(lambda: send(stub_as(node.address, n0, n0), "Exchange", frames))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert len(error.details()) <= MAX_DETAIL_CHARS + 3
