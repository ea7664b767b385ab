"""The gRPC runtime's network half: the Peer service a node serves, and the client it dials neighbours with.

Network threads never call into an algorithm's mutable state: the servicer validates a stream against the
job's (immutable) expectations, puts the decoded message on the node's inbox, and answers from the published
snapshot. The training thread drains the inbox between steps.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import grpc

from nodeagent._proto import peer_pb2, peer_pb2_grpc, wire_pb2
from nodeagent.algorithms.base import Snapshot
from nodeagent.metrics import Metrics
from nodeagent.wire.codec import WireError, decode, encode
from nodeagent.wire.message import DTYPE_NAMES, Encoding, Kind, Message, TensorSpec

# gRPC's per-frame limit must hold the largest chunk a job may configure (jobspec.WireSpec.chunk_bytes) plus the
# frame's own overhead; the size of a whole stream is limited by the decoder (max_message_bytes).
MAX_FRAME_BYTES = (64 << 20) + (1 << 16)
GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_FRAME_BYTES),
    ("grpc.max_send_message_length", MAX_FRAME_BYTES),
]


@dataclass(frozen=True)
class ServingState:
    """What the servicer needs to answer peers during one job; replaced whole when the job changes."""

    job_id: str
    node_id: str
    rank: int
    algorithm_name: str
    names: dict[int, str]  # rank -> node id, for metric labels
    expected: Callable[[int, Kind], list[TensorSpec]]  # reads only the job's immutable configuration
    snapshot: Callable[[], Snapshot]  # the latest published snapshot
    inbox: queue.Queue[Message]
    encoding: Encoding
    chunk_bytes: int
    max_message_bytes: int

    def name_of(self, rank: int) -> str:
        return self.names.get(rank, f"rank{rank}")

    def expectation(self, manifest: wire_pb2.Manifest) -> list[TensorSpec]:
        if manifest.job_id != self.job_id:
            raise WireError(
                "wrong_job", f"stream for job {manifest.job_id!r}, this node runs {self.job_id!r}",
                grpc.StatusCode.FAILED_PRECONDITION,
            )
        if manifest.receiver_rank != self.rank:
            raise WireError("wrong_receiver", f"stream for rank {manifest.receiver_rank}, this node is {self.rank}")
        return self.expected(manifest.sender_rank, Kind(manifest.kind))


def counted(frames: Iterable[wire_pb2.Frame], count: Callable[[int], None]) -> Iterator[wire_pb2.Frame]:
    """Pass frames through, reporting the payload bytes of each chunk."""
    for frame in frames:
        if frame.WhichOneof("body") == "chunk":
            count(len(frame.chunk))
        yield frame


class PeerServicer(peer_pb2_grpc.PeerServicer):
    def __init__(self, current: Callable[[], ServingState | None], metrics: Metrics, version: str):
        self._current = current
        self._metrics = metrics
        self._version = version

    def _state(self, context: grpc.ServicerContext) -> ServingState:
        state = self._current()
        if state is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this node runs no job")
        return state

    def _receive(self, state: ServingState, frames: Iterable[wire_pb2.Frame], context: grpc.ServicerContext) -> Message:
        received = 0

        def count(n: int) -> None:
            nonlocal received
            received += n

        try:
            message = decode(counted(frames, count), state.expectation, state.max_message_bytes)
        except WireError as error:
            self._metrics.stream_rejections.labels("unknown", state.node_id, error.reason).inc()
            context.abort(error.code, str(error))
        src = state.name_of(message.sender)
        self._metrics.edge_bytes_received.labels(src, state.node_id).inc(received)
        self._metrics.edge_messages_received.labels(src, state.node_id).inc()
        return message

    def _send(self, state: ServingState, message: Message) -> Iterator[wire_pb2.Frame]:
        dst = state.name_of(message.receiver)
        sent_bytes = self._metrics.edge_bytes_sent.labels(state.node_id, dst)
        frames = encode(
            message, job_id=state.job_id, sender_id=state.node_id, encoding=state.encoding,
            chunk_bytes=state.chunk_bytes,
        )
        yield from counted(frames, sent_bytes.inc)
        self._metrics.edge_messages_sent.labels(state.node_id, dst).inc()

    def Exchange(self, request_iterator, context):
        state = self._state(context)
        message = self._receive(state, request_iterator, context)
        reply = state.snapshot().message_for(message.sender, message.kind)
        if reply is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"this node serves no {message.kind.name.lower()}")
        state.inbox.put(message)
        yield from self._send(state, reply)

    def Pull(self, request, context):
        state = self._state(context)
        if request.job_id != state.job_id:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"this node runs job {state.job_id!r}")
        if request.kind not in Kind._value2member_map_:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown message kind {request.kind}")
        kind = Kind(request.kind)
        try:
            state.expected(request.requester_rank, kind)
        except WireError as error:
            context.abort(error.code, str(error))
        reply = state.snapshot().message_for(request.requester_rank, kind)
        if reply is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"this node serves no {kind.name.lower()}")
        yield from self._send(state, reply)

    def Push(self, request_iterator, context):
        state = self._state(context)
        message = self._receive(state, request_iterator, context)
        state.inbox.put(message)
        return peer_pb2.PushReply(bytes_received=message.payload_bytes)

    def Describe(self, request, context):
        state = self._current()
        if state is None:
            return peer_pb2.NodeDescription(version=self._version)
        snapshot = state.snapshot()
        served = []
        for (_peer, kind), tensors in snapshot.served.items():
            for name, tensor in tensors.items():
                served.append(
                    wire_pb2.TensorHeader(name=f"{kind.name.lower()}/{name}", dtype=DTYPE_NAMES[tensor.dtype],
                                          shape=list(tensor.shape))
                )
        return peer_pb2.NodeDescription(
            node_id=state.node_id, job_id=state.job_id, rank=state.rank, algorithm=state.algorithm_name,
            clock=snapshot.clock, loss=snapshot.loss, neighbor_ranks=sorted(r for r in state.names if r != state.rank),
            served_tensors=served, version=self._version,
        )


def failure_reason(error: grpc.RpcError) -> str:
    code = error.code() if hasattr(error, "code") else None
    return code.name.lower() if code is not None else "error"


class PeerClient:
    """Dials one neighbour. Every call validates what comes back before returning it."""

    def __init__(self, address: str):
        self.address = address
        self.channel = grpc.insecure_channel(address, options=GRPC_OPTIONS)
        self.stub = peer_pb2_grpc.PeerStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    @staticmethod
    def _outgoing(state: ServingState, message: Message, metrics: Metrics) -> Iterator[wire_pb2.Frame]:
        sent = metrics.edge_bytes_sent.labels(state.node_id, state.name_of(message.receiver))
        frames = encode(
            message, job_id=state.job_id, sender_id=state.node_id, encoding=state.encoding,
            chunk_bytes=state.chunk_bytes,
        )
        return counted(frames, sent.inc)

    def push(self, state: ServingState, message: Message, timeout: float, metrics: Metrics) -> None:
        """Stream our message to the peer, which absorbs it. Counts traffic on the edge."""
        dst = state.name_of(message.receiver)
        started = time.perf_counter()
        self.stub.Push(self._outgoing(state, message, metrics), timeout=timeout)
        metrics.edge_messages_sent.labels(state.node_id, dst).inc()
        metrics.exchange_seconds.labels(state.node_id, dst).observe(time.perf_counter() - started)

    @staticmethod
    def _incoming(state: ServingState, replies, peer: int, metrics: Metrics) -> Message:
        """Decode the peer's answer, checked like any received stream, and count it on the edge."""
        received_bytes = 0

        def count(n: int) -> None:
            nonlocal received_bytes
            received_bytes += n

        def expect_reply(manifest: wire_pb2.Manifest) -> list[TensorSpec]:
            if manifest.sender_rank != peer:
                raise WireError("wrong_sender", f"reply from rank {manifest.sender_rank}, asked {peer}")
            return state.expectation(manifest)

        try:
            reply = decode(counted(replies, count), expect_reply, state.max_message_bytes)
        except WireError:
            replies.cancel()
            raise
        src = state.name_of(peer)
        metrics.edge_bytes_received.labels(src, state.node_id).inc(received_bytes)
        metrics.edge_messages_received.labels(src, state.node_id).inc()
        return reply

    def exchange(self, state: ServingState, message: Message, timeout: float, metrics: Metrics) -> Message:
        """Send our message, return the peer's reply for the same edge. Counts traffic on the edge."""
        dst = state.name_of(message.receiver)
        started = time.perf_counter()
        replies = self.stub.Exchange(self._outgoing(state, message, metrics), timeout=timeout)
        reply = self._incoming(state, replies, message.receiver, metrics)
        metrics.edge_messages_sent.labels(state.node_id, dst).inc()
        metrics.exchange_seconds.labels(state.node_id, dst).observe(time.perf_counter() - started)
        return reply

    def pull(self, state: ServingState, peer: int, kind: Kind, timeout: float, metrics: Metrics) -> Message:
        """Fetch the peer's latest snapshot of `kind` for this node."""
        started = time.perf_counter()
        request = peer_pb2.PullRequest(
            job_id=state.job_id, requester_rank=state.rank, requester_id=state.node_id, kind=int(kind)
        )
        reply = self._incoming(state, self.stub.Pull(request, timeout=timeout), peer, metrics)
        metrics.exchange_seconds.labels(state.node_id, state.name_of(peer)).observe(time.perf_counter() - started)
        return reply
