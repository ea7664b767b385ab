"""An all-reduce job's rendezvous as a torch.distributed Store: every operation is one Rendezvous call to the
coordinator on the agent's mutual-TLS channel, which admits the job's members only (coordinator/rendezvous.py keeps
the keys). The quorum collective and gloo use it as they would a TCPStore: set, get, add, compare_set, check,
wait, delete_key. A failed call raises RuntimeError, as a TCPStore's errors are; the next call tries again (gRPC
connects again by itself, to a coordinator that restarted too).

gloo calls back into this object from its own threads: whoever hands it to gloo keeps a reference to it for the
group's life.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from datetime import timedelta

import grpc
import torch.distributed as dist

from nodeagent._proto import coordinator_pb2 as pb
from nodeagent._proto import coordinator_pb2_grpc

CALL_TIMEOUT_S = 5.0  # an operation that does not wait for keys
LONG_POLL_S = 10.0  # the longest one GET or WAIT call asks the coordinator to hold its answer (its own bound)
CALL_SLACK_S = 5.0  # beyond a waiting call's wait, for the call's own deadline


class RendezvousError(RuntimeError):
    """A rendezvous call failed, or keys did not come in time."""


class CoordinatorStore(dist.Store):
    """The rendezvous of job `job_id` as node `node_id`; `stub()` is the agent's current stub to the coordinator
    (the agent makes a new channel when it renews its certificate); `timeout` bounds how long get and wait wait
    for keys."""

    def __init__(self, stub: Callable[[], coordinator_pb2_grpc.CoordinatorStub | None], job_id: str, node_id: str,
                 timeout: timedelta):
        super().__init__()
        self._stub = stub
        self.job_id = job_id
        self.node_id = node_id
        self.wait_timeout = timeout

    def _call(self, op: int, keys: Sequence[str], *, wait_s: float = 0.0, **fields: object) -> pb.RendezvousReply:
        stub = self._stub()
        if stub is None:
            raise RendezvousError("the agent has no channel to the coordinator")
        request = pb.RendezvousRequest(node_id=self.node_id, job_id=self.job_id, op=op, keys=list(keys),
                                       wait_s=wait_s, **fields)
        try:
            return stub.Rendezvous(request, timeout=wait_s + (CALL_SLACK_S if wait_s else CALL_TIMEOUT_S))
        except grpc.RpcError as error:
            raise RendezvousError(f"rendezvous {pb.RendezvousOp.Name(op)}: {error.code().name}: "
                                  f"{error.details()}") from None

    def _until_found(self, op: int, keys: Sequence[str], timeout: timedelta | None) -> pb.RendezvousReply:
        """A GET or WAIT, asked again in long polls until the keys are there or `timeout` passed."""
        limit = (timeout or self.wait_timeout).total_seconds()
        deadline = time.monotonic() + limit
        while True:
            reply = self._call(op, keys, wait_s=min(LONG_POLL_S, max(0.0, deadline - time.monotonic())))
            if reply.found:
                return reply
            if time.monotonic() >= deadline:
                raise RendezvousError(f"rendezvous: {', '.join(keys)[:200]} not there within {limit:g} s")

    @staticmethod
    def _bytes(value: str | bytes | Sequence[int]) -> bytes:
        return value.encode() if isinstance(value, str) else bytes(value)

    def set(self, key: str, value: str | bytes) -> None:
        self._call(pb.RENDEZVOUS_SET, [key], value=self._bytes(value))

    def get(self, key: str) -> bytes:
        return self._until_found(pb.RENDEZVOUS_GET, [key], None).value

    def add(self, key: str, amount: int) -> int:
        return self._call(pb.RENDEZVOUS_ADD, [key], amount=amount).number

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        return self._call(pb.RENDEZVOUS_COMPARE_SET, [key], expected=self._bytes(expected),
                          value=self._bytes(desired)).value

    def check(self, keys: list[str]) -> bool:
        return self._call(pb.RENDEZVOUS_CHECK, keys).found

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._until_found(pb.RENDEZVOUS_WAIT, keys, timeout)

    def delete_key(self, key: str) -> bool:
        return self._call(pb.RENDEZVOUS_DELETE, [key]).found

    def has_extended_api(self) -> bool:
        return False  # gloo then uses set, get and wait only
