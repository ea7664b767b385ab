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
and that rank as its sender. Beside a mutual-TLS gRPC channel the lane is TLS too (the contexts of
nodeagent.security.tls): the client verifies the receiver's node name, and the receiver admits the lane only
from the node whose certificate made the OpenLane call. Insecure mode keeps plain sockets, as fast as before.
One stream at a time uses a lane; any error closes it (its byte stream may be out of step) and the next stream
opens another.

A connection holds a handshake slot until it has presented its token, at most HANDSHAKE_TIMEOUT_S: the TLS
handshake comes first, so nothing is known of it yet but its source address, which is bounded on its own
(MAX_HANDSHAKES_PER_SOURCE) so that idle connections from one place leave slots for everyone else.
"""

from __future__ import annotations

import contextlib
import ipaddress
import secrets
import socket
import ssl
import struct
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from nodeagent.listen import listen_socket
from nodeagent.security.pki import Role
from nodeagent.security.tls import peer_identity
from nodeagent.wire.decoder import LaneReader
from nodeagent.wire.errors import WireError

TOKEN_BYTES = 32
READY = b"\x01"
GRANT_TTL_S = 10.0  # a granted token must be presented within this
HANDSHAKE_TIMEOUT_S = 5.0  # a connection's whole handshake: TLS, then its token
MAX_HANDSHAKES = 32  # connections still to present their token; more are closed at once
MAX_HANDSHAKES_PER_SOURCE = 8  # of those, from one source address (an IPv6 /64: one host may hold all of it)
LANES_PER_PEER = 16  # open lanes per node (TLS) or per (job, rank); the oldest idle one makes room, else refused
DEFAULT_TIMEOUT_S = 60.0  # lane I/O of a call without a deadline
# A payload is striped over one lane per STRIPE_BYTES, at most MAX_STRIPES: one TCP connection on loopback stalls
# on its own window and wake-ups; a few side by side overlap those stalls (measured: 44 MB in one lane 17 ms,
# in two 11.5 ms, in four 11.5-12 ms on this machine kind).
STRIPE_BYTES = 4 << 20
MAX_STRIPES = 2
# A TLS lane is bound by the processor, not the socket: per 44 MB, receiving costs about 50 ms of CPU and sending
# 27 ms (AES-GCM, then OpenSSL's 16 kB records, a system call or two and a Python call each). More lanes use more
# cores where the machine has them (measured, 44 MB on 2 busy cores: 1 lane 110 ms, 2 lanes 99, 4 lanes 82, 8 84).
MAX_TLS_STRIPES = 4


def stripes_for(nbytes: int, tls: bool = False) -> int:
    return max(1, min(MAX_TLS_STRIPES if tls else MAX_STRIPES, nbytes // STRIPE_BYTES))


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


_TIMEVAL = struct.Struct("@ll")


class LaneSocket(LaneReader):
    """One lane end: exact reads and whole writes with a deadline. The first error shuts it down (`abort`);
    only its owner closes the socket, once no other thread can be using it (a closed descriptor's number may
    be reused at once). `sock` is a plain socket or, on a TLS lane, an ssl.SSLSocket."""

    def __init__(self, sock: socket.socket, job_id: str = "", rank: int = -1, token: bytes = b"",
                 grantee: str | None = None):
        _tune(sock)
        self.tls = isinstance(sock, ssl.SSLSocket)
        if not self.tls:
            sock.settimeout(None)
        self.sock = sock
        self.job_id = job_id
        self.rank = rank
        self.token = token
        self.grantee = grantee  # the node a hub's TLS lane was granted to (None: plaintext, or the dialling end)
        self.lock = threading.Lock()
        # One OpenSSL connection must not be used by two threads at once, and a lane carries one way at a time
        # anyway (a reply's payload follows the request's): a TLS lane's reads and writes take turns.
        self._turn = threading.Lock()
        self.closed = False
        self.last_used = time.monotonic()
        self.deadline = self.last_used + DEFAULT_TIMEOUT_S

    @property
    def owner(self) -> str | tuple[str, int]:
        """Whose lane it is, for LANES_PER_PEER: the node it was granted to, else its job and rank."""
        return self.grantee if self.grantee is not None else (self.job_id, self.rank)

    def set_timeout(self, seconds: float | None) -> None:
        """Deadline of the sends and receives that follow, `seconds` from now. A plain socket stays in blocking
        mode with kernel timeouts (SO_RCVTIMEO, SO_SNDTIMEO) set to the time left before each system call, so a
        whole payload moves in one call rather than in Python's poll-then-read loop of timeout mode. An SSL
        socket is in timeout mode instead: in blocking mode Python's ssl retries, without end, a read that a
        kernel timeout ended."""
        self.deadline = time.monotonic() + (DEFAULT_TIMEOUT_S if seconds is None else max(seconds, 0.001))

    def _left(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("lane deadline passed")
        return left

    def _arm(self, option: int) -> None:
        left = self._left()
        whole = int(left)
        self.sock.setsockopt(socket.SOL_SOCKET, option, _TIMEVAL.pack(whole, max(1, int((left - whole) * 1e6))))

    @contextlib.contextmanager
    def _taking_turns(self) -> Iterator[None]:
        if not self.tls:
            yield
            return
        if not self._turn.acquire(timeout=self._left()):
            raise TimeoutError("the lane was busy until the deadline")
        try:
            yield
        finally:
            self._turn.release()

    def _receive_some(self, view: memoryview) -> int:
        if self.tls:  # no flags on SSL sockets; one TLS record (16 kB at most) a call
            self.sock.settimeout(self._left())
            return self.sock.recv_into(view)
        self._arm(socket.SO_RCVTIMEO)
        return self.sock.recv_into(view, len(view), socket.MSG_WAITALL)

    def _send_some(self, view: memoryview) -> int:
        if self.tls:  # OpenSSL writes the whole view, record by record, within the timeout
            self.sock.settimeout(self._left())
        else:
            self._arm(socket.SO_SNDTIMEO)
        return self.sock.send(view)

    def read_into(self, view: memoryview) -> None:
        try:
            with self._taking_turns():
                while len(view):
                    n = self._receive_some(view)
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
            with self._taking_turns():
                for piece in pieces:
                    view = memoryview(piece)
                    while len(view):
                        view = view[self._send_some(view) :]
        except BlockingIOError:
            self.abort()
            raise TimeoutError("the lane's peer did not read in time") from None
        except BaseException:
            self.abort()
            raise

    def alive(self) -> bool:
        """Whether an idle lane is still open at the other end (it has sent nothing, and not closed). The socket's
        own bytes are peeked, under TLS too: an idle TLS lane has no records to read but, at most, its peer's
        session tickets."""
        if self.closed:
            return False
        try:
            if self.tls:
                self.sock.settimeout(0.0)  # timeout mode would wait for a byte; every read and write sets its own
            return socket.socket.recv(self.sock, 1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
        except BlockingIOError:
            return True
        except OSError:
            return False

    def abort(self) -> None:
        """Unblock a send or receive in progress in another thread; the lane is finished."""
        self.closed = True
        with contextlib.suppress(OSError):
            # socket.socket's own: SSLSocket.shutdown would also drop the SSL object from under a thread using it.
            socket.socket.shutdown(self.sock, socket.SHUT_RDWR)

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(OSError):
            self.sock.close()


@dataclass(frozen=True)
class _Grant:
    job_id: str
    rank: int
    grantee: str | None  # the node whose certificate a TLS lane must carry (None: any node of the cluster)
    expires: float


def _source_of(host: str) -> str:
    """The source a connection's handshake counts against: its IPv4 address, or its IPv6 /64."""
    address = ipaddress.ip_address(host.partition("%")[0])
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:  # an IPv4 client of a dual-stack listener
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


