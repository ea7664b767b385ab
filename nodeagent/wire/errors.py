"""Why a stream is refused: `WireError`, with a status hint that the gRPC edge turns into its code (nodeagent.rpc),
and its `Reason`, the one list of the reasons a receiver gives.

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


class Reason(enum.StrEnum):
    """Why a receiver refused or dropped a stream or message: the `reason` label of
    peertrain_stream_rejections_total, which docs/operations.md (Alerts) explains to operators. A value is a
    name users see on dashboards: rename one only with the docs and the alerts."""

    # The stream's frames and manifest.
    TRUNCATED = "truncated"
    EMPTY_FRAME = "empty_frame"
    BAD_FRAME = "bad_frame"
    BAD_LANE = "bad_lane"
    NO_MANIFEST = "no_manifest"
    SECOND_MANIFEST = "second_manifest"
    BAD_MANIFEST = "bad_manifest"
    MANIFEST_LIMIT = "manifest_limit"
    BAD_PAYLOAD = "bad_payload"
    BAD_END = "bad_end"
    AFTER_END = "after_end"
    TOO_LARGE = "too_large"
    TOO_LONG = "too_long"
    NON_FINITE = "non_finite"  # a NaN or an infinity, in any precision
    # Who sent it, to whom, for what.
    NOT_NEIGHBOR = "not_neighbor"
    WRONG_IDENTITY = "wrong_identity"
    WRONG_SENDER = "wrong_sender"
    WRONG_RECEIVER = "wrong_receiver"
    WRONG_JOB = "wrong_job"
    NOT_MEMBER = "not_member"
    NOT_SERVER = "not_server"
    NO_SERVER = "no_server"
    NOT_READY = "not_ready"
    UNEXPECTED_KIND = "unexpected_kind"
    FUTURE_CLOCK = "future_clock"  # a message of a round its algorithm cannot have reached yet
    FORMER_NEIGHBOR = "former_neighbor"  # a message on an edge the topology change dropped, after the switch
    HELD_OVERFLOW = "held_overflow"  # a message held for the switch, dropped for a newer one beyond the bound
    # The receiver's limits on streams held open, and its inbox.
    TOO_MANY_STREAMS = "too_many_streams"
    IDLE_TIMEOUT = "idle_timeout"
    TOO_SLOW = "too_slow"
    INBOX_FULL = "inbox_full"
    # A direct lane's call (nodeagent/wire/lane.py): its certificate was revoked since the lane opened, or the
    # node serves nothing of the kind asked.
    REVOKED = "revoked"
    NOT_SERVED = "not_served"


class WireError(Exception):
    """A stream that cannot be accepted. `reason` is its label for metrics; `status` how to answer it."""

    def __init__(self, reason: Reason, detail: str, status: Status = Status.INVALID_ARGUMENT):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
        self.status = status
