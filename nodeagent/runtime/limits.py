"""Limits on the streams of the peer service. Each stream holds a server thread for as long as it lasts, and the
threads are few (PEER_SERVER_THREADS): without limits, one caller's silent or trickling streams take them all and
every job on the node stops. So a caller has at most `streams_per_peer` streams at once, and a stream must keep
moving: one that waits longer than `idle_s` for its peer's next frame, or outlives its budget (`idle_s` plus its
payload at `min_bytes_per_s`), is ended by a watchdog thread with DEADLINE_EXCEEDED and the reason. The handler
thread, blocked in gRPC, then wakes with an error and lets go; lane I/O of the stream stops at the same budget
(`seconds_left`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import grpc

from nodeagent.metrics import Metrics
from nodeagent.wire.errors import Reason

Item = TypeVar("Item")


@dataclass(frozen=True)
class StreamLimits:
    # The agent's runner sends at most 4 calls at once (runner.py, its exchange pool), so an honest neighbour never
    # has more streams open here.
    streams_per_peer: int = 4
    idle_s: float = 10.0  # a default chunk frame (1 MiB) in that time is 100 KiB/s, far below any honest link
    min_bytes_per_s: float = float(1 << 20)  # a 100 MB model then has 105 s, beyond the default exchange timeout


DEFAULT_LIMITS = StreamLimits()

# Threads of the peer server (nodeagent/agent/daemon.py), also its limit of calls at once, so that no call waits
# for a thread behind calls that hold one: room for 4 misbehaving peers at their limit and 4 honest neighbours at
# theirs (nodes have a handful of neighbours; an honest exchange takes one stream on each end).
PEER_SERVER_THREADS = 32


class Stream:
    """One stream in progress, as the watchdog sees it."""

    def __init__(self, key: str, context: grpc.ServicerContext, src: str, dst: str, limits: StreamLimits):
        self.key = key  # whose stream: the caller's node name, or its address on an insecure server
        self.context = context
        self.src = src  # metric labels
        self.dst = dst
        self.limits = limits
        self.waiting_since: float | None = None  # when it began to wait for the peer's next frame, if it waits
        self.deadline = time.monotonic() + limits.idle_s  # the manifest must come in this time
        self.ended = False

    def frames(self, frames: Iterable[Item]) -> Iterator[Item]:
        """The frames of a request stream, each wait for the next one timed by the watchdog."""
        iterator = iter(frames)
        while True:
            self.waiting_since = time.monotonic()
            try:
                frame = next(iterator)
            except StopIteration:
                return
            finally:
                self.waiting_since = None
            yield frame

    def allow(self, nbytes: int) -> None:
        """Give the stream the time to move a payload of `nbytes` from now (once its size is known)."""
        self.deadline = time.monotonic() + self.limits.idle_s + nbytes / self.limits.min_bytes_per_s

    def seconds_left(self) -> float:
        return max(0.001, self.deadline - time.monotonic())

    def overdue(self, now: float) -> tuple[Reason, str] | None:
        """(reason, detail) when the stream must end now."""
        waiting_since = self.waiting_since
        if waiting_since is not None and now - waiting_since > self.limits.idle_s:
            return Reason.IDLE_TIMEOUT, f"no frame for {self.limits.idle_s:g} s"
        if now > self.deadline:
            return Reason.TOO_SLOW, f"the stream moves less than {self.limits.min_bytes_per_s:.0f} bytes/s"
        return None


class StreamGuard:
    """The open streams of a peer server, counted by caller, and the watchdog that ends the overdue ones."""

    def __init__(self, limits: StreamLimits, metrics: Metrics):
        self.limits = limits
        self._metrics = metrics
        self._open: dict[str, set[Stream]] = {}
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name="stream-watchdog", daemon=True)
        self._watchdog.start()

    def open(self, key: str, context: grpc.ServicerContext, src: str, dst: str) -> Stream | None:
        """A new stream of `key`'s, or None when `key` has as many open as it may."""
        with self._lock:
            streams = self._open.setdefault(key, set())
            if len(streams) >= self.limits.streams_per_peer:
                return None
            stream = Stream(key, context, src, dst, self.limits)
            streams.add(stream)
            return stream

    def close(self, stream: Stream) -> None:
        with self._lock:
            streams = self._open[stream.key]
            streams.discard(stream)
            if not streams:
                del self._open[stream.key]

    def stop(self) -> None:
        self._stopped.set()
        self._watchdog.join()

    def _watch(self) -> None:
        period = min(1.0, self.limits.idle_s / 4)
        while not self._stopped.wait(period):
            now = time.monotonic()
            with self._lock:
                streams = [stream for streams in self._open.values() for stream in streams if not stream.ended]
            for stream in streams:
                overdue = stream.overdue(now)
                if overdue is not None:
                    reason, detail = overdue
                    stream.ended = True
                    self._metrics.stream_rejections.labels(stream.src, stream.dst, reason).inc()
                    end_call(stream.context, grpc.StatusCode.DEADLINE_EXCEEDED, f"{reason}: {detail}")


def end_call(context: grpc.ServicerContext, code: grpc.StatusCode, details: str) -> None:
    """End a call from a thread other than its handler's, with a status its caller sees. The public `cancel()` of a
    servicer context sends CANCELLED with no reason; the core call under it takes a code and details
    (grpc_call_cancel_with_status). tests/test_peer_security.py pins the status the caller gets."""
    context._rpc_event.call.cancel(code.value[0], details)
