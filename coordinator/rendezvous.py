"""The all-reduce rendezvous at the coordinator: a bounded key-value store per running all-reduce job, reached only
through the Rendezvous call (the servicer admits the job's members only; nodeagent.agent.rendezvous is the agents'
side, a torch.distributed Store over that call).

A job's store holds what its quorum collective and gloo write to form a group (nodeagent.agent.collective): two
counters, who came to each quorum, gloo's pair addresses. A long job forms many quorums and only the last few
matter, so each store keeps at most `max_keys` keys and `max_bytes` of keys and values, dropping the keys written
least recently first; one value may hold at most MAX_VALUE_BYTES. Stores live in memory: a restarted coordinator
starts them empty, which the collective expects (its members form their quorum again).
"""

from __future__ import annotations

import threading
import time

from nodeagent._proto import coordinator_pb2 as pb

MAX_KEY_CHARS = 256
MAX_VALUE_BYTES = 64 << 10  # gloo's pair addresses of one rank take about 60 bytes per member
MAX_KEYS_PER_CALL = 64
MAX_WAIT_S = 10.0  # the longest a GET or WAIT answer is held (a long poll: the client asks again)
# A job's bounds, for its most members n: what a few quorums of n members write (gloo's addresses grow as n^2).
BASE_KEYS = 64
KEYS_PER_MEMBER = 16
BASE_BYTES = 1 << 20
BYTES_PER_MEMBER_PAIR = 256

_SINGLE_KEY = (pb.RENDEZVOUS_SET, pb.RENDEZVOUS_GET, pb.RENDEZVOUS_ADD, pb.RENDEZVOUS_COMPARE_SET,
               pb.RENDEZVOUS_DELETE)


class RendezvousError(Exception):
    """An operation the store cannot do (a counter that is not a number); the message says why."""


def request_problem(request: pb.RendezvousRequest) -> str | None:
    """What is wrong with a Rendezvous request, naming the field (None: nothing); checked before any store is
    touched, and never echoing the input at length."""
    if request.op not in pb.RendezvousOp.values() or request.op == pb.RENDEZVOUS_OP_UNSPECIFIED:
        return f"op: {request.op} is not a rendezvous operation"
    count = len(request.keys)
    if request.op in _SINGLE_KEY and count != 1:
        return f"keys: {pb.RendezvousOp.Name(request.op)} takes one key, not {count}"
    if not 1 <= count <= MAX_KEYS_PER_CALL:
        return f"keys: {count} keys; 1 to {MAX_KEYS_PER_CALL}"
    if any(not key or len(key) > MAX_KEY_CHARS for key in request.keys):
        return f"keys: each key must be 1 to {MAX_KEY_CHARS} characters"
    if len(request.value) > MAX_VALUE_BYTES or len(request.expected) > MAX_VALUE_BYTES:
        return f"value: {max(len(request.value), len(request.expected))} bytes; at most {MAX_VALUE_BYTES}"
    if not 0 <= request.wait_s <= MAX_WAIT_S:
        return f"wait_s: {request.wait_s} is not in 0..{MAX_WAIT_S:g}"
    return None


class JobStore:
    """One job's keys, thread-safe; GET and WAIT block on a condition until the keys are there."""

    def __init__(self, max_keys: int, max_bytes: int):
        self.max_keys = max_keys
        self.max_bytes = max_bytes
        self._values: dict[str, bytes] = {}  # in the order they were last written
        self._bytes = 0
        self._changed = threading.Condition()
        self._closed = False

    def _write(self, key: str, value: bytes) -> None:
        """Under the condition: write a key (last in the order), drop the least recently written beyond the
        bounds, wake the waiters."""
        self._forget(key)
        self._values[key] = value
        self._bytes += len(key) + len(value)
        while len(self._values) > self.max_keys or self._bytes > self.max_bytes:
            self._forget(next(iter(self._values)))
        self._changed.notify_all()

    def _forget(self, key: str) -> bool:
        value = self._values.pop(key, None)
        if value is None:
            return False
        self._bytes -= len(key) + len(value)
        return True

    def _wait_for(self, keys: list[str], wait_s: float) -> bool:
        """Under the condition: whether every key is there within `wait_s` (False at once when closed)."""
        deadline = time.monotonic() + wait_s
        while not all(key in self._values for key in keys):
            remaining = deadline - time.monotonic()
            if self._closed or remaining <= 0:
                return False
            self._changed.wait(remaining)
        return True

    def answer(self, request: pb.RendezvousRequest) -> pb.RendezvousReply:
        """Do what a request (already checked by `request_problem`) asks. Raises RendezvousError."""
        keys = list(request.keys)
        key = keys[0]
        op = request.op
        with self._changed:
            if op == pb.RENDEZVOUS_SET:
                self._write(key, request.value)
                return pb.RendezvousReply(found=True)
            if op == pb.RENDEZVOUS_GET:
                found = self._wait_for(keys, request.wait_s)
                return pb.RendezvousReply(found=found, value=self._values[key] if found else b"")
            if op == pb.RENDEZVOUS_ADD:
                try:
                    total = int(self._values.get(key, b"0")) + request.amount
                except ValueError:
                    raise RendezvousError(f"key {key[:64]!r} does not hold a number") from None
                self._write(key, str(total).encode())
                return pb.RendezvousReply(found=True, number=total)
            if op == pb.RENDEZVOUS_COMPARE_SET:  # as torch's TCPStore: an absent key matches an empty `expected`
                current = self._values.get(key)
                if (current if current is not None else b"") == request.expected and \
                        (current is not None or not request.expected):
                    self._write(key, request.value)
                    return pb.RendezvousReply(found=True, value=request.value)
                return pb.RendezvousReply(found=current is not None,
                                          value=current if current is not None else request.expected)
            if op == pb.RENDEZVOUS_CHECK:
                return pb.RendezvousReply(found=all(k in self._values for k in keys))
            if op == pb.RENDEZVOUS_WAIT:
                return pb.RendezvousReply(found=self._wait_for(keys, request.wait_s))
            assert op == pb.RENDEZVOUS_DELETE
            return pb.RendezvousReply(found=self._forget(key))

    def close(self) -> None:
        """The job ended: waiters are answered at once."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()


class Rendezvous:
    """The stores of the running all-reduce jobs, by job id."""

    def __init__(self) -> None:
        self._stores: dict[str, JobStore] = {}
        self._lock = threading.Lock()

    def store(self, job_id: str, max_members: int) -> tuple[JobStore, bool]:
        """The job's store, made empty at its first use (the job's start, or after a restart); whether it was
        made now (the caller then checks that the job still runs: `end` may have come first)."""
        with self._lock:
            store = self._stores.get(job_id)
            if store is not None:
                return store, False
            store = self._stores[job_id] = JobStore(BASE_KEYS + KEYS_PER_MEMBER * max_members,
                                                    BASE_BYTES + BYTES_PER_MEMBER_PAIR * max_members * max_members)
            return store, True

    def end(self, job_id: str) -> None:
        with self._lock:
            store = self._stores.pop(job_id, None)
        if store is not None:
            store.close()

    def close_all(self) -> None:
        with self._lock:
            stores, self._stores = list(self._stores.values()), {}
        for store in stores:
            store.close()
