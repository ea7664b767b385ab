"""The peer service over real gRPC on loopback: exchanges work, hostile streams are rejected whole and leave
the node's state untouched."""

import queue
from concurrent import futures

import grpc
import pytest
import torch
from test_codec import manifest_frame_bytes, serialized_field
from torch import nn

from nodeagent._proto import peer_pb2, peer_pb2_grpc, wire_pb2
from nodeagent.algorithms import Neighbor, NodeContext, build_algorithm
from nodeagent.jobspec import AlgorithmSpec
from nodeagent.metrics import Metrics
from nodeagent.rpc import GRPC_OPTIONS, add_servicer, grpc_code
from nodeagent.runtime.peer_service import PeerClient, PeerServicer, ServingState, add_peer_servicer
from nodeagent.wire import Encoding, Kind, Message, Status, WireError
from nodeagent.wire.encoder import encode

pytestmark = pytest.mark.integration

JOB = "job-1"


def dsgd(rank: int, peer: int):
    torch.manual_seed(0)
    context = NodeContext(rank, 2, (Neighbor(peer, 1, 0, 0.5),), AlgorithmSpec(name="dsgd"), self_weight=0.5)
    return build_algorithm(nn.Linear(4, 3), context)


def serving(algorithm, node_id: str, inbox: queue.Queue) -> ServingState:
    rank = algorithm.context.rank
    return ServingState(
        job_id=JOB, node_id=node_id, rank=rank, algorithm_name="dsgd", names={0: "n0", 1: "n1"},
        expected=algorithm.expected, snapshot=algorithm.snapshot, inbox=inbox, encoding=Encoding.RAW,
        chunk_bytes=16, max_message_bytes=1 << 20,
    )


