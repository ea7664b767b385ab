"""The gRPC edge, shared by the agent, the coordinator and the command line: channel and server options, addresses,
what a node may be called, the back-off of retried calls, and what the I/O-free code's answers become in gRPC terms
(and back). Light to import: no torch."""

from __future__ import annotations

import logging
import re
import time
import unicodedata
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any

import grpc

from nodeagent.defaults import COORDINATOR_PORT, ENROLL_PORT
from nodeagent.listen import ListenError, check_port_free, join_address

if TYPE_CHECKING:  # importing the wire package would load torch, which the command line need not
    from nodeagent.wire.errors import Status


def grpc_code(status: Status) -> grpc.StatusCode:
    """The gRPC status code of the same name as `status`."""
    return grpc.StatusCode[status.name]


# gRPC's per-frame limit must hold the largest chunk a job may configure (jobspec.WireSpec.chunk_bytes) plus the
# frame's own overhead; the size of a whole stream is limited by the decoder (max_message_bytes).
MAX_FRAME_BYTES = (64 << 20) + (1 << 16)
GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_FRAME_BYTES),
    ("grpc.max_send_message_length", MAX_FRAME_BYTES),
]
# gRPC servers set SO_REUSEPORT by default: a second daemon on the same port would bind without an error, and the
# kernel would share the connections between the two processes.
SERVER_OPTIONS = [*GRPC_OPTIONS, ("grpc.so_reuseport", 0)]


def split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"address {address!r} must be HOST:PORT")
    return host.strip("[]") or "0.0.0.0", int(port)


NODE_ID_PATTERN = re.compile(r"[A-Za-z0-9_.-]{1,64}")
MAX_FIELD_CHARS = 64  # a node's name, device, device name and version
MAX_DEVICE_MEMORY_BYTES = 2**50  # what a node may say its device has (1 PiB): kept well inside SQLite's INTEGER
MAX_ADDRESS_CHARS = 255


def node_id_problem(node_id: str) -> str | None:
    """What is wrong with a node id (None: nothing)."""
    if NODE_ID_PATTERN.fullmatch(node_id):
        return None
    return "must be 1 to 64 characters of A-Z a-z 0-9 _ . -"


def field_problem(value: str) -> str | None:
    """What is wrong with a short field a node describes itself with (None: nothing): its name, device and version
    are shown in tables, hence printable and short."""
    if len(value) <= MAX_FIELD_CHARS and value.isprintable():
        return None
    return f"must be at most {MAX_FIELD_CHARS} printable characters"


def name_key(name: str) -> str:
    """What two names that look alike have in common: compatibility forms folded (NFKC), case folded, dots and
    spaces at the ends dropped. No two live nodes share one (Register)."""
    return unicodedata.normalize("NFKC", name).casefold().strip(" .")


# A terminal escape sequence (ECMA-48): a control sequence (CSI ... final byte); a string (OSC, DCS, SOS, PM, APC) up
# to its terminator, or to the end when it has none; or an escape with its intermediate and final bytes.
_TERMINAL_ESCAPE = re.compile(
    r"(?:\x1b\[|\x9b)[0-?]*[ -/]*[@-~]"
    r"|(?:\x1b[\]PX^_]|[\x90\x98\x9d\x9e\x9f]).*?(?:\x07|\x1b\\|\x9c|$)"
    r"|\x1b[ -/]*[0-~]?",
    re.DOTALL,
)


def plain_text(text: str) -> str:
    """Another process's words as the coordinator keeps them: terminal escape sequences dropped whole, line breaks
    and tabs made spaces, and every other character that is not printable (controls, Unicode format characters
    such as direction overrides) dropped. Nothing stored from a node can then move a terminal that shows it."""
    text = _TERMINAL_ESCAPE.sub("", text)
    return "".join(c if c.isprintable() else " " if c in "\t\n\r" else "" for c in text)


