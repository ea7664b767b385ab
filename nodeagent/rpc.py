"""The gRPC edge of the node agent: what the I/O-free code's answers become in gRPC terms."""

from __future__ import annotations

import grpc

from nodeagent.wire.errors import Status


def grpc_code(status: Status) -> grpc.StatusCode:
    """The gRPC status code of the same name as `status`."""
    return grpc.StatusCode[status.name]
