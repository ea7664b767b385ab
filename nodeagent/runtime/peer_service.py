"""The agent's peer transport: the Peer service a node serves, and the client it dials neighbours with.

Network threads never call into an algorithm's mutable state: the servicer validates a stream against the
job's (immutable) expectations, puts the decoded message on the node's inbox, and answers from the published
snapshot. The training thread drains the inbox between steps.

Payload bytes travel in one of two ways (nodeagent/wire/lane.py says why): on lanes, side TCP connections that
the receiver granted to this peer over gRPC, straight from the tensor's memory into the destination buffer (a
large payload striped over several lanes at once); or, when the peer offers no lanes, in chunk frames on the
gRPC stream itself, which the client builds and reads by hand (serialized frame bytes, no protobuf copies of the
payload). Either way the manifest and end frames, the status, the deadline and the metrics are gRPC's, and every
stream is validated before any state is touched.
"""

from __future__ import annotations

import contextlib
import functools
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from typing import NoReturn

import grpc
import grpc.experimental
from google.protobuf.message import DecodeError
from prometheus_client import Counter, Histogram

from nodeagent._proto import peer_pb2, peer_pb2_grpc, wire_pb2
from nodeagent.algorithms.base import SendFailed, Snapshot
from nodeagent.metrics import Metrics
from nodeagent.rpc import GRPC_OPTIONS, add_servicer, failure_reason, grpc_code
from nodeagent.runtime.limits import DEFAULT_LIMITS, Stream, StreamGuard, StreamLimits
from nodeagent.runtime.progress import Traffic
from nodeagent.security.authz import rules_for
from nodeagent.security.pki import Identity, Role
from nodeagent.security.tls import Transport, caller
from nodeagent.text import clip
from nodeagent.wire.decoder import Receiver
from nodeagent.wire.encoder import Outgoing, plan
from nodeagent.wire.errors import Reason, Status, WireError
from nodeagent.wire.frames import MAX_CONTROL_FRAME_BYTES, counted, new_stream_id, serialize
from nodeagent.wire.lane import (
    COALESCE_BYTES,
    DIRECT_IDLE_S,
    KEY_BYTES,
    LaneHub,
    LaneSocket,
    call_bytes,
    dial,
    read_call,
    send_call,
    split_host,
    stripes_for,
)
from nodeagent.wire.message import DTYPE_NAMES, Encoding, Kind, Message, TensorSpec
from nodeagent.wire.pool import BufferPool
from nodeagent.wire.striping import run_on_lanes

_SERVICE = "peertrain.v1.Peer"
# Who may call each method (the daemon installs `Authorizer(PEER_RULES, revoked)`); what a node may do on a call is
# checked by the servicer: only its own edges, as itself.
_NODES = frozenset({Role.NODE})
PEER_RULES = rules_for(_SERVICE, {
    "Exchange": _NODES, "Pull": _NODES, "Push": _NODES, "PushOnLane": _NODES, "ExchangeOnLane": _NODES,
    "OpenLane": _NODES,
    "Describe": frozenset({Role.NODE, Role.COORDINATOR}),  # the coordinator asks whether a node still answers
})
MAX_DETAIL_CHARS = 300  # of a refusal's details: they may quote what the caller sent, which has no bound

# A peer's message waits in the node's inbox until the runner hands it over between steps: a few per peer (a
# synchronous neighbour is at most a round or two ahead, an exchange or two in flight). Beyond, a stream is refused
# with RESOURCE_EXHAUSTED rather than held (a flood, or a node too slow for its peers), and no server thread waits.
INBOX_MESSAGES_PER_PEER = 8
# A thread that wakes from a socket must take the GIL back before it can go on; with Python's default switch
# interval (5 ms) it waits up to that long while another thread runs Python code (the runner between steps, another
# lane). An agent runs with this interval instead (`serve_promptly`): a direct-lane exchange of one element between
# two processes went from 6.3 ms to 1.2 ms (medians) on a loaded 2-core machine, the minimum 1.0-1.1 ms either way.
GIL_SWITCH_INTERVAL_S = 0.0005
LANE_RETRY_S = 30.0  # after a peer refused lanes (or could not be dialled), frames only for this long
DIRECT_RETRY_S = 1.0  # after a direct lane could not be opened, calls go over gRPC for this long
LANE_SETUP_TIMEOUT_S = 5.0
IDLE_LANES_PER_PEER = 8
# Pushes written ahead on one direct lane whose answers are still to be read (`PeerClient.begin_push`): a synchronous
# neighbour is a round or two behind at most. Beyond, a push waits for the answers on a pool thread, as before.
MAX_OWED_PER_LANE = 4
# A client's lane payloads are written by these threads while the calling thread runs the gRPC call itself
# (blocking calls poll their own completion queue: no thread is started per call, unlike gRPC's futures).
# A writer is held for as long as its peer takes to read (at most the call's deadline), hence a generous bound.
_LANE_WRITERS = futures.ThreadPoolExecutor(max_workers=32, thread_name_prefix="lane-writer")


def serve_promptly() -> None:
    """Let this process's I/O threads take the GIL back promptly (GIL_SWITCH_INTERVAL_S)."""
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)


