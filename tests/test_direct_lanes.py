"""Direct lanes: a neighbour's Push and Exchange carried whole on one lane (nodeagent/wire/lane.py), over real TCP on
loopback, plaintext and sealed beside mutual TLS.

A message on a direct lane is checked as a gRPC stream is: the sender's rank and name against the lane's grant and
the caller's certificate, the manifest against the job, the values finite, the inbox bounded; a refused call
leaves the node's inbox untouched, is counted, and closes the lane; the client's next call opens another. A
revoked certificate's open lane delivers nothing more. A peer that serves no direct lanes is called over gRPC.
"""

from __future__ import annotations

import dataclasses
import math
import queue
import threading
import time
from concurrent import futures

import grpc
import pytest
import torch

from nodeagent._proto import peer_pb2, peer_pb2_grpc, wire_pb2
from nodeagent.algorithms.base import SendFailed, Snapshot
from nodeagent.metrics import Metrics
from nodeagent.rpc import GRPC_OPTIONS
from nodeagent.runtime import peer_service
from nodeagent.runtime.peer_service import GrpcPeers, PeerClient, PeerServicer, ServingState, add_peer_servicer
from nodeagent.security.pki import Role
from nodeagent.security.tls import Transport
from nodeagent.wire import Encoding, Kind, Message, TensorSpec, WireError
from nodeagent.wire.encoder import plan
from nodeagent.wire.frames import new_stream_id
from nodeagent.wire.lane import CALL_LENGTH, LaneSocket, dial, read_call, send_call

pytestmark = pytest.mark.integration

JOB = "job-direct"
N = 1000
NAMES = {0: "n0", 1: "n1", 2: "n2"}


def serving(rank: int, inbox: queue.Queue, served: dict[str, torch.Tensor]) -> ServingState:
    specs = [TensorSpec("w", torch.float32, (N,))]

    def expected(sender: int, kind: Kind) -> list[TensorSpec]:
        if sender == rank or sender not in NAMES:
            raise WireError("not_neighbor", f"rank {sender} is not a neighbour")
        return specs

    snapshot = Snapshot(rank=rank, clock=5, loss=0.5, served={(None, Kind.PARAMS): served})
    return ServingState(job_id=JOB, node_id=NAMES[rank], rank=rank, algorithm_name="test", names=NAMES,
                        expected=expected, snapshot=lambda: snapshot, inbox=inbox, encoding=Encoding.RAW,
                        chunk_bytes=1 << 16, max_message_bytes=1 << 20)


class Node:
    """Rank 1 (n1) serving on loopback with lanes; with a `transport`, under its mutual TLS (lanes sealed)."""

    def __init__(self, transport: Transport | None = None):
        self.inbox: queue.Queue = queue.Queue()
        self.metrics = Metrics()
        self.served = {"w": torch.arange(N, dtype=torch.float32)}
        self.state: ServingState | None = serving(1, self.inbox, self.served)
        self.revoked: set[str] = set()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=GRPC_OPTIONS)
        self.servicer = PeerServicer(lambda: self.state, self.metrics, "test", node_id=lambda: "n1",
                                     lane_host="127.0.0.1", secure=transport is not None,
                                     revoked=lambda identity: identity.name in self.revoked)
        add_peer_servicer(self.servicer, self.server)
        port = transport.bind(self.server, "127.0.0.1:0") if transport else self.server.add_insecure_port(
            "127.0.0.1:0")
        self.address = f"127.0.0.1:{port}"
        self.server.start()

    def close(self) -> None:
        self.servicer.close()
        self.server.stop(grace=None)

    def direct_lanes(self) -> list[LaneSocket]:
        assert self.servicer.lanes is not None
        return [lane for lane in self.servicer.lanes._lanes.values() if lane.direct]

    def sample(self, name: str, **labels: str) -> float:
        return self.metrics.registry.get_sample_value(name, labels) or 0.0

    def rejections(self, src: str, reason: str) -> float:
        return self.sample("peertrain_stream_rejections_total", src=src, dst="n1", reason=reason)


