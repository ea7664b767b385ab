"""The agent's ServerLink: a worker's calls to the parameter server the coordinator hosts (coordinator.proto:
PsPush, PsPull, PsReport).

Streams are encoded and decoded by nodeagent.wire like every other tensor stream; every answer is checked against
what the worker expects (`PSWorker.server_specs` and `check_server_message`, which read only immutable
configuration, so the link's threads may call them) before it is handed over. A push and the pull of the model
that answers it run on the link's pool, so that the node's runner is not held by a round; a step report is small
and the worker can do nothing until its answer comes, so it is made from the calling thread (sparing two thread
hand-offs per report). Traffic is counted on the edge metrics with the server named SERVER_NAME and in the job's
traffic.

A failed call is answered with a SendFailed saying whether a retry may cure it (the coordinator restarting, a
round that outlasts the deadline); the node driver decides whether to retry, with the same call id, which the
server uses to apply a push once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent import futures

import grpc

from nodeagent._proto import coordinator_pb2 as pb
from nodeagent._proto import coordinator_pb2_grpc, wire_pb2
from nodeagent.algorithms.base import SendFailed
from nodeagent.metrics import Metrics
from nodeagent.ps.link import Answered, ServerExpectation, ServerLink
from nodeagent.ps.messages import (
    PUSH_ID_HEADER,
    SERVER_NAME,
    SERVER_RANK,
    ReadyAnswer,
    ServerModel,
    ServerPull,
    ServerPush,
    StepReport,
    model_of,
    push_message,
    server_wire_rank,
)
from nodeagent.rpc import failure_reason
from nodeagent.runtime.progress import Traffic
from nodeagent.wire.decoder import decode
from nodeagent.wire.encoder import encode
from nodeagent.wire.errors import Reason, WireError
from nodeagent.wire.frames import counted
from nodeagent.wire.message import Encoding, Kind

log = logging.getLogger("nodeagent")

# Failures of a call to the parameter server that a retry may cure (the coordinator restarts, a round is slow).
TRANSIENT_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
                   grpc.StatusCode.RESOURCE_EXHAUSTED)


class GrpcServerLink(ServerLink):
    """One worker of one job, talking to its parameter server through the coordinator's stub: `stub()` is the
    current one (the agent dials the coordinator again with a renewed certificate)."""

    def __init__(self, stub: Callable[[], coordinator_pb2_grpc.CoordinatorStub], *, job_id: str, node_id: str,
                 rank: int,
                 world_size: int, worker: ServerExpectation, metrics: Metrics, traffic: Traffic, pool: futures.Executor,
                 timeout_s: float, encoding: Encoding = Encoding.RAW, chunk_bytes: int = 1 << 20,
                 max_message_bytes: int = 1 << 30):
        self._stub = stub
        self.job_id = job_id
        self.node_id = node_id
        self.rank = rank
        self.world_size = world_size
        self.server_rank = server_wire_rank(world_size)
        self.worker = worker
        self.traffic = traffic
        self.pool = pool
        self.timeout_s = timeout_s
        self.encoding = encoding
        self.chunk_bytes = chunk_bytes
        self.max_message_bytes = max_message_bytes
        # This edge's series, looked up once.
        self._bytes_up = metrics.edge_bytes_sent.labels(job_id, node_id, SERVER_NAME)
        self._bytes_down = metrics.edge_bytes_received.labels(job_id, SERVER_NAME, node_id)
        self._pushes = metrics.edge_messages_sent.labels(job_id, node_id, SERVER_NAME)
        self._models = metrics.edge_messages_received.labels(job_id, SERVER_NAME, node_id)
        self._seconds = metrics.exchange_seconds.labels(job_id, node_id, SERVER_NAME)

    # -- the interface ---------------------------------------------------------------------------------------------

    def push(self, push: ServerPush, call_id: str, answered: Answered) -> None:
        def call() -> ServerModel:
            self.push_update(push, call_id)
            return self.fetch_model(ServerPull(push.version, push.pull_delta))

        self.pool.submit(self._answer, call, answered)

    def pull(self, pull: ServerPull, answered: Answered) -> None:
        self.pool.submit(self._answer, lambda: self.fetch_model(pull), answered)

    def report(self, report: StepReport, step_s: float, answered: Answered) -> None:
        self._answer(lambda: self.ask(report, step_s), answered)

    def _answer(self, call: Callable[[], ServerModel | ReadyAnswer], answered: Answered) -> None:
        """Run `call`, answering with its result or with why it failed."""
        try:
            result: ServerModel | ReadyAnswer | SendFailed = call()
        except grpc.RpcError as error:
            transient = error.code() in TRANSIENT_CODES
            if not transient:
                log.warning("job %s: the parameter server refused a call: %s", self.job_id, error.details())
            result = SendFailed(failure_reason(error), str(error.details()), transient=transient)
        except WireError as error:
            log.warning("job %s: answer of the parameter server rejected: %s", self.job_id, error)
            result = SendFailed("rejected", str(error))
        answered(result)

    # -- the calls, each blocking until its answer; grpc.RpcError or WireError when it fails ----------------------

    def _sent(self, n: int) -> None:
        self.traffic.add_sent(SERVER_RANK, n)
        self._bytes_up.inc(n)

    def _received(self, n: int) -> None:
        self.traffic.add_received(SERVER_RANK, n)
        self._bytes_down.inc(n)

    def push_update(self, push: ServerPush, push_id: str) -> pb.PsPushReply:
        """Stream one update; returns once the server released this worker. A retry carries the same id."""
        started = time.perf_counter()
        frames = encode(push_message(push, self.rank, self.world_size), job_id=self.job_id, sender_id=self.node_id,
                        encoding=self.encoding, chunk_bytes=self.chunk_bytes)
        reply = self._stub().PsPush(counted(frames, self._sent), timeout=self.timeout_s,
                                 metadata=((PUSH_ID_HEADER, push_id),))
        if reply.rejected:
            log.info("job %s: push rejected (%s); pulling the model", self.job_id, reply.rejected)
        self._pushes.inc()
        self._seconds.observe(time.perf_counter() - started)
        return reply

    def fetch_model(self, pull: ServerPull) -> ServerModel:
        """The model, checked against what the worker accepts from the server."""
        request = pb.PsPullRequest(job_id=self.job_id, rank=self.rank, node_id=self.node_id,
                                   since_version=pull.since_version, delta=pull.delta)

        def expect(manifest: wire_pb2.Manifest):
            if manifest.sender_rank != self.server_rank or manifest.receiver_rank != self.rank:
                raise WireError(Reason.WRONG_SENDER, f"a model for rank {manifest.receiver_rank} from rank "
                                f"{manifest.sender_rank}")
            if manifest.job_id != self.job_id:
                raise WireError(Reason.WRONG_JOB, f"a model of job {manifest.job_id!r}")
            shapes = [(h.name, tuple(h.shape)) for h in manifest.tensors]
            return self.worker.server_specs(Kind(manifest.kind), shapes)

        replies = self._stub().PsPull(request, timeout=self.timeout_s)
        try:
            model = model_of(decode(counted(replies, self._received), expect, self.max_message_bytes))
            self.worker.check_server_message(model)
        except WireError:
            replies.cancel()
            raise
        self._models.inc()
        return model

    def ask(self, report: StepReport, step_s: float) -> ReadyAnswer:
        """ESync: the step's report, with its duration; the server's decision."""
        request = pb.PsReportRequest(job_id=self.job_id, rank=self.rank, node_id=self.node_id,
                                     version=report.version, round_step=report.round_step, duration_s=step_s)
        started = time.perf_counter()
        reply = self._stub().PsReport(request, timeout=self.timeout_s)
        self._seconds.observe(time.perf_counter() - started)
        self._sent(request.ByteSize())
        self._received(reply.ByteSize())
        return ReadyAnswer(reply.ready, max(1, reply.steps_before_asking), reply.version)
