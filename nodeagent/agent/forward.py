"""Forwarding a node's job events and warnings to the coordinator (`coordinator logs JOB` shows them).

The agent's job events (started, resumed, rejoined, failed, finished) and its log lines of WARNING and above,
while it runs a job, queue here (bounded: the oldest are dropped and counted when the coordinator cannot be
reached for long) and go to the coordinator in batches, every second from the agent's events thread and at once
after a job's last event. Log records are taken from any thread; nothing here calls the network from inside
logging.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

import grpc

from nodeagent._proto import coordinator_pb2 as pb
from nodeagent._proto import coordinator_pb2_grpc
from nodeagent.rpc import failure_reason
from nodeagent.runtime import events

log = logging.getLogger("nodeagent")

MAX_PENDING = 1000  # events held while the coordinator cannot be reached
BATCH = 64  # events per report (the coordinator's limit)
SEND_TIMEOUT_S = 5.0
FORWARDED = "peertrain_forwarded"  # a log record's attribute: the event is queued already, under its own kind


class EventForwarder(logging.Handler):
    """A logging handler (WARNING and above) and a queue of job events. `current_job()` names the job a log line
    belongs to, with the node's step: (job id, step), or None when the agent runs no job (such lines stay local)."""

    def __init__(self, current_job: Callable[[], tuple[str, int] | None]):
        super().__init__(level=logging.WARNING)
        self.current_job = current_job
        self.dropped = 0  # events lost to the bound of the queue
        self._pending: deque[tuple[str, pb.JobEvent]] = deque()
        self._lock = threading.Lock()
        self._sending = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        current = self.current_job()
        if current is None or getattr(record, FORWARDED, False):
            return
        try:
            message = record.getMessage()
        except Exception:  # a malformed log call is not worth losing the caller over
            message = str(record.msg)
        self.add(current[0], events.LOG, message, record.levelname, current[1])

    def add(self, job_id: str, kind: str, message: str, level: str = "INFO", step: int = -1) -> None:
        event = pb.JobEvent(kind=kind, level=level if level in events.LEVELS else "WARNING",
                            message=events.bounded(message), step=step)
        with self._lock:
            if len(self._pending) >= MAX_PENDING:
                self._pending.popleft()
                self.dropped += 1
            self._pending.append((job_id, event))

    def send(self, stub: coordinator_pb2_grpc.CoordinatorStub, node_id: str) -> None:
        """Send what is queued, in order, a job's events in batches; what cannot be sent now stays queued."""
        with self._sending:  # one sender at a time keeps the order
            while True:
                with self._lock:
                    if not self._pending:
                        return
                    job_id = self._pending[0][0]
                    batch = []
                    while self._pending and self._pending[0][0] == job_id and len(batch) < BATCH:
                        batch.append(self._pending.popleft()[1])
                try:
                    stub.ReportEvents(pb.EventReport(node_id=node_id, job_id=job_id, events=batch),
                                      timeout=SEND_TIMEOUT_S)
                except grpc.RpcError as error:
                    if error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                        with self._lock:  # back to the front, for the next try (the bound still holds)
                            room = MAX_PENDING - len(self._pending)
                            self.dropped += max(0, len(batch) - room)
                            self._pending.extendleft((job_id, event) for event in reversed(batch[:room]))
                    else:  # refused (the job is no longer this node's): these events are of no use to anyone
                        log.debug("events of job %s refused: %s", job_id, failure_reason(error))
                    return
