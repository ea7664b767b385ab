"""The gRPC edge, shared by the agent, the coordinator and the command line: channel options, addresses, and what
the I/O-free code's answers become in gRPC terms (and back). Light to import: no torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

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


def split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"address {address!r} must be HOST:PORT")
    return host.strip("[]") or "0.0.0.0", int(port)


def failure_reason(error: grpc.RpcError) -> str:
    code = error.code() if hasattr(error, "code") else None
    return code.name.lower() if code is not None else "error"