@dataclass(frozen=True)
class EdgeSeries:
    """This node's series of one edge (both directions), looked up once per job and peer: a labelled lookup costs
    about 2 us, and a small model's message took five of them."""

    metrics: Metrics  # whose series these are
    bytes_sent: Counter
    bytes_received: Counter
    messages_sent: Counter
    messages_received: Counter
    exchange_seconds: Histogram

    @staticmethod
    def of(metrics: Metrics, job_id: str, node_id: str, peer: str) -> EdgeSeries:
        return EdgeSeries(metrics, metrics.edge_bytes_sent.labels(job_id, node_id, peer),
                          metrics.edge_bytes_received.labels(job_id, peer, node_id),
                          metrics.edge_messages_sent.labels(job_id, node_id, peer),
                          metrics.edge_messages_received.labels(job_id, peer, node_id),
                          metrics.exchange_seconds.labels(job_id, node_id, peer))


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
    device: str = "cpu"  # where received tensors are delivered (a CUDA device: through pinned staging buffers)
    # Receive buffers of this job, reused once no received tensor made from them is alive (wire/pool.py).
    buffers: BufferPool = field(default_factory=BufferPool, compare=False, repr=False)
    traffic: Traffic = field(default_factory=Traffic, compare=False, repr=False)  # this job's payload bytes
    # Per peer rank; a state replaced with new names starts without any (init=False: `replace` makes a new one).
    _edges: dict[int, EdgeSeries] = field(default_factory=dict, init=False, compare=False, repr=False)

    def name_of(self, rank: int) -> str:
        return self.names.get(rank, f"rank{rank}")

    @property
    def max_inbox(self) -> int:
        """Items the inbox may hold before a peer's message is refused: INBOX_MESSAGES_PER_PEER per rank in `names`
        (the neighbours and this node). The runner also posts the outcomes of the node's own calls there, one per
        call in flight, and concurrent streams may each pass the check: the bound holds within a server pool."""
        return INBOX_MESSAGES_PER_PEER * len(self.names)

    def edge(self, metrics: Metrics, rank: int) -> EdgeSeries:
        """The series of this node's edge with `rank` in `metrics` (two threads may build them at once: alike)."""
        series = self._edges.get(rank)
        if series is None or series.metrics is not metrics:
            series = self._edges[rank] = EdgeSeries.of(metrics, self.job_id, self.node_id, self.name_of(rank))
        return series

    def sent_to(self, metrics: Metrics, rank: int) -> Callable[[int], None]:
        """Counts payload bytes sent to `rank`, on the edge's metric and in this job's traffic."""
        edge = self.edge(metrics, rank).bytes_sent

        def count(n: int) -> None:
            edge.inc(n)
            self.traffic.add_sent(rank, n)

        return count

    def received_from(self, metrics: Metrics, rank: int) -> Callable[[int], None]:
        """Counts payload bytes received from `rank`, on the edge's metric and in this job's traffic."""
        edge = self.edge(metrics, rank).bytes_received

        def count(n: int) -> None:
            edge.inc(n)
            self.traffic.add_received(rank, n)

        return count

    def is_neighbor(self, node: str) -> bool:
        return any(name == node for rank, name in self.names.items() if rank != self.rank)

    def check_peer(self, rank: int, claimed_id: str, node: str | None) -> None:
        """Refuse (PERMISSION_DENIED) a stream or request on the edge `rank` -> this node unless it comes from the
        node assigned `rank` and names that node as its sender (`claimed_id`): `node` is the caller's name, from its
        certificate. With None (an insecure server, where nothing proves who calls) nothing is checked here."""
        if node is None:
            return
        if not self.is_neighbor(node):
            raise WireError(Reason.NOT_NEIGHBOR,
                            f"node {node} is no neighbour of {self.node_id}", Status.PERMISSION_DENIED)
        if rank == self.rank or self.names.get(rank) != node or claimed_id != node:
            raise WireError(Reason.WRONG_IDENTITY, f"node {node} may send only as itself on its own edge, not as rank "
                            f"{rank}", Status.PERMISSION_DENIED)

    def expectation(self, manifest: wire_pb2.Manifest) -> list[TensorSpec]:
        if manifest.job_id != self.job_id:
            raise WireError(
                Reason.WRONG_JOB, f"stream for job {manifest.job_id!r}, this node runs {self.job_id!r}",
                Status.FAILED_PRECONDITION,
            )
        if manifest.receiver_rank != self.rank:
            raise WireError(Reason.WRONG_RECEIVER,
                            f"stream for rank {manifest.receiver_rank}, this node is {self.rank}")
        return self.expected(manifest.sender_rank, Kind(manifest.kind))

    def outgoing(self, message: Message) -> Outgoing:
        return plan(
            message, job_id=self.job_id, sender_id=self.node_id, encoding=self.encoding, chunk_bytes=self.chunk_bytes
        )

    def receiver(self, expect: Callable[[wire_pb2.Manifest], list[TensorSpec]], lanes=None) -> Receiver:
        return Receiver(
            expect, self.max_message_bytes, pool=self.buffers, device=self.device, lanes=lanes,
            chunk_bytes=self.chunk_bytes,
        )


def _remaining(context: grpc.ServicerContext, stream: Stream) -> float:
    """Time left for a stream's lane I/O: its budget (limits.py), or a little less than the call's when that ends
    first, so that a stalled lane ends in a clear status (truncated) rather than in the caller's
    DEADLINE_EXCEEDED."""
    budget = stream.seconds_left()
    remaining = context.time_remaining()
    if remaining is None:
        return budget
    return min(budget, max(0.001, remaining - min(1.0, 0.1 * remaining)))


def _write_share(outgoing: Outgoing, lane: LaneSocket, stream_id: bytes, share: tuple[int, int],
                 seconds: float | None) -> None:
    lane.set_timeout(seconds)
    lane.send(outgoing.lane_pieces(stream_id, *share))


def _write_shares(outgoing: Outgoing, lanes: list[LaneSocket], stream_id: bytes, shares: list[tuple[int, int]],
                  seconds: float | None) -> None:
    """Write each share of the payload on its lane, the lanes concurrently (the first in this thread). Raises
    OSError when any lane fails; all of them are shut down then."""
    tasks = [functools.partial(_write_share, outgoing, lane, stream_id, share, seconds)
             for lane, share in zip(lanes, shares, strict=True)]
    run_on_lanes(tasks, lanes, _LANE_WRITERS)