def shown(text: str) -> str:
    """Text from the coordinator as the command line prints it: line breaks kept, every other character that is
    not printable written as its escape (\\x1b, \\u202e), whatever the coordinator sent."""
    return "".join(c if c.isprintable() or c == "\n" else repr(c)[1:-1] for c in text)


def address_problem(address: str) -> str | None:
    """What is wrong with an address a node advertises (None: nothing): HOST:PORT, PORT in 1..65535."""
    host, sep, port = address.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if (len(address) <= MAX_ADDRESS_CHARS and sep and host and host.isprintable() and " " not in host
            and port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        return None
    return f"must be HOST:PORT, at most {MAX_ADDRESS_CHARS} characters"


def add_servicer(add_generated: Callable[[Any, Any], None], servicer: object, server: grpc.Server,
                 raw_requests: Collection[str]) -> None:
    """Register `servicer` as the generated `add_generated(servicer, server)` does, except that the requests of the
    methods named in `raw_requests` reach it as serialized bytes: handlers that parse them within their own limits
    (the tensor streams' frames: nodeagent.wire.frames) then never get a message protobuf parsed at any size up to
    MAX_FRAME_BYTES, which costs several times that size before any check runs."""
    registration = _Registration()
    add_generated(servicer, registration)
    unknown = set(raw_requests) - registration.handlers.keys()
    if unknown:
        raise ValueError(f"{registration.service} has no methods {sorted(unknown)}")
    handlers = {
        name: handler._replace(request_deserializer=None) if name in raw_requests else handler
        for name, handler in registration.handlers.items()
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(registration.service, handlers),))
    server.add_registered_method_handlers(registration.service, handlers)


class _Registration:
    """Stands in for a server to receive what generated code registers: the service's name and method handlers."""

    def __init__(self) -> None:
        self.service = ""
        self.handlers: dict[str, Any] = {}

    def add_generic_rpc_handlers(self, generic_handlers: object) -> None:
        """The same methods as the registered ones, which add_servicer registers again in both ways."""

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        self.service, self.handlers = service, handlers


def bind_grpc_server(server: grpc.Server, address: str, credentials: grpc.ServerCredentials | None = None) -> int:
    """Add `address` (HOST:PORT) to a server made with SERVER_OPTIONS, with TLS when `credentials` are given;
    returns the bound port. Raises ListenError naming the address when it cannot be had."""
    host, port = split_address(address)
    # gRPC reports only that the bind failed (and logs its own line); a probe first says why, in one line.
    check_port_free(host, port)
    target = join_address(host, port)
    try:
        if credentials is not None:
            return server.add_secure_port(target, credentials)
        return server.add_insecure_port(target)
    except RuntimeError:  # gRPC's "Failed to bind to address": a host it cannot resolve, a race for the port
        raise ListenError(address, "cannot bind") from None


def with_default_port(address: str, port: int) -> str:
    """`address` with `port` added when it names none (gRPC would dial 443): `host`, `[v6]` or a bare IPv6 address
    get it; `host:port`, `[v6]:port` and gRPC target URIs (`dns:///...`, `unix:...`) are kept."""
    address = address.strip()
    if not address or "/" in address or address.startswith("unix:"):
        return address
    if address.startswith("["):
        return address if "]:" in address else f"{address}:{port}"
    if address.count(":") > 1:  # a bare IPv6 address
        return f"[{address}]:{port}"
    return address if ":" in address else f"{address}:{port}"


_NOT_THE_COORDINATOR = (f"its certificate is not the coordinator's: the enrollment port (default {ENROLL_PORT}) "
                        f"rather than the coordinator's (default {COORDINATOR_PORT}), or not the coordinator at all")
