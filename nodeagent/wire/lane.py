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
and that rank as its sender. Beside a mutual-TLS gRPC channel the grant also carries a fresh AES-256-GCM key, and
the lane is sealed both ways with it after the token: only the caller that the receiver authenticated and
authorised on OpenLane (the neighbour assigned that rank) has the key, so a lane opened with a token seen on the
wire delivers nothing, and a changed, dropped, replayed or reordered byte fails authentication. Insecure mode
keeps plain sockets, as fast as before. One stream at a time uses a lane; any error closes it (its byte stream
may be out of step) and the next stream opens another.

Sealed records, each way: a 4-byte big-endian length L of the ciphertext (17 <= L <= RECORD_BYTES + 16, checked
before anything is read into a buffer), then L bytes: the AES-256-GCM ciphertext of L - 16 plaintext bytes and
its 16-byte tag. The additional authenticated data is the 4 length bytes. The 12-byte nonce is a 4-byte
direction tag (TO_HUB from the dialling end, FROM_HUB from the hub's: the two directions share the key, never a
nonce) and the 8-byte big-endian count of the records sent that way on the lane so far, from 0. The lane closes
rather than let a count wrap. Records carry the lane's byte stream as it was before, up to RECORD_BYTES each: a
piece of a payload of SEAL_IN_PLACE_BYTES or more in records of its own, the smaller pieces and a stream's header
coalesced (Python's ssl, with its 16 kB records and a Python call each, cost about four times the CPU;
benchmarks/wire.py). Plaintext lanes carry the byte stream as it is.

A connection holds a handshake slot until it has presented its token, at most HANDSHAKE_TIMEOUT_S: nothing is
known of it yet but its source address, which is bounded on its own (MAX_HANDSHAKES_PER_SOURCE) so that idle
connections from one place leave slots for everyone else.

Direct lanes: a message of a training round is often small, and a gRPC call per message costs milliseconds in
Python (a call object, a request-consuming thread, several wake-ups a side) where its bytes cost microseconds. A
lane granted `direct` carries whole calls itself: the caller writes a LaneCall (its length, 4 bytes big-endian,
at most MAX_CONTROL_FRAME_BYTES, then the message: the Manifest, Lane and End frames of a stream, the Lane frame
naming this lane) and the stream's payload; the hub's end reads it in a thread of its own (`serve`), validates and
decodes it as any stream, and answers with a LaneCall of its own (a status, and for an Exchange its message and
payload). The trust is the grant's: a direct lane speaks for the one rank of one job, and under TLS the one node,
that OpenLane authorised, sealed with the key only that node received; each call is checked again against the
current job, the caller's edge and the revoked certificates. A direct lane that waits DIRECT_IDLE_S for a call is
closed; after any refusal it is closed too (its byte stream may hold a payload nobody read).