class PeerServicer(peer_pb2_grpc.PeerServicer):
    """The Peer service. With `lane_host` it also listens for lanes there (port `lane_port`, 0: any free one);
    the host must be one the node's peers can reach it on, normally the host of its gRPC listen address. On a
    `secure` server the lanes are sealed with a key that OpenLane gives its authenticated caller.
    `node_id` names the node in `Describe` even when it runs no job, so that the coordinator can tell whether a
    node still answers at the address it registered before.

    On a `secure` server (mutual TLS) every call needs a node certificate, and a node acts only on its own edges as
    itself: a stream or request naming rank r comes from the node assigned r, a neighbour of this node. Without
    `secure`, a call without a certificate is served as before any TLS: for local experiments only. Either way a
    caller has a few streams at once, and streams that stop moving are ended (`limits`, limits.py)."""

    def __init__(
        self,
        current: Callable[[], ServingState | None],
        metrics: Metrics,
        version: str,
        *,
        node_id: Callable[[], str] = str,
        lane_host: str | None = None,
        lane_port: int = 0,
        secure: bool = False,
        limits: StreamLimits = DEFAULT_LIMITS,
        revoked: Callable[[Identity], bool] = lambda identity: False,
    ):
        self._current = current
        self._metrics = metrics
        self._version = version
        self._node_id = node_id
        self.secure = secure
        self._limits = limits
        self._revoked = revoked  # checked on every call of a direct lane (the daemon's Authorizer checks gRPC calls)
        self.lanes = LaneHub(lane_host, lane_port, sealed=secure, serve=self._serve_direct) \
            if lane_host is not None else None
        self._streams = StreamGuard(limits, metrics)

    def close(self) -> None:
        """Stop listening for lanes, close the open ones and stop the stream watchdog (the gRPC server is the
        caller's to stop)."""
        if self.lanes is not None:
            self.lanes.close()
        self._streams.stop()

    def _state(self, context: grpc.ServicerContext) -> ServingState:
        state = self._current()
        if state is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this node runs no job")
        return state

    def _caller(self, context: grpc.ServicerContext, roles: frozenset[Role] = _NODES) -> Identity | None:
        """The caller's identity, None on an insecure server. A secure server refuses a call without a usable
        certificate (UNAUTHENTICATED) or of another role (PERMISSION_DENIED). The daemon's Authorizer refuses them
        first, but the edge checks compare names only, so that an operator named like a node must never get here."""
        identity = caller(context)
        if identity is None:
            if self.secure:
                context.abort(grpc.StatusCode.UNAUTHENTICATED, "no peertrain certificate")
            return None
        if identity.role not in roles:
            needed = " or ".join(sorted(roles))
            context.abort(grpc.StatusCode.PERMISSION_DENIED, f"this call needs a {needed} certificate; the caller "
                          f"is {identity}")
        return identity

    def _refuse(self, context: grpc.ServicerContext, identity: Identity | None, dst: str,
                error: WireError) -> NoReturn:
        """Count a refused call and end it with the error's status; the details are clipped."""
        src = identity.name if identity is not None else "unknown"
        self._metrics.stream_rejections.labels(src, dst, error.reason).inc()
        context.abort(grpc_code(error.status), clip(str(error), MAX_DETAIL_CHARS))

    def _admit(self, context: grpc.ServicerContext, state: ServingState, identity: Identity | None, rank: int,
               claimed_id: str) -> None:
        """Refuse a request on the edge `rank` -> this node unless `identity` may make it (ServingState.check_peer)."""
        try:
            state.check_peer(rank, claimed_id, identity.name if identity is not None else None)
        except WireError as error:
            self._refuse(context, identity, state.node_id, error)

    @contextlib.contextmanager
    def _stream(self, context: grpc.ServicerContext, identity: Identity | None,
                state: ServingState) -> Iterator[Stream]:
        """A stream of the caller's for the duration of the block, or RESOURCE_EXHAUSTED at once when it has as many
        open as it may. The caller is its certificate's node, or on an insecure server its address and port (the
        agents of one host share an address)."""
        key = identity.name if identity is not None else context.peer()
        src = identity.name if identity is not None else "unknown"
        stream = self._streams.open(key, context, src, state.node_id)
        if stream is None:
            self._metrics.stream_rejections.labels(src, state.node_id, Reason.TOO_MANY_STREAMS).inc()
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"too_many_streams: at most {self._streams.limits.streams_per_peer} at once from one peer")
        try:
            yield stream
        finally:
            self._streams.close(stream)

    def _receive(
        self, state: ServingState, identity: Identity | None, stream: Stream,
        frames: Iterable[wire_pb2.Frame | bytes], context: grpc.ServicerContext,
    ) -> tuple[Message, list[LaneSocket]]:
        """Decode and validate a stream; returns the message and the lanes its payload came on (still claimed). The
        sender is checked against the caller's certificate before anything else."""
        claimed: list[LaneSocket] = []
        node = identity.name if identity is not None else None

        def expect(manifest: wire_pb2.Manifest) -> list[TensorSpec]:
            state.check_peer(manifest.sender_rank, manifest.sender_id, node)
            specs = state.expectation(manifest)
            stream.allow(sum(spec.numel * spec.dtype.itemsize for spec in specs))
            return specs

        def resolve(lane: wire_pb2.Lane, manifest: wire_pb2.Manifest) -> LaneSocket:
            if self.lanes is None:
                raise WireError(Reason.BAD_LANE, "this node offers no lanes")
            socket = self.lanes.claim(lane.token, state.job_id, manifest.sender_rank)
            claimed.append(socket)
            socket.set_timeout(_remaining(context, stream))
            return socket

        receiver = state.receiver(expect, resolve)
        error: WireError | None = None
        try:
            for frame in frames:
                receiver.feed(frame)
            message = receiver.result()
        except WireError as rejected:
            # Without its traceback the error no longer holds the receiver's frames, so the receive buffers
            # are free for the pool at once rather than when the garbage collector finds the cycle.
            error = rejected.with_traceback(None)
        except BaseException:
            self._release(claimed, False)
            raise
        if error is not None:
            del receiver
            self._release(claimed, False)
            self._refuse(context, identity, state.node_id, error)
        state.received_from(self._metrics, message.sender)(receiver.received)
        state.edge(self._metrics, message.sender).messages_received.inc()
        return message, claimed

    def _send(
        self, state: ServingState, stream: Stream, message: Message, context: grpc.ServicerContext,
        lanes: list[LaneSocket], batched: bool,
    ) -> Iterator[wire_pb2.Frame | wire_pb2.Frames]:
        """The reply stream: Frame messages, or Frames messages when `batched`. On lanes, the Manifest, Lane and
        End frames go first and the payload follows on the lanes."""
        sent = state.sent_to(self._metrics, message.receiver)
        outgoing = state.outgoing(message)
        stream.allow(outgoing.total)
        if lanes:
            stream_id = new_stream_id()
            shares = outgoing.shares(len(lanes))
            used = lanes[: len(shares)]
            frames = outgoing.lane_frames([lane.token for lane in used], stream_id, shares)
            if batched:
                yield wire_pb2.Frames(frames=frames)
            else:
                yield from frames
            try:
                _write_shares(outgoing, used, stream_id, shares, _remaining(context, stream))
            except OSError as error:
                context.abort(grpc.StatusCode.UNAVAILABLE, f"lane_failed: {error}")
            sent(outgoing.total)
        elif batched:
            for frame in counted(outgoing.frames(), sent):
                yield wire_pb2.Frames(frames=[frame])
        else:
            yield from counted(outgoing.frames(), sent)
        state.edge(self._metrics, message.receiver).messages_sent.inc()

    def _enqueue(self, state: ServingState, message: Message, context: grpc.ServicerContext) -> None:
        """Put a received message on the node's inbox, or refuse its stream when the inbox is full."""
        if state.inbox.qsize() >= state.max_inbox:
            self._metrics.stream_rejections.labels("unknown", state.node_id, Reason.INBOX_FULL).inc()
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"inbox_full: {state.max_inbox} messages wait for this node already")
        state.inbox.put(message)

    def _release(self, lanes: list[LaneSocket], ok: bool) -> None:
        if self.lanes is not None:
            for lane in lanes:
                self.lanes.release(lane, ok)

    # -- the service ------------------------------------------------------------------------------------------

    def _exchange(self, frames, context, batched: bool):
        identity = self._caller(context)
        state = self._state(context)
        with self._stream(context, identity, state) as stream:
            if not batched:  # a stream of frames: waits for the next one are timed
                frames = stream.frames(frames)
            message, lanes = self._receive(state, identity, stream, frames, context)
            ok = False
            try:
                reply = state.snapshot().message_for(message.sender, message.kind)
                if reply is None:
                    context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                  f"this node serves no {message.kind.name.lower()}")
                self._enqueue(state, message, context)
                yield from self._send(state, stream, reply, context, lanes, batched)
                ok = True
            finally:
                self._release(lanes, ok)

    def _pull(self, request, context):
        identity = self._caller(context)
        state = self._state(context)
        with self._stream(context, identity, state) as stream:
            self._admit(context, state, identity, request.requester_rank, request.requester_id)
            if request.job_id != state.job_id:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"this node runs job {state.job_id!r}")
            if request.kind not in Kind._value2member_map_:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown message kind {request.kind}")
            kind = Kind(request.kind)
            try:
                state.expected(request.requester_rank, kind)
            except WireError as error:
                context.abort(grpc_code(error.status), clip(str(error), MAX_DETAIL_CHARS))
            reply = state.snapshot().message_for(request.requester_rank, kind)
            if reply is None:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"this node serves no {kind.name.lower()}")
            lanes = []
            if request.lane_token and self.lanes is not None:
                with contextlib.suppress(WireError):  # not a lane of the requester's: answer in frames
                    lanes.append(self.lanes.claim(request.lane_token, state.job_id, request.requester_rank))
            ok = False
            try:
                yield from self._send(state, stream, reply, context, lanes, batched=False)
                ok = True
            finally:
                self._release(lanes, ok)

    def _push(self, frames, context, batched: bool):
        identity = self._caller(context)
        state = self._state(context)
        with self._stream(context, identity, state) as stream:
            if not batched:
                frames = stream.frames(frames)
            message, lanes = self._receive(state, identity, stream, frames, context)
        self._release(lanes, True)
        self._enqueue(state, message, context)
        return peer_pb2.PushReply(bytes_received=message.payload_bytes)

    def Exchange(self, request_iterator, context):
        return self._exchange(request_iterator, context, batched=False)

    def Pull(self, request, context):
        return self._pull(request, context)

    def Push(self, request_iterator, context):
        return self._push(request_iterator, context, batched=False)

    def PushOnLane(self, request, context):
        return self._push(_frames_of(request), context, batched=True)

    def ExchangeOnLane(self, request, context):
        return self._exchange(_frames_of(request), context, batched=True)

    def OpenLane(self, request, context):
        identity = self._caller(context)
        if self.lanes is None:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "this node offers no lanes")
        state = self._state(context)
        self._admit(context, state, identity, request.requester_rank, request.requester_id)
        if request.job_id != state.job_id:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"this node runs job {state.job_id!r}")
        if request.requester_rank == state.rank or request.requester_rank not in state.names:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, f"rank {request.requester_rank} is not a peer here")
        self.lanes.forget_job(state.job_id)
        # On a secure server the grant's key, which only this reply carries, is what makes the lane this caller's.
        direct = request.direct and self.lanes.serve is not None
        grant = self.lanes.grant(state.job_id, request.requester_rank, identity.name if identity else None,
                                 direct=direct, holder=identity)
        return peer_pb2.LaneGrant(port=self.lanes.port, token=grant.token, key=grant.key or b"", direct=direct)

    # -- direct lanes (nodeagent/wire/lane.py) -----------------------------------------------------------------

    def _serve_direct(self, lane: LaneSocket) -> None:
        """Serve the calls of a direct lane one after the other (the lane hub's thread of this lane), until the lane
        fails, waits DIRECT_IDLE_S for a call, or a call is refused (then the lane is closed: its byte stream may
        hold a payload nobody read)."""
        while not lane.closed:
            lane.set_timeout(DIRECT_IDLE_S)
            try:
                call = read_call(lane)
            except WireError:
                return
            if not self._direct_call(lane, call):
                return

    def _direct_call(self, lane: LaneSocket, call: wire_pb2.LaneCall) -> bool:
        """One call of a direct lane: the request decoded and checked as any stream, then the answer; whether the
        lane is still in step. The lane speaks for the rank of the job and, under TLS, the node (`lane.holder`)
        that OpenLane authorised."""
        identity = lane.holder if isinstance(lane.holder, Identity) else None
        src = identity.name if identity is not None else "unknown"
        state = self._current()
        dst = state.node_id if state is not None else self._node_id()
        try:
            if identity is not None and self._revoked(identity):
                raise WireError(Reason.REVOKED, f"certificate {identity.serial} is revoked", Status.UNAUTHENTICATED)
            if state is None or state.job_id != lane.job_id:
                raise WireError(Reason.WRONG_JOB, "this node no longer runs the lane's job", Status.FAILED_PRECONDITION)
            message = self._receive_direct(state, lane, identity, call)
            if call.answer_wanted:
                reply = state.snapshot().message_for(message.sender, message.kind)
                if reply is None:
                    raise WireError(Reason.NOT_SERVED, f"this node serves no {message.kind.name.lower()}",
                                    Status.FAILED_PRECONDITION)
            if state.inbox.qsize() >= state.max_inbox:
                raise WireError(Reason.INBOX_FULL, f"{state.max_inbox} messages wait for this node already",
                                Status.RESOURCE_EXHAUSTED)
            state.inbox.put(message)
        except WireError as error:
            self._metrics.stream_rejections.labels(src, dst, error.reason).inc()
            code = grpc_code(error.status)
            with contextlib.suppress(OSError):
                send_call(lane, wire_pb2.LaneCall(status=code.value[0], details=clip(str(error), MAX_DETAIL_CHARS)))
            return False
        try:
            if not call.answer_wanted:
                send_call(lane, wire_pb2.LaneCall())
                return True
            outgoing = state.outgoing(reply)
            stream_id = new_stream_id()
            frames = outgoing.lane_frames([lane.token], stream_id, [(0, outgoing.total)])
            # Counted as it goes out (the caller may read the answer before this thread runs again).
            state.sent_to(self._metrics, message.sender)(outgoing.total)
            state.edge(self._metrics, message.sender).messages_sent.inc()
            send_call(lane, wire_pb2.LaneCall(frames=wire_pb2.Frames(frames=frames)), outgoing.lane_pieces(stream_id),
                      outgoing.total)
        except OSError:
            return False
        return True

    def _receive_direct(self, state: ServingState, lane: LaneSocket, identity: Identity | None,
                        call: wire_pb2.LaneCall) -> Message:
        """Decode a direct lane's request, its payload read from the lane; WireError when it is refused."""
        node = identity.name if identity is not None else None

        def expect(manifest: wire_pb2.Manifest) -> list[TensorSpec]:
            if manifest.sender_rank != lane.rank:
                raise WireError(Reason.WRONG_IDENTITY, f"the lane speaks for rank {lane.rank}, not "
                                f"{manifest.sender_rank}", Status.PERMISSION_DENIED)
            state.check_peer(manifest.sender_rank, manifest.sender_id, node)
            specs = state.expectation(manifest)
            # As a stream's budget (limits.py): the idle time and the payload at the least rate.
            nbytes = sum(spec.numel * spec.dtype.itemsize for spec in specs)
            lane.set_timeout(self._limits.idle_s + nbytes / self._limits.min_bytes_per_s)
            return specs

        def resolve(lane_frame: wire_pb2.Lane, manifest: wire_pb2.Manifest) -> LaneSocket:
            if lane_frame.token != lane.token:
                raise WireError(Reason.BAD_LANE, "a direct lane's call names another lane")
            return lane

        receiver = state.receiver(expect, resolve)
        try:
            for frame in call.frames.frames:
                receiver.feed(frame)
            message = receiver.result()
        except WireError as error:
            raise error.with_traceback(None) from None  # the receive buffers go back to the pool at once
        state.received_from(self._metrics, message.sender)(receiver.received)
        state.edge(self._metrics, message.sender).messages_received.inc()
        return message

    def Describe(self, request, context):
        """What this node is: to its neighbours all of it; to the coordinator, which asks whether a node still
        answers at an address, its id and version only; to other nodes nothing."""
        identity = self._caller(context, PEER_RULES[f"/{_SERVICE}/Describe"])
        state = self._current()
        if identity is None:  # an insecure server: anyone may ask
            if state is None:
                return peer_pb2.NodeDescription(node_id=self._node_id(), version=self._version)
        elif identity.role is Role.COORDINATOR:
            return peer_pb2.NodeDescription(node_id=self._node_id(), version=self._version)
        elif state is None or not state.is_neighbor(identity.name):
            dst = state.node_id if state is not None else self._node_id()
            self._refuse(context, identity, dst, WireError(
                Reason.NOT_NEIGHBOR, f"node {identity.name} is no neighbour of {dst}", Status.PERMISSION_DENIED))
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
            clock=snapshot.clock, loss=float(snapshot.loss),
            neighbor_ranks=sorted(r for r in state.names if r != state.rank),
            served_tensors=served, version=self._version,
        )


