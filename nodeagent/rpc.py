"""The gRPC edge, shared by the agent, the coordinator and the command line: channel and server options, addresses,
and what the I/O-free code's answers become in gRPC terms (and back). Light to import: no torch."""

from __future__ import annotations

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