Calls written ahead: the hub answers a lane's calls one after the other, in order, so a caller may write a small
call (`write_ahead`) before the answers to the calls before it are read, and read those answers later, in the same
order (`owed` keeps the caller's record of each). A refusal closes the lane at the hub: the calls written after the
refused one were never read, and fail as on a lost lane.
"""

from __future__ import annotations

import collections
import contextlib
import ipaddress
import itertools
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from google.protobuf.message import DecodeError

from nodeagent._proto import wire_pb2
from nodeagent.listen import listen_socket
from nodeagent.wire.decoder import LaneReader
from nodeagent.wire.errors import Reason, WireError
from nodeagent.wire.frames import MAX_CONTROL_FRAME_BYTES

TOKEN_BYTES = 32
KEY_BYTES = 32  # AES-256
READY = b"\x01"
GRANT_TTL_S = 10.0  # a granted token must be presented within this
HANDSHAKE_TIMEOUT_S = 5.0  # a connection's whole handshake: its token
MAX_HANDSHAKES = 32  # connections still to present their token; more are closed at once
MAX_HANDSHAKES_PER_SOURCE = 8  # of those, from one source address (an IPv6 /64: one host may hold all of it)
LANES_PER_PEER = 16  # open lanes per node (under TLS) or per (job, rank); the oldest idle one makes room, else refused
# Of those, direct lanes (each holds a serving thread while open): a node uses one per neighbour and job; a few more
# let a restarted neighbour open its new one before the old one is found closed.
DIRECT_LANES_PER_PEER = 4
DIRECT_IDLE_S = 60.0  # a direct lane with no call for this long is closed (its caller opens another when needed)
CALL_LENGTH = struct.Struct(">I")
# A call whose payload is at most this is written in one piece (one system call, one TCP segment train): below
# it, the copy costs less than the calls it saves.
COALESCE_BYTES = 64 << 10
# Read at most at once by a short read (a call's length, say) or by `readable`: a whole call with a payload of up to
# COALESCE_BYTES, sealed or not, or many answers without payload (4 bytes each, 24 sealed).
READ_AHEAD_BYTES = COALESCE_BYTES + 4096
DEFAULT_TIMEOUT_S = 60.0  # lane I/O of a call without a deadline
# A payload is striped over one lane per STRIPE_BYTES, at most MAX_STRIPES: one TCP connection on loopback stalls
# on its own window and wake-ups; a few side by side overlap those stalls (measured: 44 MB in one lane 17 ms,
# in two 11.5 ms, in four 11.5-12 ms on this machine kind).
STRIPE_BYTES = 4 << 20
MAX_STRIPES = 2
# A sealed lane costs AES-GCM at about 3-4 GB/s a core each way beside the copies. Measured, a 44 MB Push under TLS
# on 2 busy cores (benchmarks/wire.py): 2 lanes 0.59-0.67x gloo on loopback and 0.76-0.80x on a 10 Gbit/s link, 4 lanes
# 0.70-0.71x and 0.63-0.67x: more connections gain a little on loopback and lose more on a link.
MAX_SEALED_STRIPES = 2

RECORD_BYTES = 1 << 20  # of plaintext in one sealed record: few Python calls per payload, a small scratch
# A piece of a sealed write this long or longer is sealed from its own memory, in records of its own; shorter ones
# are gathered (a record's fixed cost, a few microseconds, is about that of copying this many bytes).
SEAL_IN_PLACE_BYTES = 64 << 10
TAG_BYTES = 16
RECORD_LENGTH = struct.Struct(">I")  # a sealed record's ciphertext length, its additional authenticated data
TO_HUB = b"lane"  # the direction tag of records from the dialling end
FROM_HUB = b"hub "  # of records from the hub's end
_RECORD_NONCE = struct.Struct(">4sQ")
MAX_RECORDS = 1 << 64  # a direction's record count never wraps: the lane is closed first


def stripes_for(nbytes: int, sealed: bool = False) -> int:
    return max(1, min(MAX_SEALED_STRIPES if sealed else MAX_STRIPES, nbytes // STRIPE_BYTES))


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


_TIMEVAL = struct.Struct("@ll")


class _Sealer:
    """One direction's records of a sealed lane: the key, the direction tag, the record count, and scratch
    buffers allocated on first use (an idle lane holds none)."""

    def __init__(self, cipher: AESGCM, direction: bytes):
        self.cipher = cipher
        self.direction = direction
        self.count = 0
        self.scratch = memoryview(b"")

    def nonce(self) -> bytes:
        if self.count >= MAX_RECORDS:
            raise OSError("the lane has used up its record counter")
        nonce = _RECORD_NONCE.pack(self.direction, self.count)
        self.count += 1
        return nonce

    def buffer(self, nbytes: int) -> memoryview:
        if not len(self.scratch):
            self.scratch = memoryview(bytearray(nbytes))
        return self.scratch


class LaneSocket(LaneReader):
    """One lane end: exact reads and whole writes with a deadline, sealed with `key` when it has one (the end
    that dialled is `dialled`: it sends TO_HUB records and reads FROM_HUB ones). The first error shuts it down
    (`abort`); only its owner closes the socket, once no other thread can be using it (a closed descriptor's
    number may be reused at once)."""

    def __init__(self, sock: socket.socket, job_id: str = "", rank: int = -1, token: bytes = b"",
                 grantee: str | None = None, key: bytes | None = None, dialled: bool = False):
        _tune(sock)
        sock.settimeout(None)
        self.sock = sock
        self.job_id = job_id
        self.rank = rank
        self.token = token
        self.grantee = grantee  # the node a hub's lane was granted to (None: an insecure hub, or the dialling end)
        self.sealed = key is not None
        cipher = AESGCM(key) if key is not None else None
        self._seal = _Sealer(cipher, TO_HUB if dialled else FROM_HUB) if cipher is not None else None
        self._open = _Sealer(cipher, FROM_HUB if dialled else TO_HUB) if cipher is not None else None
        self._plaintext = memoryview(b"")  # of the last record opened, not read yet
        self._ahead = memoryview(b"")  # bytes received ahead of the reads that take them, in `_ahead_space`
        self._ahead_space = memoryview(b"")
        self.lock = threading.Lock()
        self.closed = False
        self.direct = False  # a direct lane: it carries whole calls (see the module's docstring)
        self.holder: object = None  # who a hub's lane was granted to, as the granting call knew it (an Identity)
        # The dialling end's records of the calls it wrote ahead on a direct lane, whose answers are still to be read
        # (in the order they will come), under `lock`: see `write_ahead`.
        self.owed: collections.deque = collections.deque()
        self.last_used = time.monotonic()
        self.deadline = self.last_used + DEFAULT_TIMEOUT_S

    @property
    def owner(self) -> str | tuple[str, int]:
        """Whose lane it is, for LANES_PER_PEER: the node it was granted to, else its job and rank."""
        return self.grantee if self.grantee is not None else (self.job_id, self.rank)

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

    def _receive_exactly(self, view: memoryview) -> None:
        if len(self._ahead):
            n = min(len(view), len(self._ahead))
            view[:n] = self._ahead[:n]
            view, self._ahead = view[n:], self._ahead[n:]
        while len(view):
            self._arm(socket.SO_RCVTIMEO)
            if len(view) < READ_AHEAD_BYTES:
                # A short read takes what has come beyond it too, for the reads that follow: a direct lane's call
                # (its length, its message, a small payload) in one system call, not three.
                buffer = self._ahead_buffer()
                n = self.sock.recv_into(buffer, READ_AHEAD_BYTES)
                taken = min(n, len(view))
                view[:taken] = buffer[:taken]
                self._ahead = buffer[taken:n]
            else:
                n = self.sock.recv_into(view, len(view), socket.MSG_WAITALL)
                taken = n
            if n == 0:
                raise WireError(Reason.TRUNCATED, "the lane closed before the stream's payload was complete")
            view = view[taken:]

    def _ahead_buffer(self) -> memoryview:
        """Where bytes are read ahead (allocated on first use: an idle lane holds none); empty when used."""
        if not len(self._ahead_space):
            self._ahead_space = memoryview(bytearray(READ_AHEAD_BYTES))
        return self._ahead_space

    def _send_exactly(self, view: memoryview) -> None:
        while len(view):
            self._arm(socket.SO_SNDTIMEO)
            view = view[self.sock.send(view) :]

    def _read_sealed(self, view: memoryview) -> None:
        """Fill `view` from the lane's records: the rest of the last one first, then each next record opened
        straight into `view` while it fits, else into scratch that the next read starts from."""
        opener = self._open
        assert opener is not None
        while len(view):
            if len(self._plaintext):
                n = min(len(view), len(self._plaintext))
                view[:n] = self._plaintext[:n]
                view, self._plaintext = view[n:], self._plaintext[n:]
                continue
            # One buffer: the length, the ciphertext, then room for a record's plaintext that overflows `view`.
            scratch = opener.buffer(RECORD_LENGTH.size + 2 * RECORD_BYTES + TAG_BYTES)
            length_bytes = scratch[: RECORD_LENGTH.size]
            self._receive_exactly(length_bytes)
            (length,) = RECORD_LENGTH.unpack(length_bytes)
            if not TAG_BYTES < length <= RECORD_BYTES + TAG_BYTES:
                raise WireError(Reason.BAD_LANE,
                                f"a sealed record of {length} bytes, at most {RECORD_BYTES + TAG_BYTES}")
            if len(self._ahead) >= length:  # read ahead already (a small record): opened where it lies
                ciphertext, self._ahead = self._ahead[:length], self._ahead[length:]
            else:
                ciphertext = scratch[RECORD_LENGTH.size : RECORD_LENGTH.size + length]
                self._receive_exactly(ciphertext)
            plaintext_bytes = length - TAG_BYTES
            fits = plaintext_bytes <= len(view)
            target = view[:plaintext_bytes] if fits else scratch[-RECORD_BYTES:][:plaintext_bytes]
            try:
                opener.cipher.decrypt_into(opener.nonce(), ciphertext, length_bytes, target)
            except InvalidTag:
                raise WireError(Reason.BAD_LANE, "a sealed lane record failed authentication") from None
            if fits:
                view = view[plaintext_bytes:]
            else:
                self._plaintext = target

    def read_into(self, view: memoryview) -> None:
        try:
            if self._open is not None:
                self._read_sealed(view)
            else:
                self._receive_exactly(view)
        except (TimeoutError, BlockingIOError):
            self.abort()
            raise WireError(Reason.TRUNCATED, "the lane's payload did not arrive in time") from None
        except OSError as error:
            self.abort()
            raise WireError(Reason.TRUNCATED, f"the lane failed: {error}") from None
        except WireError:
            self.abort()
            raise

    def _sealed_record(self, plaintext: memoryview) -> memoryview:
        """The next record of `plaintext` (at most RECORD_BYTES), sealed in this direction's scratch."""
        sealer = self._seal
        assert sealer is not None
        scratch = sealer.buffer(RECORD_LENGTH.size + RECORD_BYTES + TAG_BYTES)
        length = len(plaintext) + TAG_BYTES
        RECORD_LENGTH.pack_into(scratch, 0, length)
        record = scratch[: RECORD_LENGTH.size + length]
        sealer.cipher.encrypt_into(sealer.nonce(), plaintext, record[: RECORD_LENGTH.size],
                                   record[RECORD_LENGTH.size :])
        return record

    def _send_record(self, plaintext: memoryview) -> None:
        self._send_exactly(self._sealed_record(plaintext))

    def _send_sealed(self, pieces: Iterable[memoryview | bytes]) -> None:
        """Seal the pieces into records: a piece of SEAL_IN_PLACE_BYTES or more straight from its own memory, in
        records of up to RECORD_BYTES from its first byte; the smaller ones around it gathered into one record (a
        piece may be reused once the next is asked for, so a mutable one is copied first). A large piece's records
        then start where it does, so the receiver, reading it into its destination, opens each record straight
        there: records filled to RECORD_BYTES across pieces put the call's header at the head of the payload's
        first record, and the sender copied the payload's first MiB and every piece's tail to gather them, the
        receiver a record of it."""
        held: list[bytes] = []  # the small pieces of the next record
        held_bytes = 0
        for piece in pieces:
            view = memoryview(piece)
            large = len(view) >= SEAL_IN_PLACE_BYTES
            if held and (large or held_bytes + len(view) > RECORD_BYTES):
                self._send_record(memoryview(b"".join(held)))  # one piece: itself, not a copy
                held, held_bytes = [], 0
            if large:
                while len(view):
                    self._send_record(view[:RECORD_BYTES])
                    view = view[RECORD_BYTES:]
            else:
                held.append(piece if isinstance(piece, bytes) else view.tobytes())
                held_bytes += len(view)
        if held:
            self._send_record(memoryview(b"".join(held)))

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        """A failed write shuts the lane down; one past the deadline raises TimeoutError."""
        try:
            yield
        except BlockingIOError:
            self.abort()
            raise TimeoutError("the lane's peer did not read in time") from None
        except BaseException:
            self.abort()
            raise

    def send(self, pieces: Iterable[memoryview | bytes]) -> None:
        """Write every piece (each is consumed before the next is asked for). Raises OSError (TimeoutError at
        the deadline)."""
        with self._writing():
            if self._seal is not None:
                self._send_sealed(pieces)
            else:
                for piece in pieces:
                    self._send_exactly(memoryview(piece))

    def write_ahead(self, data: bytes) -> memoryview:
        """Write `data` (at most RECORD_BYTES: one record when sealed) as far as the socket takes it without waiting;
        returns what it did not take, which `finish` writes (sealed, the rest of the record, in this lane's scratch:
        nothing else may be written on the lane first). Raises OSError."""
        record = self._sealed_record(memoryview(data)) if self._seal is not None else memoryview(data)
        try:
            written = self.sock.send(record, socket.MSG_DONTWAIT)
        except BlockingIOError:
            written = 0
        except BaseException:
            self.abort()
            raise
        return record[written:]

    def finish(self, rest: memoryview) -> None:
        """Write the rest that `write_ahead` left, by the lane's deadline. Raises OSError."""
        with self._writing():
            self._send_exactly(rest)

    def readable(self) -> bool:
        """Whether a read would find something at once: bytes, or the other end closed. The bytes that have come
        (up to READ_AHEAD_BYTES) are taken in the same system call, for the reads that follow: a caller that reads
        a few small answers when it passes by makes one system call, not two per answer."""
        if len(self._plaintext) or len(self._ahead):
            return True
        buffer = self._ahead_buffer()
        try:
            received = self.sock.recv_into(buffer, READ_AHEAD_BYTES, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return False
        except OSError:
            return True  # the read fails at once
        self._ahead = buffer[:received]
        return True

    def alive(self) -> bool:
        """Whether an idle lane is still open at the other end (it has sent nothing, and not closed)."""
        if self.closed:
            return False
        if len(self._ahead):
            return True
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
class Grant:
    """What OpenLane answers: the token that admits one lane and, on a sealed hub, the lane's key."""

    token: bytes
    key: bytes | None


@dataclass(frozen=True)
class _Granted:
    job_id: str
    rank: int
    grantee: str | None  # the node OpenLane's caller proved to be (None: an insecure hub)
    key: bytes | None
    expires: float
    direct: bool = False
    holder: object = None


def send_call(lane: LaneSocket, call: wire_pb2.LaneCall, payload: Iterable[memoryview | bytes] = (),
              payload_bytes: int = 0) -> None:
    """Write a call (or an answer) on a direct lane, then its payload; a small one in one piece. Raises OSError."""
    if payload_bytes <= COALESCE_BYTES:
        lane.send((call_bytes(call, payload),))
    else:
        body = call.SerializeToString()
        lane.send(itertools.chain((CALL_LENGTH.pack(len(body)) + body,), payload))


def call_bytes(call: wire_pb2.LaneCall, payload: Iterable[memoryview | bytes] = ()) -> bytes:
    """A call and its payload (at most COALESCE_BYTES) in one piece, as `send_call` writes it."""
    body = call.SerializeToString()
    return b"".join((CALL_LENGTH.pack(len(body)), body, *(bytes(piece) for piece in payload)))


def read_call(lane: LaneSocket) -> wire_pb2.LaneCall:
    """Read the next call (or answer) of a direct lane, by the lane's deadline; its payload stays on the lane for
    the stream's receiver. Raises WireError."""
    length_bytes = bytearray(CALL_LENGTH.size)
    lane.read_into(memoryview(length_bytes))
    (length,) = CALL_LENGTH.unpack(length_bytes)
    if length > MAX_CONTROL_FRAME_BYTES:
        lane.abort()
        raise WireError(Reason.BAD_LANE, f"a lane call of {length} bytes, at most {MAX_CONTROL_FRAME_BYTES}")
    body = bytearray(length)
    lane.read_into(memoryview(body))
    call = wire_pb2.LaneCall()
    try:
        call.ParseFromString(bytes(body))
    except DecodeError:
        lane.abort()
        raise WireError(Reason.BAD_LANE, "a lane call that does not parse") from None
    return call


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


class LaneHub:
    """The receiving side: a listener on `host`, tokens granted per (job, rank), lanes by token. A `sealed` hub
    (beside mutual TLS) grants a key with each token and seals every lane with it."""

    def __init__(self, host: str, port: int = 0, sealed: bool = False,
                 serve: Callable[[LaneSocket], None] | None = None):
        """`serve(lane)` serves a direct lane's calls, in a thread of its own, holding the lane; the hub closes the
        lane when it returns. Without it no direct lane is granted."""
        self._listener = listen_socket(host, port, backlog=64)  # ListenError naming host:port if it cannot
        self.port = self._listener.getsockname()[1]
        self.sealed = sealed
        self.serve = serve
        self._grants: dict[bytes, _Granted] = {}
        self._lanes: dict[bytes, LaneSocket] = {}
        self._handshaking: dict[str, int] = {}  # source -> its connections still in their handshake
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name=f"lanes-{self.port}", daemon=True)
        self._thread.start()

    def grant(self, job_id: str, rank: int, grantee: str | None = None, *, direct: bool = False,
              holder: object = None) -> Grant:
        """A one-time token for a lane of `rank` of `job_id`, granted to node `grantee` (its lanes count against
        LANES_PER_PEER together); on a sealed hub with the lane's key. A `direct` lane is served by `serve`, which
        finds `holder` on it (`direct` needs `serve`)."""
        if direct and self.serve is None:
            raise ValueError("this hub serves no direct lanes")
        token = secrets.token_bytes(TOKEN_BYTES)
        key = secrets.token_bytes(KEY_BYTES) if self.sealed else None
        now = time.monotonic()
        with self._lock:
            for stale in [t for t, g in self._grants.items() if g.expires < now]:
                del self._grants[stale]
            self._grants[token] = _Granted(job_id, rank, grantee, key, now + GRANT_TTL_S, direct, holder)
        return Grant(token, key)

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
            token = _read_token(conn, deadline)
            with self._lock:
                grant = self._grants.pop(token, None)
                if grant is None or grant.expires < time.monotonic() or self._closed:
                    raise OSError("unknown or expired lane token")
                candidate = LaneSocket(conn, grant.job_id, grant.rank, token, grant.grantee, grant.key)
                candidate.direct, candidate.holder = grant.direct, grant.holder
                if not self._make_room(candidate):
                    raise OSError(f"{candidate.owner} has {LANES_PER_PEER} lanes in use")
                if candidate.direct:
                    direct = sum(other.direct and other.owner == candidate.owner for other in self._lanes.values())
                    if direct >= DIRECT_LANES_PER_PEER:
                        raise OSError(f"{candidate.owner} has {DIRECT_LANES_PER_PEER} direct lanes open")
                    candidate.lock.acquire()  # its serving thread's, for as long as it lives
                lane = self._lanes[token] = candidate
            conn.sendall(READY)
            if lane.direct:
                threading.Thread(target=self._serve_direct, args=(lane,), name="lane-direct", daemon=True).start()
        except OSError:
            if lane is not None:
                with self._lock:
                    if self._lanes.get(lane.token) is lane:
                        del self._lanes[lane.token]
            conn.close()

    def _serve_direct(self, lane: LaneSocket) -> None:
        assert self.serve is not None
        try:
            self.serve(lane)
        finally:
            self.release(lane, False)

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
            raise WireError(Reason.BAD_LANE, "no open lane has this token")
        if (lane.job_id, lane.rank) != (job_id, rank):
            raise WireError(Reason.BAD_LANE, f"the lane belongs to rank {lane.rank} of another stream's sender or job")
        if not lane.lock.acquire(blocking=False):
            raise WireError(Reason.BAD_LANE, "the lane is in use by another stream")
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
         key: bytes | None = None) -> LaneSocket:
    """Open a lane with a granted token; with the grant's `key` the lane is sealed. Raises OSError."""
    sock = socket.create_connection((host, port), timeout=timeout)
    try:
        _tune(sock)
        sock.sendall(token)
        answer = sock.recv(1)
        if answer != READY:
            raise OSError("the peer refused the lane")
    except BaseException:
        sock.close()
        raise
    return LaneSocket(sock, job_id, rank, token, key=key, dialled=True)