def add_peer_servicer(servicer: PeerServicer, server: grpc.Server) -> None:
    """Register the Peer service with the requests of its tensor streams as bytes, which the decoder reads within
    its limits (a manifest frame is refused above MAX_CONTROL_FRAME_BYTES before protobuf parses it)."""
    add_servicer(peer_pb2_grpc.add_PeerServicer_to_server, servicer, server,
                 raw_requests=("Exchange", "Push", "PushOnLane", "ExchangeOnLane"))


def _frames_of(request: bytes) -> Iterator[wire_pb2.Frame]:
    """The frames of a PushOnLane or ExchangeOnLane request: the manifest, lane and end frames of a stream whose
    payload is on lanes (never chunks), parsed only within the decoder's limit of such frames."""
    if len(request) > MAX_CONTROL_FRAME_BYTES:
        raise WireError(Reason.TOO_LARGE,
                        f"a request of {len(request)} bytes on lanes, at most {MAX_CONTROL_FRAME_BYTES}")
    try:
        frames = wire_pb2.Frames.FromString(request).frames
    except DecodeError:
        raise WireError(Reason.BAD_FRAME, "a request on lanes that does not parse") from None
    yield from frames


def _abort_on_failure(lanes: list[LaneSocket], call: grpc.Future) -> None:
    """A failed call's lanes are shut down: the peer will not read them, and a write to them must end."""
    if call.cancelled() or call.exception() is not None:
        for lane in lanes:
            lane.abort()


_STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}


def _lost(deadline: float) -> str:
    """The failure reason of a direct-lane call whose lane failed: past its deadline, as gRPC names it (a peer cut
    off by a partition answers nothing), else unavailable."""
    return "deadline_exceeded" if time.monotonic() >= deadline else "unavailable"


def _fail_owed(lane: LaneSocket, failure: SendFailed) -> None:
    """Every push still owed an answer on a lane that failed fails with `failure` (its lock held)."""
    while lane.owed:
        lane.owed.popleft().done(failure)


def _identity(data: bytes) -> bytes:
    return data



@dataclass(frozen=True)
class _Owed:
    """A push written ahead on a direct lane, until its answer is read: by its deadline, then `done` hears how it
    went (None: delivered, after `count` has counted it on the edge)."""

    deadline: float
    done: Callable[[SendFailed | None], None]
    count: Callable[[], None]


class PeerClient:
    """Dials one neighbour. Every call validates what comes back before returning it. With `lanes` (the default)
    payloads travel on lanes whenever the peer offers them. With a `transport` the channel is the transport's
    (mutual TLS when it is secure: the neighbour must prove to be `server_name`, its node id, and its lanes must be
    sealed with the key it grants); without one, the channel and the lanes are plaintext."""

    def __init__(self, address: str, *, lanes: bool = True, transport: Transport | None = None,
                 server_name: str = ""):
        self.address = address
        # Server-streaming calls are consumed by the calling thread rather than by a thread gRPC starts per call.
        options = [*GRPC_OPTIONS, (grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1)]
        self._secure = transport is not None and transport.secure
        # The credentials the channel was made with (None: plaintext), to tell when they were renewed since.
        self.credentials = transport.credentials() if transport is not None and transport.secure else None
        if transport is None:
            self.channel = grpc.insecure_channel(address, options=options)
        else:
            self.channel = transport.channel(address, server_name=server_name, options=options)
        self.stub = peer_pb2_grpc.PeerStub(self.channel)
        # The same methods with frames as bytes: chunk frames are built and read by hand (wire/frames.py).
        self._exchange_call = self.channel.stream_stream(
            f"/{_SERVICE}/Exchange", request_serializer=serialize, response_deserializer=_identity
        )
        self._push_call = self.channel.stream_unary(
            f"/{_SERVICE}/Push", request_serializer=serialize, response_deserializer=peer_pb2.PushReply.FromString
        )
        self._pull_call = self.channel.unary_stream(
            f"/{_SERVICE}/Pull", request_serializer=peer_pb2.PullRequest.SerializeToString,
            response_deserializer=_identity,
        )
        self._push_on_lane = self.channel.unary_unary(
            f"/{_SERVICE}/PushOnLane", request_serializer=wire_pb2.Frames.SerializeToString,
            response_deserializer=peer_pb2.PushReply.FromString,
        )
        self._exchange_on_lane = self.channel.unary_stream(
            f"/{_SERVICE}/ExchangeOnLane", request_serializer=wire_pb2.Frames.SerializeToString,
            response_deserializer=wire_pb2.Frames.FromString,
        )
        self._host = split_host(address) if lanes else None
        self._idle: dict[tuple[str, int], list[LaneSocket]] = {}
        self._no_lanes_until = 0.0
        self._direct: dict[tuple[str, int], LaneSocket] = {}  # by job and this node's rank
        self._no_direct_until = 0.0
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            idle = [lane for lanes in self._idle.values() for lane in lanes]
            self._idle.clear()
            direct, self._direct = list(self._direct.values()), {}
        for lane in idle:
            lane.close()
        for lane in direct:  # a call in flight on it ends with an error, its thread closes it
            lane.abort()
        self.channel.close()

    # -- lanes -----------------------------------------------------------------------------------------------

    def _lanes(self, state: ServingState, timeout: float, count: int) -> list[LaneSocket]:
        """Up to `count` lanes to this peer for `state`'s job and rank: idle ones, else new ones; none when the
        peer offers no lanes (frames then)."""
        if self._host is None or time.monotonic() < self._no_lanes_until:
            return []
        lanes = []
        with self._lock:
            idle = self._idle.get((state.job_id, state.rank), [])
            while idle and len(lanes) < count:
                lane = idle.pop()
                if lane.alive():
                    lanes.append(lane)
                else:
                    lane.close()  # the peer closed it (another job, a restart, too many lanes): open another
        while len(lanes) < count:
            try:
                lane = self._open_lane(state, timeout, direct=False)
                assert lane is not None
                lanes.append(lane)
            except (grpc.RpcError, OSError):
                # UNIMPLEMENTED: the peer offers no lanes; others (no job yet, an unreachable port): later again.
                if not lanes:
                    self._no_lanes_until = time.monotonic() + LANE_RETRY_S
                break
        return lanes

    def _open_lane(self, state: ServingState, timeout: float, direct: bool) -> LaneSocket | None:
        """A new lane to this peer; None when a `direct` one was asked for and the peer grants only payload lanes
        (it predates them). Raises grpc.RpcError or OSError."""
        assert self._host is not None
        setup = min(timeout, LANE_SETUP_TIMEOUT_S)
        grant = self.stub.OpenLane(
            peer_pb2.LaneRequest(job_id=state.job_id, requester_rank=state.rank, requester_id=state.node_id,
                                 direct=direct),
            timeout=setup,
        )
        # Beside a TLS channel a lane must be sealed: no payload byte goes out in the clear.
        if (self._secure or grant.key) and len(grant.key) != KEY_BYTES:
            raise OSError(f"the peer grants a lane with a key of {len(grant.key)} bytes")
        if direct and not grant.direct:
            return None
        lane = dial(self._host, grant.port, grant.token, state.job_id, state.rank, setup, grant.key or None)
        lane.direct = direct
        return lane

    def _direct_lane(self, state: ServingState, timeout: float) -> LaneSocket | None:
        """This node's direct lane to the peer for `state`'s job, held for one call (its lock); None when the peer
        serves none (the call goes over gRPC then). A call waits for one of this node's before it on the lane (up to
        `timeout`, then it fails with SendFailed as at its deadline): a lane carries one call at a time, and the one
        before is most often a push waiting for its answer, due at once. Sent over gRPC instead, with a lane granted for
        its payload, a call cost a thread's start and a call's set-up, where the wait costs the answer's arrival: a
        synchronous round's push of round t + 1 found the push of round t still on the lane for 16% of messages (2
        agents, sync DSGD, logistic)."""
        if self._host is None or time.monotonic() < self._no_direct_until:
            return None
        key = (state.job_id, state.rank)
        patience = time.monotonic() + timeout
        while True:
            with self._lock:
                lane = self._direct.get(key)
            if lane is None:
                break
            if not lane.lock.acquire(timeout=max(0.0, patience - time.monotonic())):
                # The call before still holds it at this call's deadline (a peer that stopped answering): this
                # call fails as at its deadline, not again over gRPC for as long.
                raise SendFailed("deadline_exceeded", "the call before this one held the direct lane past its "
                                 "deadline")
            with self._lock:
                current = self._direct.get(key) is lane
                if current and lane.alive():
                    return lane
                if current:
                    del self._direct[key]  # the peer closed it (idle, a refusal, a restart): open another
            if current:
                _fail_owed(lane, SendFailed("unavailable", "the peer closed the direct lane"))
                lane.close()
            lane.lock.release()  # a lane the call before failed on, and replaced: wait for the current one
        try:
            lane = self._open_lane(state, timeout, direct=True)
        except (grpc.RpcError, OSError):  # the peer may not serve the job yet: the call goes over gRPC
            self._no_direct_until = time.monotonic() + DIRECT_RETRY_S
            return None
        if lane is None:  # a peer that predates direct lanes
            self._no_direct_until = time.monotonic() + LANE_RETRY_S
            return None
        lane.lock.acquire()
        with self._lock:
            former = self._direct.get(key)
            self._direct[key] = lane
        if former is not None:
            former.abort()  # a call on it still holds it; nothing new goes on it
        return lane

    def _call_direct(self, lane: LaneSocket, state: ServingState, outgoing: Outgoing, peer: int, timeout: float,
                     sent: Callable[[int], None], metrics: Metrics, answer_wanted: bool) -> Message | None:
        """One call on a direct lane: the request and its payload, then the answer (with `answer_wanted`, the
        peer's message, checked like any received stream). Raises SendFailed; the lane is closed after any
        failure, as its byte stream may be out of step."""
        deadline = time.monotonic() + timeout
        ok = False
        try:
            self._read_owed(lane, wait=True)
            lane.set_timeout(timeout)
            stream_id = new_stream_id()
            frames = outgoing.lane_frames([lane.token], stream_id, [(0, outgoing.total)])
            send_call(lane, wire_pb2.LaneCall(frames=wire_pb2.Frames(frames=frames), answer_wanted=answer_wanted),
                      outgoing.lane_pieces(stream_id), outgoing.total)
            answer = read_call(lane)
            if answer.status:
                code = _STATUS_CODES.get(answer.status, grpc.StatusCode.UNKNOWN)
                raise SendFailed(code.name.lower(), clip(answer.details, MAX_DETAIL_CHARS))
            sent(outgoing.total)
            reply = None
            if answer_wanted:
                receiver = self._reply_receiver(state, peer, [lane], deadline)
                for frame in answer.frames.frames:
                    receiver.feed(frame)
                reply = receiver.result()
                state.received_from(metrics, peer)(receiver.received)
                state.edge(metrics, peer).messages_received.inc()
            ok = True
            return reply
        except OSError as error:
            raise SendFailed(_lost(deadline), f"the direct lane failed: {error}") from None
        except WireError as error:
            raise SendFailed(_lost(deadline) if error.reason == Reason.TRUNCATED else "rejected", str(error)) from None
        finally:
            if not ok:
                self._drop_direct(lane, SendFailed(_lost(deadline), "the direct lane failed under a later call"))
            lane.lock.release()

    def _drop_direct(self, lane: LaneSocket, failure: SendFailed) -> None:
        """Close a direct lane that failed (its lock held), failing the pushes still owed an answer on it."""
        lane.abort()
        with self._lock:
            if self._direct.get((lane.job_id, lane.rank)) is lane:
                del self._direct[(lane.job_id, lane.rank)]
        _fail_owed(lane, failure)
        lane.close()

    # -- pushes written ahead ------------------------------------------------------------------------------------

    def begin_push(self, state: ServingState, message: Message, timeout: float, metrics: Metrics,
                   done: Callable[[SendFailed | None], None]) -> bool:
        """Write a small push on the open direct lane to this peer from the calling thread, without waiting for its
        answer; False (nothing sent) when there is none, another call holds it, its payload is large, or
        MAX_OWED_PER_LANE answers are owed on it still: then `push` it. Its answer is read later (`poll`, a push
        that finds the lane owed its most, or the next call on the lane) and `done` hears of it: None once the peer
        took the push, else the SendFailed that `push` would have raised. The bytes the socket does not take at once
        are written by a lane writer.

        Why: a push handed to a pool thread that waits for the answer cost a synchronous round two thread wake-ups
        per neighbour on top of its bytes; a runner that writes it and reads the answer when it passes by costs
        none (4 agents, sync DSGD, logistic: 207-223 against 256-293 steps/s in a first measurement)."""
        if self._host is None or message.payload_bytes > COALESCE_BYTES:
            return False
        key = (state.job_id, state.rank)
        with self._lock:
            lane = self._direct.get(key)
        if lane is None or not lane.lock.acquire(blocking=False):
            return False
        started = time.perf_counter()
        deadline = time.monotonic() + timeout
        taken = False
        try:
            with self._lock:
                current = self._direct.get(key) is lane
            if not current or lane.closed:
                return False
            if len(lane.owed) >= MAX_OWED_PER_LANE:
                self._read_owed(lane, wait=False)  # those that came, in one system call
                if len(lane.owed) >= MAX_OWED_PER_LANE:
                    return False
            outgoing = state.outgoing(message)
            stream_id = new_stream_id()
            frames = outgoing.lane_frames([lane.token], stream_id, [(0, outgoing.total)])
            data = call_bytes(wire_pb2.LaneCall(frames=wire_pb2.Frames(frames=frames)), outgoing.lane_pieces(stream_id))
            lane.set_timeout(timeout)
            rest = lane.write_ahead(data)
            taken = True
        except (SendFailed, OSError) as error:  # the lane failed under an earlier push: `push` opens another
            self._drop_direct(lane, error if isinstance(error, SendFailed) else SendFailed(
                "unavailable", f"the direct lane failed: {error}"))
            return False
        finally:
            if not taken:
                lane.lock.release()

        def count() -> None:
            state.sent_to(metrics, message.receiver)(outgoing.total)
            edge = state.edge(metrics, message.receiver)
            edge.messages_sent.inc()
            edge.exchange_seconds.observe(time.perf_counter() - started)

        lane.owed.append(_Owed(deadline, done, count))
        if len(rest):
            _LANE_WRITERS.submit(self._finish_push, lane, rest, deadline)
        else:
            lane.lock.release()
        return True

    def _finish_push(self, lane: LaneSocket, rest: memoryview, deadline: float) -> None:
        """Write what the socket did not take of a push written ahead (its lane's lock held), then let go of it."""
        try:
            lane.finish(rest)
        except OSError as error:
            self._drop_direct(lane, SendFailed(_lost(deadline), f"the direct lane failed: {error}"))
        finally:
            lane.lock.release()

    def poll(self) -> None:
        """Read the answers that have come to pushes written ahead, and fail those past their deadline; a lane
        another call holds is left to it (that call reads them first)."""
        with self._lock:
            lanes = [lane for lane in self._direct.values() if lane.owed]
        for lane in lanes:
            if not lane.lock.acquire(blocking=False):
                continue
            try:
                self._read_owed(lane, wait=False)
            except SendFailed as failure:
                self._drop_direct(lane, failure)
            finally:
                lane.lock.release()

    @staticmethod
    def _read_owed(lane: LaneSocket, wait: bool) -> None:
        """Read the answers owed on a direct lane (its lock held): those that have come, or with `wait` every one,
        each by its push's deadline, and tell each push how it went. Once one fails, the lane is out of step: every
        push still owed fails, and SendFailed is raised for the caller to drop the lane."""
        while lane.owed:
            owed: _Owed = lane.owed[0]
            if not wait and not lane.readable():
                if time.monotonic() < owed.deadline:
                    return
                failure = SendFailed("deadline_exceeded", "the peer did not answer a push on the direct lane")
            else:
                lane.set_timeout(owed.deadline - time.monotonic())
                try:
                    answer = read_call(lane)
                except WireError as error:
                    failure = SendFailed(_lost(owed.deadline), f"the direct lane failed: {error}")
                else:
                    lane.owed.popleft()
                    if not answer.status:
                        owed.count()
                        owed.done(None)
                        continue
                    code = _STATUS_CODES.get(answer.status, grpc.StatusCode.UNKNOWN)
                    owed.done(SendFailed(code.name.lower(), clip(answer.details, MAX_DETAIL_CHARS)))
                    # The peer closes a lane after a refusal: the calls written after it were not read.
                    failure = SendFailed("unavailable", "the peer refused a push before this one on the direct lane")
            _fail_owed(lane, failure)
            raise failure

    def _give_back(self, lane: LaneSocket, ok: bool) -> None:
        if not ok or lane.closed:
            lane.abort()
            lane.close()
            return
        with self._lock:
            idle = self._idle.setdefault((lane.job_id, lane.rank), [])
            if len(idle) < IDLE_LANES_PER_PEER:
                idle.append(lane)
                return
        lane.close()

    @staticmethod
    def _deliver(outgoing: Outgoing, lanes: list[LaneSocket], stream_id: bytes, shares: list[tuple[int, int]],
                 deadline: float, count: Callable[[int], None]) -> bool:
        """Write the payload on the lanes (from a lane writer); False when a lane failed (the call's status then
        says why)."""
        try:
            _write_shares(outgoing, lanes, stream_id, shares, deadline - time.monotonic())
        except OSError:
            return False
        count(outgoing.total)
        return True

    def _plan_lanes(self, outgoing: Outgoing, lanes: list[LaneSocket]) -> tuple[
            wire_pb2.Frames, list[LaneSocket], Callable[[float, Callable[[int], None]], bool]]:
        """The request of a call on lanes, the lanes it uses (spare ones are given back), and the function that
        writes the payload on them (`deliver(deadline, count)`)."""
        stream_id = new_stream_id()
        shares = outgoing.shares(len(lanes))
        used, spare = lanes[: len(shares)], lanes[len(shares) :]
        for lane in spare:
            self._give_back(lane, True)
        request = wire_pb2.Frames(frames=outgoing.lane_frames([lane.token for lane in used], stream_id, shares))

        def deliver(deadline: float, count: Callable[[int], None]) -> bool:
            return self._deliver(outgoing, used, stream_id, shares, deadline, count)

        return request, used, deliver

    def _finish(self, lanes: list[LaneSocket], delivered: futures.Future | bool, ok: bool) -> None:
        """After a call on lanes: on failure, stop the writers (they may be blocked on a peer that stopped
        reading) and wait for them before the sockets are closed; then keep or close the lanes."""
        if not ok:
            for lane in lanes:
                lane.abort()
        if isinstance(delivered, futures.Future):
            delivered = delivered.result()
        for lane in lanes:
            self._give_back(lane, ok and delivered)

    # -- calls -----------------------------------------------------------------------------------------------

    def push(self, state: ServingState, message: Message, timeout: float, metrics: Metrics) -> None:
        """Stream our message to the peer, which absorbs it. Counts traffic on the edge."""
        started = time.perf_counter()
        deadline = time.monotonic() + timeout
        sent = state.sent_to(metrics, message.receiver)
        outgoing = state.outgoing(message)
        stripes = stripes_for(outgoing.total, sealed=self._secure)
        direct = self._direct_lane(state, timeout) if stripes == 1 else None
        lanes = self._lanes(state, timeout, stripes) if direct is None else []
        if direct is not None:
            self._call_direct(direct, state, outgoing, message.receiver, timeout, sent, metrics, answer_wanted=False)
        elif not lanes:
            self._push_call(counted(outgoing.serialized_frames(), sent), timeout=timeout)
        else:
            request, lanes, deliver = self._plan_lanes(outgoing, lanes)
            # The call goes out first, then this thread writes the payload: the peer's handler is on its way while
            # the bytes flow, with no thread hand-off before the first byte (measured: 44 MB 10.2-11.2 ms against
            # 12.1-12.4 ms with a lane writer thread, benchmarks/wire.py). A call that fails shuts the lanes,
            # which ends a write the peer will never read.
            call = self._push_on_lane.future(request, timeout=timeout)
            call.add_done_callback(functools.partial(_abort_on_failure, lanes))
            delivered = deliver(deadline, sent)
            ok = False
            try:
                call.result()
                ok = True
            finally:
                self._finish(lanes, delivered, ok)
        edge = state.edge(metrics, message.receiver)
        edge.messages_sent.inc()
        edge.exchange_seconds.observe(time.perf_counter() - started)

    @staticmethod
    def _incoming(state: ServingState, replies, peer: int, metrics: Metrics, lanes: list[LaneSocket] = (),
                  deadline: float | None = None, batched: bool = False) -> Message:
        """Decode the peer's answer, checked like any received stream, and count it on the edge."""
        receiver = PeerClient._reply_receiver(state, peer, lanes, deadline)
        try:
            for item in replies:
                for frame in item.frames if batched else (item,):
                    receiver.feed(frame)
            reply = receiver.result()
        except WireError:
            replies.cancel()
            raise
        state.received_from(metrics, peer)(receiver.received)
        state.edge(metrics, peer).messages_received.inc()
        return reply

    @staticmethod
    def _reply_receiver(state: ServingState, peer: int, lanes: Iterable[LaneSocket],
                        deadline: float | None) -> Receiver:
        """The receiver of the answer of `peer` to a call of this node's, its payload on one of `lanes`."""

        def expect_reply(manifest: wire_pb2.Manifest) -> list[TensorSpec]:
            if manifest.sender_rank != peer:
                raise WireError(Reason.WRONG_SENDER, f"reply from rank {manifest.sender_rank}, asked {peer}")
            return state.expectation(manifest)

        def resolve(lane_frame: wire_pb2.Lane, manifest: wire_pb2.Manifest) -> LaneSocket:
            lane = next((lane for lane in lanes if lane.token == lane_frame.token), None)
            if lane is None:
                raise WireError(Reason.BAD_LANE, "the reply names a lane this call did not offer")
            if deadline is not None:
                lane.set_timeout(deadline - time.monotonic())
            return lane

        return state.receiver(expect_reply, resolve)

    def exchange(self, state: ServingState, message: Message, timeout: float, metrics: Metrics) -> Message:
        """Send our message, return the peer's reply for the same edge. Counts traffic on the edge."""
        started = time.perf_counter()
        deadline = time.monotonic() + timeout
        sent = state.sent_to(metrics, message.receiver)
        outgoing = state.outgoing(message)
        # The peer answers on the same lanes, striped as for our own payload (both ends of an edge send the same
        # tensor set, so the two payloads are alike in size).
        stripes = stripes_for(outgoing.total, sealed=self._secure)
        direct = self._direct_lane(state, timeout) if stripes == 1 else None
        lanes = self._lanes(state, timeout, stripes) if direct is None else []
        if direct is not None:
            answer = self._call_direct(direct, state, outgoing, message.receiver, timeout, sent, metrics,
                                       answer_wanted=True)
            assert answer is not None
            reply = answer
        elif not lanes:
            replies = self._exchange_call(counted(outgoing.serialized_frames(), sent), timeout=timeout)
            reply = self._incoming(state, replies, message.receiver, metrics)
        else:
            request, lanes, deliver = self._plan_lanes(outgoing, lanes)
            ok = False
            writing: futures.Future | bool = True
            try:
                replies = self._exchange_on_lane(request, timeout=timeout)
                # This thread reads the reply: the payload goes from a lane writer, started once the call is out.
                writing = _LANE_WRITERS.submit(deliver, deadline, sent)
                reply = self._incoming(state, replies, message.receiver, metrics, lanes, deadline, batched=True)
                ok = True
            finally:
                self._finish(lanes, writing, ok)
        edge = state.edge(metrics, message.receiver)
        edge.messages_sent.inc()
        edge.exchange_seconds.observe(time.perf_counter() - started)
        return reply

    def pull(self, state: ServingState, peer: int, kind: Kind, timeout: float, metrics: Metrics) -> Message:
        """Fetch the peer's latest snapshot of `kind` for this node."""
        started = time.perf_counter()
        deadline = time.monotonic() + timeout
        lanes = self._lanes(state, timeout, 1)
        request = peer_pb2.PullRequest(
            job_id=state.job_id, requester_rank=state.rank, requester_id=state.node_id, kind=int(kind),
            lane_token=lanes[0].token if lanes else b"",
        )
        ok = False
        try:
            replies = self._pull_call(request, timeout=timeout)
            reply = self._incoming(state, replies, peer, metrics, lanes, deadline)
            ok = True
        finally:
            self._finish(lanes, True, ok)
        state.edge(metrics, peer).exchange_seconds.observe(time.perf_counter() - started)
        return reply


