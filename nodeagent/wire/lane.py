"""Lanes: side TCP connections that carry the payload bytes of peer streams, beside their gRPC call.

Why: gRPC's Python stack copies every message between Python bytes and its own slices on both ends and delivers
one message per handler wakeup; on this machine kind it tops out near 1 GB/s on loopback with nothing else to
do, well below torch.distributed gloo (benchmarks/wire.py). On a lane the sender writes straight from the
tensor's memory into the socket and the receiver reads straight into its destination buffer, as gloo does.

What stays on gRPC: the Manifest (validated before any byte is read from the lane), a Lane frame naming the lane
and a fresh stream id, the End frame, the call's status and deadline, and every metric. The lane carries a
32-byte header (magic, stream id, total) and the payload, nothing else.

Trust: a lane is opened with a one-time random token that the receiver granted over gRPC (OpenLane) to one
rank of one job; the receiver accepts a stream's payload on it only when the stream's manifest names that job
and that rank as its sender. It is no more and no less secure than the insecure gRPC channel it sits beside.
One stream at a time uses a lane; any error closes it (its byte stream may be out of step) and the next stream
opens another.
"""

from __future__ import annotations

import contextlib
import secrets
import socket
import struct
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

from nodeagent.listen import listen_socket
from nodeagent.wire.decoder import LaneReader
from nodeagent.wire.errors import WireError

TOKEN_BYTES = 32
READY = b"\x01"
GRANT_TTL_S = 10.0  # a granted token must be presented within this
HANDSHAKE_TIMEOUT_S = 5.0
MAX_HANDSHAKES = 32  # connections still to present their token; more are closed at once
LANES_PER_PEER = 16  # open lanes kept per (job, rank); the oldest idle one is closed beyond this
DEFAULT_TIMEOUT_S = 60.0  # lane I/O of a call without a deadline
# A payload is striped over one lane per STRIPE_BYTES, at most MAX_STRIPES: one TCP connection on loopback stalls
# on its own window and wake-ups; a few side by side overlap those stalls (measured: 44 MB in one lane 17 ms,
# in two 11.5 ms, in four 11.5-12 ms on this machine kind).
STRIPE_BYTES = 4 << 20
MAX_STRIPES = 2