# What a failed call's gRPC text says when the server was not reached, or not as the caller expected, and what it
# most likely means; the first that matches the details is told.
_UNREACHABLE = (
    ("Connection refused", "nothing listens there (connection refused): is it running, and is that its port?"),
    ("errors resolving", "its host name does not resolve (DNS): check the host name"),
    ("Domain name not found", "its host name does not resolve (DNS): check the host name"),
    ("CERTIFICATE_VERIFY_FAILED", "its certificate is not signed by the CA in this side's ca.crt: a server of "
     "another cluster, or credentials of another cluster"),
    ("WRONG_VERSION_NUMBER", "it answers in plaintext, not TLS: a coordinator serving with --insecure (then give "
     "--insecure), or not a peertrain port"),
    ("Hostname Verification Check failed", _NOT_THE_COORDINATOR),
    ("No match found for server name", _NOT_THE_COORDINATOR),
    ("certificate required", "it asks for a client certificate: it serves TLS; give the credentials (--tls-dir), "
     "not --insecure"),
    ("alert", "it refused this side's certificate in the TLS handshake (revoked, expired, or of another cluster)"),
    ("Method not found", "it does not serve this call: not the coordinator's port (the enrollment port is "
     f"{ENROLL_PORT} by default, the coordinator's {COORDINATOR_PORT}), or a coordinator of another version"),
    ("Socket closed", "it closed the connection: a TLS server reached in plaintext (drop --insecure and give the "
     "credentials), or not a gRPC port"),
    ("Connection reset", "it closed the connection: a TLS server reached in plaintext (drop --insecure and give the "
     "credentials), or not a gRPC port"),
)


def unreachable_cause(error: grpc.RpcError) -> str | None:
    """What a failed call's error says about reaching its server, as a person reads it (no gRPC text): its likely
    cause; None when the server answered the call itself (its own status and words are the answer)."""
    code = error.code() if hasattr(error, "code") else None
    details = (error.details() if hasattr(error, "details") else "") or ""
    if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.DEADLINE_EXCEEDED,
                    grpc.StatusCode.UNKNOWN):
        return None
    for marker, cause in _UNREACHABLE:
        if marker in details:
            return cause
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        return "no answer in time (deadline exceeded): the network or the server is slow or blocked"
    if code is grpc.StatusCode.UNAVAILABLE:
        return "it cannot be reached now (unavailable): is it running, and does the network let this side through?"
    return None


def failure_reason(error: grpc.RpcError) -> str:
    code = error.code() if hasattr(error, "code") else None
    return code.name.lower() if code is not None else "error"


class Backoff:
    """The waits between the tries of a call that keeps failing, and what to log about them: 1 s, doubling up to
    30 s; the first failure is logged, then a summary at most once a minute (not a line per try), and the recovery.
    The caller waits; `clock` is injectable for tests."""

    def __init__(
        self, what: str, log: logging.Logger, *, first_s: float = 1.0, max_s: float = 30.0,
        summary_every_s: float = 60.0, clock: Callable[[], float] = time.monotonic,
    ):
        self.what = what  # the call, as the log lines name it: "registration with coordinator HOST:PORT"
        self.log = log
        self.first_s = first_s
        self.max_s = max_s
        self.summary_every_s = summary_every_s
        self.clock = clock
        self.failures = 0
        self._next_delay_s = first_s
        self._failing_since = 0.0
        self._logged_at = 0.0

    def failed(self, reason: str) -> float:
        """Count a failed try; returns how long to wait before the next one."""
        now = self.clock()
        self.failures += 1
        if self.failures == 1:
            self._failing_since = self._logged_at = now
            self._next_delay_s = self.first_s
            self.log.warning("%s failed (%s); retrying with back-off", self.what, reason)
        elif now - self._logged_at >= self.summary_every_s:
            self._logged_at = now
            self.log.warning("%s still failing after %d tries over %.0f s (%s)", self.what, self.failures,
                             now - self._failing_since, reason)
        delay = self._next_delay_s
        self._next_delay_s = min(delay * 2, self.max_s)
        return delay

    def succeeded(self) -> None:
        """Count a successful try: the next failure starts over at the first wait."""
        if self.failures:
            self.log.info("%s succeeded again after %d failed tries over %.0f s", self.what, self.failures,
                             self.clock() - self._failing_since)
            self.failures = 0