def _time_left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the lane handshake took too long")
    return left


def _read_token(conn: socket.socket, deadline: float) -> bytes:
    token = bytearray(TOKEN_BYTES)
    view = memoryview(token)
    while len(view):
        conn.settimeout(_time_left(deadline))
        n = conn.recv_into(view)
        if n == 0:
            raise OSError("closed during the handshake")
        view = view[n:]
    return bytes(token)


def _is_grantee(conn: ssl.SSLSocket, grant: _Grant) -> bool:
    """Whether a TLS lane's certificate is of the node its token was granted to."""
    identity = peer_identity(conn)
    return identity is not None and identity.role is Role.NODE and grant.grantee in (None, identity.name)


class LaneHub:
    """The receiving side: a listener on `host`, tokens granted per (job, rank), lanes by token. With `tls`, a
    server context of nodeagent.security.tls, every lane is TLS; one granted to a node is admitted only from a
    certificate of that node."""

    def __init__(self, host: str, port: int = 0, tls: ssl.SSLContext | None = None):
        self._listener = listen_socket(host, port, backlog=64)  # ListenError naming host:port if it cannot
        self.port = self._listener.getsockname()[1]
        self._tls = tls
        self._grants: dict[bytes, _Grant] = {}
        self._lanes: dict[bytes, LaneSocket] = {}
        self._handshaking: dict[str, int] = {}  # source -> its connections still in their handshake
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name=f"lanes-{self.port}", daemon=True)
        self._thread.start()

    def grant(self, job_id: str, rank: int, grantee: str | None = None) -> bytes:
        """A one-time token for a lane of `rank` of `job_id`; on TLS lanes, for node `grantee` only."""
        token = secrets.token_bytes(TOKEN_BYTES)
        now = time.monotonic()
        with self._lock:
            for stale in [t for t, g in self._grants.items() if g.expires < now]:
                del self._grants[stale]
            self._grants[token] = _Grant(job_id, rank, grantee, now + GRANT_TTL_S)
        return token

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, address = self._listener.accept()
            except OSError:
                if self._closed:
                    return
                time.sleep(0.05)
                continue
            source = _source_of(address[0])
            if not self._start_handshake(source):
                conn.close()
                continue
            threading.Thread(target=self._handshake, args=(conn, source), name="lane-handshake", daemon=True).start()

    def _start_handshake(self, source: str) -> bool:
        with self._lock:
            count = self._handshaking.get(source, 0)
            if count >= MAX_HANDSHAKES_PER_SOURCE or sum(self._handshaking.values()) >= MAX_HANDSHAKES:
                return False
            self._handshaking[source] = count + 1
            return True

    def _handshake(self, conn: socket.socket, source: str) -> None:
        try:
            self._introduce(conn)
        finally:
            with self._lock:
                self._handshaking[source] -= 1
                if not self._handshaking[source]:
                    del self._handshaking[source]

    def _introduce(self, conn: socket.socket) -> None:
        deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
        lane: LaneSocket | None = None
        try:
            if self._tls is not None:
                conn.settimeout(_time_left(deadline))
                conn = self._tls.wrap_socket(conn, server_side=True)  # the TLS handshake, within the timeout
            token = _read_token(conn, deadline)
            with self._lock:
                grant = self._grants.pop(token, None)
                if grant is None or grant.expires < time.monotonic() or self._closed:
                    raise OSError("unknown or expired lane token")
                if isinstance(conn, ssl.SSLSocket) and not _is_grantee(conn, grant):
                    raise OSError("the lane's certificate is not of the node its token was granted to")
                candidate = LaneSocket(conn, grant.job_id, grant.rank, token, grant.grantee if self._tls else None)
                if not self._make_room(candidate):
                    raise OSError(f"{candidate.owner} has {LANES_PER_PEER} lanes in use")
                lane = self._lanes[token] = candidate
            conn.sendall(READY)
        except OSError:
            if lane is not None:
                with self._lock:
                    if self._lanes.get(lane.token) is lane:
                        del self._lanes[lane.token]
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

    def _make_room(self, lane: LaneSocket) -> bool:
        """Room for `lane` among its owner's (under the lock): beyond LANES_PER_PEER the oldest idle ones are
        closed; False when there are that many in use."""
        mine = sorted((other for other in self._lanes.values() if other.owner == lane.owner),
                      key=lambda other: other.last_used)
        excess = len(mine) + 1 - LANES_PER_PEER
        for old in mine:
            if excess <= 0:
                break
            if old.lock.acquire(blocking=False):  # idle ones only
                del self._lanes[old.token]
                old.close()
                old.lock.release()
                excess -= 1
        return excess <= 0

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


def dial(host: str, port: int, token: bytes, job_id: str, rank: int, timeout: float,
         tls: ssl.SSLContext | None = None, server_name: str = "") -> LaneSocket:
    """Open a lane with a granted token. With `tls`, a client context of nodeagent.security.tls, the lane is TLS
    and the receiver must prove to be `server_name` (its node id). Raises OSError (ssl.SSLError when TLS fails:
    a wrong name, another CA, a certificate the receiver refuses)."""
    sock = socket.create_connection((host, port), timeout=timeout)
    try:
        _tune(sock)
        if tls is not None:
            sock = tls.wrap_socket(sock, server_hostname=server_name)  # the TLS handshake, within the timeout
        sock.sendall(token)
        answer = sock.recv(1)
        if answer != READY:
            raise OSError("the peer refused the lane")
    except BaseException:
        sock.close()
        raise
    return LaneSocket(sock, job_id, rank, token)
