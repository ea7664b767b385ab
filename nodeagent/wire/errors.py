"""Why a stream is refused: `WireError`, with a status hint that the gRPC edge turns into its code (nodeagent.rpc).

No gRPC or protobuf here, so that the I/O-free algorithms can raise it without pulling either in.
"""

from __future__ import annotations

import enum


class Status(enum.Enum):
    """How a refusal is answered; nodeagent.rpc maps each member to the gRPC status code of the same name."""

    INVALID_ARGUMENT = enum.auto()
    FAILED_PRECONDITION = enum.auto()
    PERMISSION_DENIED = enum.auto()
    UNAUTHENTICATED = enum.auto()
    RESOURCE_EXHAUSTED = enum.auto()


class WireError(Exception):
    """A stream that cannot be accepted. `reason` is a short label for metrics; `status` how to answer it."""

    def __init__(self, reason: str, detail: str, status: Status = Status.INVALID_ARGUMENT):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
        self.status = status