@pytest.fixture
def node():
    served = Node()
    yield served
    served.close()


@pytest.fixture
def tls(cluster_pki):
    """n1 under mutual TLS, and `client(name)`: a PeerClient dialling it with node `name`'s certificate."""
    served = Node(Transport(cluster_pki(Role.NODE, "n1")))
    clients: list[PeerClient] = []

    def client(name: str) -> PeerClient:
        clients.append(PeerClient(served.address, transport=Transport(cluster_pki(Role.NODE, name)),
                                  server_name="n1"))
        return clients[-1]

    yield served, client
    for made in clients:
        made.close()
    served.close()


def message(rank: int = 0, value: float | None = None, seed: int = 0) -> Message:
    tensor = torch.randn(N, generator=torch.Generator().manual_seed(seed)) if value is None else torch.full(
        (N,), value)
    return Message(Kind.PARAMS, rank, 1, {"w": tensor}, clock=3)


def wait_for(condition, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


# -- round trips --------------------------------------------------------------------------------------------------


def test_push_and_exchange_travel_on_one_direct_lane_and_count_as_before(node):
    client, metrics = PeerClient(node.address), Metrics()
    state = serving(0, queue.Queue(), {})
    for seed in range(3):
        client.push(state, message(seed=seed), timeout=10, metrics=metrics)
        assert torch.equal(node.inbox.get_nowait().tensors["w"], message(seed=seed).tensors["w"])
    reply = client.exchange(state, message(seed=7), timeout=10, metrics=metrics)
    assert torch.equal(reply.tensors["w"], node.served["w"]) and reply.sender == 1 and reply.clock == 5
    assert torch.equal(node.inbox.get_nowait().tensors["w"], message(seed=7).tensors["w"])
    # Four calls, one direct lane granted once; no payload lane.
    assert len(node.direct_lanes()) == 1 and len(node.servicer.lanes._lanes) == 1 and not client._idle
    payload = 4 * N
    assert node.sample("peertrain_edge_bytes_received_total", job_id=JOB, src="n0", dst="n1") == 4 * payload
    assert node.sample("peertrain_edge_messages_received_total", job_id=JOB, src="n0", dst="n1") == 4
    assert node.sample("peertrain_edge_bytes_sent_total", job_id=JOB, src="n1", dst="n0") == payload
    client_sample = metrics.registry.get_sample_value
    assert client_sample("peertrain_edge_bytes_sent_total", {"job_id": JOB, "src": "n0", "dst": "n1"}) == 4 * payload
    assert client_sample("peertrain_edge_bytes_received_total", {"job_id": JOB, "src": "n1", "dst": "n0"}) == payload
    client.close()


def test_a_call_while_another_holds_the_lane_waits_for_it_and_goes_on_the_same_lane(node):
    """A synchronous round's next push, made while the push before it still waits for its answer, goes on the lane
    after it, not over gRPC with a payload lane of its own (a call's set-up and a thread's start)."""
    client, state = PeerClient(node.address), serving(0, queue.Queue(), {})
    client.push(state, message(seed=1), timeout=10, metrics=Metrics())
    node.inbox.get_nowait()
    (lane,) = client._direct.values()
    lane.lock.acquire()  # as a call on it that waits for its answer
    with futures.ThreadPoolExecutor(1) as pool:
        pushed = pool.submit(client.push, state, message(seed=2), 10, Metrics())
        time.sleep(0.2)
        assert not pushed.done() and node.inbox.empty()
        lane.lock.release()
        pushed.result(timeout=10)
    assert torch.equal(node.inbox.get_nowait().tensors["w"], message(seed=2).tensors["w"])
    assert list(client._direct.values()) == [lane] and len(node.servicer.lanes._lanes) == 1 and not client._idle
    client.close()


def test_a_call_that_waits_for_the_lane_past_its_deadline_fails_as_at_its_deadline(node):
    """Behind a call that holds the lane (a peer that stopped answering), the next call fails at its own deadline,
    not again over gRPC for as long."""
    client, state = PeerClient(node.address), serving(0, queue.Queue(), {})
    client.push(state, message(seed=1), timeout=10, metrics=Metrics())
    node.inbox.get_nowait()
    (lane,) = client._direct.values()
    lane.lock.acquire()
    started = time.monotonic()
    with pytest.raises(SendFailed) as failed:
        client.push(state, message(seed=2), timeout=0.3, metrics=Metrics())
    assert failed.value.reason == "deadline_exceeded" and time.monotonic() - started < 5
    assert node.inbox.empty() and len(node.servicer.lanes._lanes) == 1
    lane.lock.release()
    client.close()


class Outcomes:
    """The `done` of pushes written ahead: what each heard, in order."""

    def __init__(self) -> None:
        self.heard: list[SendFailed | None] = []

    def done(self, failure: SendFailed | None) -> None:
        self.heard.append(failure)

    def polled(self, poller, count: int = 1) -> bool:
        """Whether `count` pushes have heard, polling `poller` (a PeerClient or GrpcPeers) until then."""

        def heard() -> bool:
            poller.poll()
            return len(self.heard) >= count

        return wait_for(heard)


def open_direct_lane(node: Node) -> tuple[PeerClient, ServingState, Metrics, Outcomes]:
    """A client of rank 0 whose direct lane to `node` is open (one push made and taken), and the outcomes of the
    pushes it will write ahead."""
    client, state, metrics = PeerClient(node.address), serving(0, queue.Queue(), {}), Metrics()
    client.push(state, message(), timeout=10, metrics=metrics)
    node.inbox.get_nowait()
    return client, state, metrics, Outcomes()


def test_pushes_written_ahead_arrive_in_order_and_hear_of_their_answers_when_polled(node):
    """A push on the open direct lane is written from the calling thread without waiting for its answer; the answers
    are read when the caller polls, each push hears it was delivered, and is counted on the edge as a push is."""
    client, state, metrics = PeerClient(node.address), serving(0, queue.Queue(), {}), Metrics()
    outcomes = Outcomes()
    assert not client.begin_push(state, message(seed=0), 10, metrics, outcomes.done)  # no lane open yet
    client.push(state, message(seed=0), timeout=10, metrics=metrics)
    node.inbox.get_nowait()
    for seed in (1, 2, 3):
        assert client.begin_push(state, message(seed=seed), 10, metrics, outcomes.done)
    for seed in (1, 2, 3):
        assert torch.equal(node.inbox.get(timeout=5).tensors["w"], message(seed=seed).tensors["w"])
    (lane,) = client._direct.values()
    assert outcomes.heard == [] and len(lane.owed) == 3

    assert outcomes.polled(client, 3) and outcomes.heard == [None, None, None] and not lane.owed
    sent = metrics.registry.get_sample_value("peertrain_edge_messages_sent_total",
                                             {"job_id": JOB, "src": "n0", "dst": "n1"})
    assert sent == 4 and list(client._direct.values()) == [lane] and len(node.direct_lanes()) == 1
    client.close()


def test_a_lane_owed_its_most_answers_takes_no_more_pushes_ahead_and_a_call_reads_them_first(node, monkeypatch):
    client, state, metrics, outcomes = open_direct_lane(node)
    serve, release = node.servicer._direct_call, threading.Event()  # a peer slow to answer
    monkeypatch.setattr(node.servicer, "_direct_call", lambda lane, call: release.wait(10) and serve(lane, call))
    owed = peer_service.MAX_OWED_PER_LANE
    for seed in range(owed):
        assert client.begin_push(state, message(seed=seed), 10, metrics, outcomes.done)
    assert not client.begin_push(state, message(seed=9), 10, metrics, outcomes.done)
    release.set()
    reply = client.exchange(state, message(seed=8), timeout=10, metrics=metrics)  # reads the owed answers first
    assert torch.equal(reply.tensors["w"], node.served["w"]) and outcomes.heard == [None] * owed
    for seed in (*range(owed), 8):
        assert torch.equal(node.inbox.get_nowait().tensors["w"], message(seed=seed).tensors["w"])
    assert not client._direct[(JOB, 0)].owed
    client.close()


def test_a_refused_push_written_ahead_fails_so_do_those_after_it_and_the_next_push_opens_another_lane(node):
    """A refusal closes the lane at the peer: the refused push hears why, the pushes written after it were never
    read and fail as on a lost lane (the driver sends them again), and the next push goes on a new lane."""
    client, state, metrics, outcomes = open_direct_lane(node)
    (first,) = node.direct_lanes()
    assert client.begin_push(state, message(seed=1), 10, metrics, outcomes.done)
    assert client.begin_push(state, message(value=math.nan), 10, metrics, outcomes.done)
    assert client.begin_push(state, message(seed=2), 10, metrics, outcomes.done)

    assert outcomes.polled(client, 3)
    delivered, refused, unread = outcomes.heard
    assert delivered is None
    assert isinstance(refused, SendFailed) and refused.reason == "invalid_argument" and "non_finite" in str(refused)
    assert isinstance(unread, SendFailed) and unread.reason == "unavailable"
    assert torch.equal(node.inbox.get_nowait().tensors["w"], message(seed=1).tensors["w"]) and node.inbox.empty()
    assert not client._direct
    client.push(state, message(seed=4), timeout=10, metrics=metrics)
    assert torch.equal(node.inbox.get_nowait().tensors["w"], message(seed=4).tensors["w"])
    assert wait_for(lambda: node.direct_lanes() and first not in node.direct_lanes())
    client.close()


def test_a_push_written_ahead_that_gets_no_answer_fails_at_its_deadline(node, monkeypatch):
    client, state, metrics, outcomes = open_direct_lane(node)
    answered = threading.Event()  # a peer cut off: the call is read, no answer comes
    monkeypatch.setattr(node.servicer, "_direct_call", lambda lane, call: answered.wait(10) and False)
    assert client.begin_push(state, message(seed=1), 0.3, metrics, outcomes.done)
    client.poll()
    assert outcomes.heard == []

    assert outcomes.polled(client)
    answered.set()
    (lost,) = outcomes.heard
    assert isinstance(lost, SendFailed) and lost.reason == "deadline_exceeded" and not client._direct
    client.close()


def test_a_push_written_ahead_on_a_sealed_lane_is_sealed_and_answered(tls):
    node, client_of = tls
    client, state, metrics = client_of("n0"), serving(0, queue.Queue(), {}), Metrics()
    outcomes = Outcomes()
    client.push(state, message(), timeout=10, metrics=metrics)
    node.inbox.get_nowait()
    assert client.begin_push(state, message(seed=5), 10, metrics, outcomes.done)
    assert torch.equal(node.inbox.get(timeout=5).tensors["w"], message(seed=5).tensors["w"])

    assert outcomes.polled(client) and outcomes.heard == [None]
    (lane,) = node.direct_lanes()
    assert lane.sealed


def test_pushes_written_ahead_on_a_client_replaced_since_are_still_answered(node):
    """A renewed certificate replaces a neighbour's client (GrpcPeers.client): the answers owed to pushes written on
    the one before are still read, so that a refused one is still sent again."""
    state, metrics = serving(0, queue.Queue(), {}), Metrics()
    peers = GrpcPeers(state, {1: node.address}, metrics, 10)
    former = peers.client(1)
    former.push(state, message(), timeout=10, metrics=metrics)
    node.inbox.get_nowait()
    outcomes = Outcomes()
    assert peers.begin_push(message(seed=1), outcomes.done)
    with peers._lock:  # as a renewal does: the next call dials again, the former client may still hold calls
        peers._replaced.append(peers._clients.pop((node.address, "n1")))

    assert outcomes.polled(peers) and outcomes.heard == [None]
    peers.close()


def test_a_direct_lane_beside_tls_is_sealed_and_speaks_for_its_node(tls):
    node, client_of = tls
    client = client_of("n0")
    reply = client.exchange(serving(0, queue.Queue(), {}), message(), timeout=10, metrics=Metrics())
    assert torch.equal(reply.tensors["w"], node.served["w"])
    (lane,) = node.direct_lanes()
    assert lane.sealed and lane.grantee == "n0"
    # n2's certificate asking for rank 0's lane gets none, and its call over gRPC is refused.
    node.inbox.get_nowait()
    impostor = client_of("n2")
    with pytest.raises(grpc.RpcError) as refused:
        impostor.push(serving(0, queue.Queue(), {}), message(), timeout=10, metrics=Metrics())
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert node.inbox.empty() and node.direct_lanes() == [lane]


def test_a_revoked_certificate_delivers_nothing_more_on_its_open_lane(tls):
    node, client_of = tls
    client, state = client_of("n0"), serving(0, queue.Queue(), {})
    client.push(state, message(), timeout=10, metrics=Metrics())
    node.inbox.get_nowait()
    node.revoked.add("n0")
    with pytest.raises(SendFailed) as refused:
        client.push(state, message(seed=1), timeout=10, metrics=Metrics())
    assert refused.value.reason == "unauthenticated"
    assert node.inbox.empty() and node.rejections("n0", "revoked") == 1
    assert wait_for(lambda: not node.direct_lanes())


# -- refusals -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "reason"), [(math.nan, "non_finite"), (math.inf, "non_finite")])
def test_a_refused_call_leaves_the_inbox_and_the_next_call_opens_another_lane(node, value, reason):
    client, state = PeerClient(node.address), serving(0, queue.Queue(), {})
    client.push(state, message(), timeout=10, metrics=Metrics())
    node.inbox.get_nowait()
    (first,) = node.direct_lanes()
    with pytest.raises(SendFailed) as refused:
        client.exchange(state, message(value=value), timeout=10, metrics=Metrics())
    assert refused.value.reason == "invalid_argument" and reason in str(refused.value)
    assert node.inbox.empty() and node.rejections("unknown", reason) == 1
    assert wait_for(lambda: first not in node.direct_lanes())
    client.push(state, message(seed=4), timeout=10, metrics=Metrics())
    assert torch.equal(node.inbox.get_nowait().tensors["w"], message(seed=4).tensors["w"])
    assert node.direct_lanes() and node.direct_lanes()[0] is not first
    client.close()


def test_a_peer_that_does_not_answer_fails_the_call_at_its_deadline_as_grpc_would(node, monkeypatch):
    client, state = PeerClient(node.address), serving(0, queue.Queue(), {})
    client.push(state, message(), timeout=10, metrics=Metrics())
    answered = threading.Event()  # a peer cut off: the call is read, no answer comes
    monkeypatch.setattr(node.servicer, "_direct_call", lambda lane, call: answered.wait(10) and False)
    with pytest.raises(SendFailed) as lost:
        client.push(state, message(seed=1), timeout=0.5, metrics=Metrics())
    answered.set()
    assert lost.value.reason == "deadline_exceeded"
    client.close()


def test_a_full_inbox_refuses_the_call(node):
    client, state = PeerClient(node.address), serving(0, queue.Queue(), {})
    assert node.state is not None
    for _ in range(node.state.max_inbox):
        node.inbox.put(message())
    with pytest.raises(SendFailed) as refused:
        client.push(state, message(seed=1), timeout=10, metrics=Metrics())
    assert refused.value.reason == "resource_exhausted"
    assert node.inbox.qsize() == node.state.max_inbox
    client.close()


def test_a_node_that_no_longer_runs_the_job_answers_failed_precondition(node):
    client, state = PeerClient(node.address), serving(0, queue.Queue(), {})
    client.push(state, message(), timeout=10, metrics=Metrics())
    node.state = None
    with pytest.raises(SendFailed) as refused:
        client.push(state, message(), timeout=10, metrics=Metrics())
    assert refused.value.reason == "failed_precondition"
    client.close()


def raw_direct_lane(node: Node, rank: int) -> LaneSocket:
    """A direct lane granted to `rank`, as a client built from the proto files would open it."""
    stub = peer_pb2_grpc.PeerStub(grpc.insecure_channel(node.address))
    grant = stub.OpenLane(peer_pb2.LaneRequest(job_id=JOB, requester_rank=rank, requester_id=NAMES[rank],
                                               direct=True), timeout=10)
    assert grant.direct
    return dial("127.0.0.1", grant.port, grant.token, JOB, rank, 10)


def test_a_lane_granted_to_one_rank_cannot_send_as_another(node):
    lane = raw_direct_lane(node, 2)
    outgoing = plan(message(rank=0), job_id=JOB, sender_id="n0")
    stream_id = new_stream_id()
    frames = outgoing.lane_frames([lane.token], stream_id, [(0, outgoing.total)])
    send_call(lane, wire_pb2.LaneCall(frames=wire_pb2.Frames(frames=frames)), outgoing.lane_pieces(stream_id),
              outgoing.total)
    answer = read_call(lane)
    assert answer.status == grpc.StatusCode.PERMISSION_DENIED.value[0] and "wrong_identity" in answer.details
    assert node.inbox.empty()
    lane.close()


@pytest.mark.parametrize("garbage", [CALL_LENGTH.pack(64 << 20), CALL_LENGTH.pack(5) + b"\xff" * 5],
                         ids=["too_long", "not_protobuf"])
def test_a_call_that_does_not_parse_closes_the_lane(node, garbage):
    lane = raw_direct_lane(node, 0)
    lane.sock.sendall(garbage)
    lane.sock.settimeout(5)
    assert lane.sock.recv(1) == b""  # closed, unanswered
    assert node.inbox.empty() and wait_for(lambda: not node.direct_lanes())
    lane.close()


# -- lifetimes ----------------------------------------------------------------------------------------------------


def test_an_idle_direct_lane_is_closed_and_the_next_call_opens_another(node, monkeypatch):
    monkeypatch.setattr(peer_service, "DIRECT_IDLE_S", 0.2)
    client, state = PeerClient(node.address), serving(0, queue.Queue(), {})
    client.push(state, message(), timeout=10, metrics=Metrics())
    (first,) = node.direct_lanes()
    assert wait_for(lambda: not node.direct_lanes())
    client.push(state, message(seed=2), timeout=10, metrics=Metrics())
    assert node.inbox.qsize() == 2 and node.direct_lanes()[0] is not first
    client.close()


def test_a_peer_without_direct_lanes_is_called_over_grpc(node):
    assert node.servicer.lanes is not None
    node.servicer.lanes.serve = None  # as a node that predates direct lanes: it grants payload lanes only
    client, state = PeerClient(node.address), serving(0, queue.Queue(), {})
    reply = client.exchange(state, message(), timeout=10, metrics=Metrics())
    assert torch.equal(reply.tensors["w"], node.served["w"]) and node.inbox.qsize() == 1
    assert not node.direct_lanes() and client._idle[(JOB, 0)]
    client.close()


def test_lanes_closing_under_a_client_send_its_calls_over_grpc(node):
    client, state = PeerClient(node.address), serving(0, queue.Queue(), {})
    client.push(state, message(), timeout=10, metrics=Metrics())
    (lane,) = node.direct_lanes()
    node.servicer.close()  # its lanes: the gRPC server still serves
    assert wait_for(lambda: lane.closed)
    client.push(state, message(seed=3), timeout=10, metrics=Metrics())
    assert node.inbox.qsize() == 2 and not node.direct_lanes()
    client.close()



def test_a_rank_that_another_node_takes_over_is_counted_under_that_nodes_name():
    """Each edge's series are looked up once per job and peer; a state replaced with new names (a rank that another
    node took over) counts under the new name, not the cached old one."""
    metrics, state = Metrics(), serving(0, queue.Queue(), {})
    state.edge(metrics, 1).messages_sent.inc()
    taken_over = dataclasses.replace(state, names={**state.names, 1: "n9"})
    taken_over.edge(metrics, 1).messages_sent.inc()

    def sent(dst: str) -> float | None:
        return metrics.registry.get_sample_value("peertrain_edge_messages_sent_total",
                                                 {"job_id": JOB, "src": "n0", "dst": dst})

    assert sent("n1") == 1 and sent("n9") == 1
