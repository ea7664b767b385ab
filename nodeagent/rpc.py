"""The gRPC edge, shared by the agent, the coordinator and the command line: channel and server options, addresses,
what a node may be called, and what the I/O-free code's answers become in gRPC terms (and back). Light to import:
no torch."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import grpc

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
MAX_FIELD_CHARS = 64  # a node's name, device and version
MAX_ADDRESS_CHARS = 255


def node_id_problem(node_id: str) -> str | None:
    """What is wrong with a node id (None: nothing)."""
    if NODE_ID_PATTERN.fullmatch(node_id):
        return None
    return "must be 1 to 64 characters of A-Z a-z 0-9 _ . -"


def name_problem(name: str) -> str | None:
    """What is wrong with a node's human name (None: nothing); it is shown in tables, hence printable."""
    if len(name) <= MAX_FIELD_CHARS and name.isprintable():
        return None
    return f"must be at most {MAX_FIELD_CHARS} printable characters"


def address_problem(address: str) -> str | None:
    """What is wrong with an address a node advertises (None: nothing): HOST:PORT, PORT in 1..65535."""
    host, sep, port = address.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if (len(address) <= MAX_ADDRESS_CHARS and sep and host and host.isprintable() and " " not in host
            and port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        return None
    return f"must be HOST:PORT, at most {MAX_ADDRESS_CHARS} characters"


def bind_grpc_server(server: grpc.Server, address: str) -> int:
    """Add `address` (HOST:PORT) to a server made with SERVER_OPTIONS; returns the bound port. Raises ListenError
    naming the address when it cannot be had."""
    host, port = split_address(address)
    # gRPC reports only that the bind failed (and logs its own line); a probe first says why, in one line.
    check_port_free(host, port)
    try:
        return server.add_insecure_port(join_address(host, port))
    except RuntimeError:  # gRPC's "Failed to bind to address": a host it cannot resolve, a race for the port
        raise ListenError(address, "cannot bind") from None


def failure_reason(error: grpc.RpcError) -> str:
    code = error.code() if hasattr(error, "code") else None
    return code.name.lower() if code is not None else "error"