class GrpcPeers:
    """The agent's peer transport for one job: a PeerClient per neighbour address, calls that block until done and
    raise SendFailed (with the gRPC status as reason) when they fail. Addresses change with the assignment. With a
    `transport` each neighbour must prove to be the node that `state.names` says its rank is; once this node's
    certificate is renewed (its old one revoked), the next call to a neighbour dials it again with the new one."""

    def __init__(self, state: ServingState, addresses: dict[int, str], metrics: Metrics, timeout_s: float,
                 transport: Transport | None = None):
        self.state = state
        self.addresses = addresses
        self.metrics = metrics
        self.timeout_s = timeout_s
        self.transport = transport
        self._clients: dict[tuple[str, str], PeerClient] = {}  # by address and node id
        self._replaced: list[PeerClient] = []  # dialled with a renewed certificate: calls on them may still run
        self._lock = threading.Lock()

    def update(self, addresses: dict[int, str], state: ServingState) -> None:
        """New addresses, and the serving state naming each neighbour (a topology change adds neighbours)."""
        self.state = state
        self.addresses = addresses  # replaced whole: calls in flight keep the address they started with

    def client(self, rank: int) -> PeerClient:
        address = self.addresses.get(rank)
        if address is None:
            raise SendFailed("not_neighbor", f"rank {rank} is not a neighbour of rank {self.state.rank}, no address")
        key = (address, self.state.name_of(rank))
        credentials = self.transport.credentials() if self.transport is not None and self.transport.secure else None
        with self._lock:
            client = self._clients.get(key)
            if client is not None and client.credentials is not credentials:
                self._replaced.append(client)
                client = None
            if client is None:
                client = self._clients[key] = PeerClient(address, transport=self.transport, server_name=key[1])
            return client

    def serving_job(self, rank: int) -> str | None:
        """The job the neighbour `rank` serves now, or None when it cannot be asked."""
        try:
            return self.client(rank).stub.Describe(peer_pb2.DescribeRequest(), timeout=2).job_id
        except (grpc.RpcError, SendFailed):
            return None

    def exchange(self, message: Message) -> Message:
        with _failures():
            return self.client(message.receiver).exchange(self.state, message, self.timeout_s, self.metrics)

    def pull(self, peer: int, kind: Kind) -> Message:
        with _failures():
            return self.client(peer).pull(self.state, peer, kind, self.timeout_s, self.metrics)

    def push(self, message: Message) -> None:
        with _failures():
            self.client(message.receiver).push(self.state, message, self.timeout_s, self.metrics)

    def begin_push(self, message: Message, done: Callable[[SendFailed | None], None]) -> bool:
        """Write a push ahead of its answer where its neighbour's direct lane is free (PeerClient.begin_push);
        False: `push` it."""
        try:
            client = self.client(message.receiver)
        except SendFailed:
            return False
        return client.begin_push(self.state, message, self.timeout_s, self.metrics, done)

    def poll(self) -> None:
        """Read the answers that have come to pushes written ahead (PeerClient.poll), those on clients replaced
        since (a renewed certificate) too."""
        with self._lock:
            clients = [*self._clients.values(), *self._replaced]
        for client in clients:
            client.poll()

    def close(self) -> None:
        with self._lock:
            clients, self._clients = [*self._clients.values(), *self._replaced], {}
            self._replaced = []
        for client in clients:
            client.close()


@contextlib.contextmanager
def _failures() -> Iterator[None]:
    """A failed call as SendFailed: the gRPC status, or "rejected" for an answer that fails validation."""
    try:
        yield
    except grpc.RpcError as error:
        raise SendFailed(failure_reason(error), str(error.details())) from None
    except WireError as error:
        raise SendFailed("rejected", str(error)) from None