@pytest.fixture
def node():
    """Rank 1 served on loopback; yields (algorithm, inbox, metrics, address)."""
    algorithm = dsgd(1, 0)
    inbox: queue.Queue = queue.Queue()
    metrics = Metrics()
    state = serving(algorithm, "n1", inbox)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=GRPC_OPTIONS)
    add_peer_servicer(PeerServicer(lambda: state, metrics, "test"), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield algorithm, inbox, metrics, f"127.0.0.1:{port}"
    server.stop(grace=None)


def frames_from_rank0(tensors=None, **header):
    sender = dsgd(0, 1)
    sender.w.fill_(7.0)
    message = Message(Kind.PARAMS, header.pop("sender", 0), 1, tensors or sender.params.views(sender.w), clock=3)
    return list(encode(message, job_id=header.pop("job_id", JOB), sender_id="n0", chunk_bytes=16))


def call_exchange(address: str, frames):
    stub = peer_pb2_grpc.PeerStub(grpc.insecure_channel(address, options=GRPC_OPTIONS))
    return list(stub.Exchange(iter(frames), timeout=10))


def state_of(algorithm) -> list[torch.Tensor]:
    return [algorithm.w.clone(), *(t.clone() for t in algorithm.last_copy.values())]


def test_exchange_swaps_parameters_and_counts_bytes(node):
    algorithm, inbox, metrics, address = node
    rank0 = dsgd(0, 1)
    rank0.w.fill_(7.0)
    client_state = serving(rank0, "n0", queue.Queue())
    client_metrics = Metrics()
    message = Message(Kind.PARAMS, 0, 1, rank0.params.views(rank0.w.clone()), clock=3)
    reply = PeerClient(address).exchange(client_state, message, timeout=10, metrics=client_metrics)
    assert torch.equal(rank0.params.flatten(reply.tensors), algorithm.w)
    received = inbox.get_nowait()
    assert received.sender == 0 and received.clock == 3
    algorithm.receive(received)
    assert torch.all(algorithm.last_copy[0] == 7.0)
    payload = algorithm.w.numel() * 4
    sample = metrics.registry.get_sample_value
    assert sample("peertrain_edge_bytes_received_total", {"job_id": JOB, "src": "n0", "dst": "n1"}) == payload
    assert sample("peertrain_edge_bytes_sent_total", {"job_id": JOB, "src": "n1", "dst": "n0"}) == payload
    client_sample = client_metrics.registry.get_sample_value
    assert client_sample("peertrain_exchange_seconds_count", {"job_id": JOB, "src": "n0", "dst": "n1"}) == 1


def drop_end(frames):
    return frames[:-1]


def extra_chunk(frames):
    return [*frames[:-1], wire_pb2.Frame(chunk=b"\0" * 4), frames[-1]]


def wrong_length(frames):
    frames[0].manifest.tensors[0].byte_length += 4
    return frames


def wrong_shape(frames):
    del frames[0].manifest.tensors[0].shape[:]
    frames[0].manifest.tensors[0].shape.extend([4, 3])
    return frames


def unknown_name(frames):
    frames[0].manifest.tensors[0].name = "encoder.weight"
    return frames


def half_a_chunk(frames):
    frames[2] = wire_pb2.Frame(chunk=frames[2].chunk[:5])
    return frames


@pytest.mark.parametrize(
    ("corrupt", "reason"),
    [
        (drop_end, "truncated"),
        (extra_chunk, "too_long"),
        (wrong_length, "bad_manifest"),
        (wrong_shape, "bad_manifest"),
        (unknown_name, "bad_manifest"),
        (half_a_chunk, "truncated"),
    ],
)
def test_hostile_stream_is_rejected_and_state_unchanged(node, corrupt, reason):
    algorithm, inbox, metrics, address = node
    before = state_of(algorithm)
    with pytest.raises(grpc.RpcError) as error:
        call_exchange(address, corrupt(frames_from_rank0()))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert reason in error.value.details()
    assert inbox.empty()
    assert all(torch.equal(a, b) for a, b in zip(before, state_of(algorithm), strict=True))
    assert metrics.registry.get_sample_value(
        "peertrain_stream_rejections_total", {"src": "unknown", "dst": "n1", "reason": reason}
    ) == 1


def test_stranger_and_wrong_job_are_refused(node):
    _, inbox, _, address = node
    with pytest.raises(grpc.RpcError) as stranger:
        call_exchange(address, frames_from_rank0(sender=5))
    assert stranger.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not_neighbor" in stranger.value.details()
    with pytest.raises(grpc.RpcError) as other_job:
        call_exchange(address, frames_from_rank0(job_id="job-2"))
    assert other_job.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert inbox.empty()


def test_describe_and_pull(node):
    _, _, _, address = node
    stub = peer_pb2_grpc.PeerStub(grpc.insecure_channel(address))
    description = stub.Describe(peer_pb2.DescribeRequest(), timeout=5)
    assert (description.node_id, description.rank, description.algorithm) == ("n1", 1, "dsgd")
    assert [h.name for h in description.served_tensors] == ["params/weight", "params/bias"]
    frames = list(stub.Pull(peer_pb2.PullRequest(job_id=JOB, requester_rank=0, kind=Kind.PARAMS), timeout=5))
    assert frames[0].manifest.sender_rank == 1 and frames[-1].WhichOneof("body") == "end"
    with pytest.raises(grpc.RpcError) as stranger:
        list(stub.Pull(peer_pb2.PullRequest(job_id=JOB, requester_rank=4, kind=Kind.PARAMS), timeout=5))
    assert stranger.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_node_without_a_job_refuses_exchanges():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    add_peer_servicer(PeerServicer(lambda: None, Metrics(), "test"), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with pytest.raises(grpc.RpcError) as error:
            call_exchange(f"127.0.0.1:{port}", frames_from_rank0())
        assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        server.stop(grace=None)


def test_every_wire_status_is_the_grpc_code_of_its_name():
    for status in Status:
        assert grpc_code(status).name == status.name


def raw_call(address: str, method: str, request):
    """Call a Peer method with requests sent as the bytes given (one for unary requests, an iterable otherwise)."""
    channel = grpc.insecure_channel(address, options=GRPC_OPTIONS)
    identity = lambda data: data  # noqa: E731
    if method in ("Exchange", "Push"):
        call = channel.stream_stream(f"/peertrain.v1.Peer/{method}", request_serializer=identity,
                                     response_deserializer=identity)
        return list(call(iter(request), timeout=30))
    call = channel.unary_unary(f"/peertrain.v1.Peer/{method}", request_serializer=identity,
                               response_deserializer=identity)
    return call(request, timeout=30)


def rejections(metrics: Metrics, reason: str) -> float | None:
    return metrics.registry.get_sample_value(
        "peertrain_stream_rejections_total", {"src": "unknown", "dst": "n1", "reason": reason})


@pytest.mark.parametrize("method", ["Exchange", "Push"])
@pytest.mark.parametrize("megabytes", [3, 61], ids=["100k_tensors", "61MB"])
def test_an_oversized_manifest_is_refused_before_it_is_parsed_and_counted(node, method, megabytes):
    algorithm, inbox, metrics, address = node
    before = state_of(algorithm)
    frame = manifest_frame_bytes(megabytes)
    with pytest.raises(grpc.RpcError) as error:
        raw_call(address, method, [frame])
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.details().startswith("too_large") and len(error.value.details()) < 200
    assert rejections(metrics, "too_large") == 1 and inbox.empty()
    assert all(torch.equal(a, b) for a, b in zip(before, state_of(algorithm), strict=True))


def test_an_oversized_request_on_lanes_is_refused_before_it_is_parsed(node):
    _, inbox, metrics, address = node
    request = serialized_field(1, manifest_frame_bytes(2))  # Frames{frames: [a 2 MB manifest frame]}
    with pytest.raises(grpc.RpcError) as error:
        raw_call(address, "PushOnLane", request)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and error.value.details().startswith("too_large")
    assert rejections(metrics, "too_large") == 1 and inbox.empty()


@pytest.mark.parametrize(
    "corrupt",
    [lambda m: setattr(m.tensors[0], "name", "w" * 300),
     lambda m: [m.tensors.add(name=f"t{i}", dtype="float32", shape=[1], byte_length=4) for i in range(5000)]],
    ids=["name_of_300_chars", "5000_tensors"],
)
def test_a_manifest_beyond_the_limits_is_refused_before_the_expectation(node, corrupt):
    _, inbox, metrics, address = node
    frames = frames_from_rank0()
    corrupt(frames[0].manifest)
    with pytest.raises(grpc.RpcError) as error:
        call_exchange(address, frames)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.details().startswith("manifest_limit") and len(error.value.details()) < 200
    assert rejections(metrics, "manifest_limit") == 1 and inbox.empty()


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("lanes", [False, True], ids=["frames", "lanes"])
def test_a_nonfinite_exchange_is_refused_counted_and_changes_nothing(node, value, lanes):
    algorithm, inbox, metrics, address = node
    before = state_of(algorithm)
    rank0 = dsgd(0, 1)
    poisoned = rank0.w.clone()
    poisoned[3] = value
    message = Message(Kind.PARAMS, 0, 1, rank0.params.views(poisoned), clock=3)
    client = PeerClient(address, lanes=lanes)
    with pytest.raises(grpc.RpcError) as error:
        client.exchange(serving(rank0, "n0", queue.Queue()), message, timeout=10, metrics=Metrics())
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "non_finite" in error.value.details()
    assert rejections(metrics, "non_finite") == 1 and inbox.empty()
    assert all(torch.equal(a, b) for a, b in zip(before, state_of(algorithm), strict=True))
    client.close()


def test_a_nonfinite_reply_is_refused_by_the_client(node):
    algorithm, _, _, address = node
    with torch.no_grad():
        algorithm.w[0] = float("nan")  # rank 1 serves a NaN model
    algorithm.republish()
    rank0 = dsgd(0, 1)
    message = Message(Kind.PARAMS, 0, 1, rank0.params.views(rank0.w.clone()), clock=3)
    client = PeerClient(address, lanes=False)
    with pytest.raises(WireError) as error:
        client.exchange(serving(rank0, "n0", queue.Queue()), message, timeout=10, metrics=Metrics())
    assert error.value.reason == "non_finite"
    with pytest.raises(WireError) as error:
        client.pull(serving(rank0, "n0", queue.Queue()), 1, Kind.PARAMS, timeout=10, metrics=Metrics())
    assert error.value.reason == "non_finite"
    client.close()


def test_add_servicer_refuses_a_method_the_service_does_not_have():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    with pytest.raises(ValueError, match="Exchnage"):
        add_servicer(peer_pb2_grpc.add_PeerServicer_to_server, PeerServicer(lambda: None, Metrics(), "test"), server,
                     raw_requests=("Exchnage",))


@pytest.mark.parametrize("method", ["exchange", "push"])
def test_a_full_inbox_refuses_with_resource_exhausted_and_takes_again_once_drained(node, method):
    algorithm, inbox, metrics, address = node
    state = serving(algorithm, "n1", inbox)
    waiting = [f"item {i}" for i in range(state.max_inbox)]
    for item in waiting:
        inbox.put(item)
    rank0 = dsgd(0, 1)
    message = Message(Kind.PARAMS, 0, 1, rank0.params.views(rank0.w.clone()), clock=3)
    client, client_state = PeerClient(address), serving(rank0, "n0", queue.Queue())
    send = getattr(client, method)
    with pytest.raises(grpc.RpcError) as error:
        send(client_state, message, timeout=10, metrics=Metrics())
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "inbox_full" in error.value.details()
    assert rejections(metrics, "inbox_full") == 1 and inbox.qsize() == state.max_inbox == 16
    inbox.get_nowait()  # the runner took one
    send(client_state, message, timeout=10, metrics=Metrics())
    assert list(inbox.queue)[:-1] == waiting[1:] and inbox.queue[-1].clock == 3
    client.close()
