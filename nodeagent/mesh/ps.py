"""A worker's calls to the parameter server the coordinator hosts (coordinator.proto: PsPush, PsPull, PsReport).

Streams are encoded and decoded by nodeagent.wire like every other tensor stream; every answer is checked against
what the worker expects (`PSWorker.server_specs` and `check_server_message`, which read only immutable
configuration, so network threads may call them) before it is handed over. Traffic is counted on the edge
metrics with the server named "coordinator" (upstream: worker -> coordinator; downstream: the reverse).
"""

from __future__ import annotations

import dataclasses
import time
import uuid

from nodeagent._proto import coordinator_pb2 as pb
from nodeagent._proto import coordinator_pb2_grpc, wire_pb2
from nodeagent.algorithms.base import SERVER_RANK
from nodeagent.algorithms.ps import PUSH_ID_HEADER, PSWorker, ReadyAnswer, StepReport, wire_rank
from nodeagent.metrics import Metrics
from nodeagent.wire.decoder import decode
from nodeagent.wire.encoder import encode
from nodeagent.wire.errors import WireError
from nodeagent.wire.frames import counted
from nodeagent.wire.message import Encoding, Kind, Message

SERVER_NODE = "coordinator"


def new_push_id() -> str:
    return uuid.uuid4().hex


class ServerClient:
    """One worker of one job, talking to its parameter server through the coordinator's stub."""

    def __init__(self, stub: coordinator_pb2_grpc.CoordinatorStub, job_id: str, node_id: str, rank: int,
                 world_size: int, metrics: Metrics, encoding: Encoding = Encoding.RAW, chunk_bytes: int = 1 << 20,
                 max_message_bytes: int = 1 << 30):
        self.stub = stub
        self.job_id = job_id
        self.node_id = node_id
        self.rank = rank
        self.server_rank = wire_rank(world_size)
        self.metrics = metrics
        self.encoding = encoding
        self.chunk_bytes = chunk_bytes
        self.max_message_bytes = max_message_bytes
        self.bytes_sent = 0
        self.bytes_received = 0

    def _sent(self, n: int) -> None:
        self.bytes_sent += n
        self.metrics.edge_bytes_sent.labels(self.node_id, SERVER_NODE).inc(n)

    def _received(self, n: int) -> None:
        self.bytes_received += n
        self.metrics.edge_bytes_received.labels(SERVER_NODE, self.node_id).inc(n)

    def push(self, message: Message, push_id: str, timeout: float) -> pb.PsPushReply:
        """Stream one update; returns once the server released this worker. Retry with the same `push_id`."""
        started = time.perf_counter()
        outgoing = dataclasses.replace(message, receiver=self.server_rank)
        frames = encode(outgoing, job_id=self.job_id, sender_id=self.node_id, encoding=self.encoding,
                        chunk_bytes=self.chunk_bytes)
        reply = self.stub.PsPush(counted(frames, self._sent), timeout=timeout,
                                 metadata=((PUSH_ID_HEADER, push_id),))
        self.metrics.edge_messages_sent.labels(self.node_id, SERVER_NODE).inc()
        self.metrics.exchange_seconds.labels(self.node_id, SERVER_NODE).observe(time.perf_counter() - started)
        return reply

    def pull(self, worker: PSWorker, since_version: int, delta: bool, timeout: float) -> Message:
        """The model, checked against what `worker` accepts from the server; sender SERVER_RANK."""
        request = pb.PsPullRequest(job_id=self.job_id, rank=self.rank, node_id=self.node_id,
                                   since_version=since_version, delta=delta)

        def expect(manifest: wire_pb2.Manifest):
            if manifest.sender_rank != self.server_rank or manifest.receiver_rank != self.rank:
                raise WireError("wrong_sender", f"a model for rank {manifest.receiver_rank} from rank "
                                f"{manifest.sender_rank}")
            if manifest.job_id != self.job_id:
                raise WireError("wrong_job", f"a model of job {manifest.job_id!r}")
            return worker.server_specs(Kind(manifest.kind), [(h.name, tuple(h.shape)) for h in manifest.tensors])

        replies = self.stub.PsPull(request, timeout=timeout)
        try:
            message = decode(counted(replies, self._received), expect, self.max_message_bytes)
            message = dataclasses.replace(message, sender=SERVER_RANK)
            worker.check_server_message(message)
        except WireError:
            replies.cancel()
            raise
        self.metrics.edge_messages_received.labels(SERVER_NODE, self.node_id).inc()
        return message

    def report(self, report: StepReport, timeout: float) -> ReadyAnswer:
        """ESync: the step's report (with its duration filled in); the server's decision."""
        request = pb.PsReportRequest(job_id=self.job_id, rank=self.rank, node_id=self.node_id,
                                     version=report.model_version, round_step=report.clock,
                                     duration_s=report.duration_s)
        started = time.perf_counter()
        reply = self.stub.PsReport(request, timeout=timeout)
        self.metrics.exchange_seconds.labels(self.node_id, SERVER_NODE).observe(time.perf_counter() - started)
        self._sent(request.ByteSize())
        self._received(reply.ByteSize())
        return ReadyAnswer(report.kind, SERVER_RANK, self.rank, {}, model_version=reply.version, ready=reply.ready,
                           steps_before_asking=max(1, reply.steps_before_asking))