def stripes_for(nbytes: int) -> int:
    return max(1, min(MAX_STRIPES, nbytes // STRIPE_BYTES))


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


_TIMEVAL = struct.Struct("@ll")


class LaneSocket(LaneReader):
    """One lane end: exact reads and whole writes with a deadline. The first error shuts it down (`abort`);
    only its owner closes the socket, once no other thread can be using it (a closed descriptor's number may
    be reused at once)."""

    def __init__(self, sock: socket.socket, job_id: str = "", rank: int = -1, token: bytes = b""):
        _tune(sock)
        sock.settimeout(None)
        self.sock = sock
        self.job_id = job_id
        self.rank = rank
        self.token = token
        self.lock = threading.Lock()
        self.closed = False
        self.last_used = time.monotonic()
        self.deadline = self.last_used + DEFAULT_TIMEOUT_S

    def set_timeout(self, seconds: float | None) -> None:
        """Deadline of the sends and receives that follow, `seconds` from now. The socket stays in blocking mode
        with kernel timeouts (SO_RCVTIMEO, SO_SNDTIMEO) set to the time left before each system call, so a whole
        payload moves in one call rather than in Python's poll-then-read loop of timeout mode."""
        self.deadline = time.monotonic() + (DEFAULT_TIMEOUT_S if seconds is None else max(seconds, 0.001))

    def _arm(self, option: int) -> None:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("lane deadline passed")
        whole = int(left)
        self.sock.setsockopt(socket.SOL_SOCKET, option, _TIMEVAL.pack(whole, max(1, int((left - whole) * 1e6))))

    def read_into(self, view: memoryview) -> None:
        try:
            while len(view):
                self._arm(socket.SO_RCVTIMEO)
                n = self.sock.recv_into(view, len(view), socket.MSG_WAITALL)
                if n == 0:
                    raise WireError("truncated", "the lane closed before the stream's payload was complete")
                view = view[n:]
        except (TimeoutError, BlockingIOError):
            self.abort()
            raise WireError("truncated", "the lane's payload did not arrive in time") from None
        except OSError as error:
            self.abort()
            raise WireError("truncated", f"the lane failed: {error}") from None
        except WireError:
            self.abort()
            raise

    def send(self, pieces: Iterable[memoryview | bytes]) -> None:
        """Write every piece (each is consumed before the next is asked for). Raises OSError (TimeoutError at
        the deadline)."""
        try:
            for piece in pieces:
                view = memoryview(piece)
                while len(view):
                    self._arm(socket.SO_SNDTIMEO)
                    view = view[self.sock.send(view) :]
        except BlockingIOError:
            self.abort()
            raise TimeoutError("the lane's peer did not read in time") from None
        except BaseException:
            self.abort()
            raise

    def alive(self) -> bool:
        """Whether an idle lane is still open at the other end (it has sent nothing, and not closed)."""
        if self.closed:
            return False
        try:
            return self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
        except BlockingIOError:
            return True
        except OSError:
            return False

    def abort(self) -> None:
        """Unblock a send or receive in progress in another thread; the lane is finished."""
        self.closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(OSError):
            self.sock.close()


@dataclass(frozen=True)
class _Grant:
    job_id: str
    rank: int
    expires: float


class LaneHub:
    """The receiving side: a listener on `host`, tokens granted per (job, rank), lanes by token."""

    def __init__(self, host: str, port: int = 0):
        self._listener = listen_socket(host, port, backlog=64)  # ListenError naming host:port if it cannot
        self.port = self._listener.getsockname()[1]
        self._grants: dict[bytes, _Grant] = {}
        self._lanes: dict[bytes, LaneSocket] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._handshakes = threading.BoundedSemaphore(MAX_HANDSHAKES)
        self._thread = threading.Thread(target=self._accept, name=f"lanes-{self.port}", daemon=True)
        self._thread.start()

    def grant(self, job_id: str, rank: int) -> bytes:
        token = secrets.token_bytes(TOKEN_BYTES)
        now = time.monotonic()
        with self._lock:
            for stale in [t for t, g in self._grants.items() if g.expires < now]:
                del self._grants[stale]
            self._grants[token] = _Grant(job_id, rank, now + GRANT_TTL_S)
        return token

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                if self._closed:
                    return
                time.sleep(0.05)
                continue
            if not self._handshakes.acquire(blocking=False):
                conn.close()
                continue
            threading.Thread(target=self._handshake, args=(conn,), name="lane-handshake", daemon=True).start()

    def _handshake(self, conn: socket.socket) -> None:
        try:
            self._introduce(conn)
        finally:
            self._handshakes.release()

    def _introduce(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(HANDSHAKE_TIMEOUT_S)
            token = bytearray(TOKEN_BYTES)
            view = memoryview(token)
            while len(view):
                n = conn.recv_into(view)
                if n == 0:
                    raise OSError("closed during the handshake")
                view = view[n:]
            token = bytes(token)
            with self._lock:
                grant = self._grants.pop(token, None)
                if grant is None or grant.expires < time.monotonic() or self._closed:
                    raise OSError("unknown or expired lane token")
                lane = LaneSocket(conn, grant.job_id, grant.rank, token)
                self._lanes[token] = lane
                self._trim(grant.job_id, grant.rank)
            conn.sendall(READY)
            conn.settimeout(None)
        except OSError:
            conn.close()

    @staticmethod
    def _retire(lane: LaneSocket) -> None:
        """Close a lane; one a stream is using is only shut down here, and closed when the stream releases it
        (closing a descriptor another thread uses could hit whatever reuses its number)."""
        if lane.lock.acquire(blocking=False):
            lane.close()
            lane.lock.release()
        else:
            lane.abort()

    def _trim(self, job_id: str, rank: int) -> None:
        mine = sorted(
            (lane for lane in self._lanes.values() if (lane.job_id, lane.rank) == (job_id, rank)),
            key=lambda lane: lane.last_used,
        )
        for lane in mine[: max(0, len(mine) - LANES_PER_PEER)]:
            if lane.lock.acquire(blocking=False):  # idle ones only
                self._lanes.pop(lane.token, None)
                lane.close()
                lane.lock.release()

    def claim(self, token: bytes, job_id: str, rank: int) -> LaneSocket:
        """The lane of `token`, held exclusively, when it was granted to `rank` of `job_id`; else WireError."""
        with self._lock:
            lane = self._lanes.get(bytes(token))
        if lane is None or lane.closed:
            raise WireError("bad_lane", "no open lane has this token")
        if (lane.job_id, lane.rank) != (job_id, rank):
            raise WireError("bad_lane", f"the lane belongs to rank {lane.rank} of another stream's sender or job")
        if not lane.lock.acquire(blocking=False):
            raise WireError("bad_lane", "the lane is in use by another stream")
        return lane

    def release(self, lane: LaneSocket, ok: bool) -> None:
        """Hand a claimed lane back; after a failure it is closed, as its byte stream may be out of step."""
        lane.last_used = time.monotonic()
        if not ok or lane.closed:
            lane.close()
            with self._lock:
                if self._lanes.get(lane.token) is lane:
                    del self._lanes[lane.token]
        lane.lock.release()

    def forget_job(self, job_id: str) -> None:
        """Close the lanes of a job that this node no longer runs."""
        with self._lock:
            gone = [lane for lane in self._lanes.values() if lane.job_id != job_id]
            for lane in gone:
                del self._lanes[lane.token]
        for lane in gone:
            self._retire(lane)

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            lanes = list(self._lanes.values())
            self._lanes.clear()
        for lane in lanes:
            self._retire(lane)


def split_host(address: str) -> str | None:
    """The host of a HOST:PORT gRPC target (None for targets a lane cannot dial, like unix: sockets)."""
    if "://" in address or address.startswith(("unix:", "dns:", "ipv4:", "ipv6:")):
        return None
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        return None
    return host.strip("[]")


def dial(host: str, port: int, token: bytes, job_id: str, rank: int, timeout: float) -> LaneSocket:
    """Open a lane with a granted token. Raises OSError."""
    sock = socket.create_connection((host, port), timeout=timeout)
    try:
        _tune(sock)
        sock.sendall(token)
        answer = sock.recv(1)
        if answer != READY:
            raise OSError("the peer refused the lane")
        sock.settimeout(None)
    except BaseException:
        sock.close()
        raise
    return LaneSocket(sock, job_id, rank, token)
