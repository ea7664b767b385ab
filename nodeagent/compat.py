"""Which peertrain versions work together (docs/operations.md, "Upgrades").

Versions are MAJOR.MINOR.PATCH. An agent or a command line works with a coordinator of the same major version
whose minor version is its own or one above: the coordinator is upgraded first, then the agents one by one and the
operators' command lines, and a cluster runs mixed meanwhile. An agent or command line newer than the coordinator,
more than one minor version behind it, or of another major version is refused with FAILED_PRECONDITION and a
message naming both versions. Patch releases always interoperate. A caller that does not say its version (a tool
built on the protocol, or an agent or command line from before this check) is served.

Agents say their version in RegisterRequest.version; every call of an agent or of the command line also carries
it in the metadata VERSION_METADATA, which the coordinator checks on each call (VersionCheck).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import grpc

from nodeagent import __version__

VERSION_METADATA = "peertrain-version"
MAX_VERSION_CHARS = 64
_VERSION = re.compile(r"(\d+)\.(\d+)(?:\.(\d+))?(?:[-+.a-zA-Z0-9]*)")


def parse_version(text: str) -> tuple[int, int] | None:
    """(major, minor) of a version; None if it is none."""
    match = _VERSION.fullmatch(text)
    return (int(match.group(1)), int(match.group(2))) if match else None


def skew_problem(caller: str, caller_version: str, coordinator_version: str = __version__) -> str | None:
    """Why `caller` ("agent node-1", "the command line") of `caller_version` cannot work with this coordinator;
    None when it can (or did not say its version)."""
    if not caller_version:
        return None
    shown = caller_version[:MAX_VERSION_CHARS]
    theirs, ours = parse_version(shown), parse_version(coordinator_version)
    assert ours is not None, f"peertrain's own version {coordinator_version!r} is no MAJOR.MINOR.PATCH"
    prefix = f"{caller} runs peertrain {shown!r} and the coordinator {coordinator_version}"
    if theirs is None:
        return f"{prefix}: {shown!r} is no MAJOR.MINOR.PATCH version"
    if theirs[0] != ours[0]:
        return f"{prefix}: different major versions do not work together; install peertrain {ours[0]}.x on it"
    if theirs[1] > ours[1]:
        return f"{prefix}: it is newer than the coordinator; upgrade the coordinator first (docs/operations.md, " \
            "\"Upgrades\")"
    if theirs[1] < ours[1] - 1:
        return f"{prefix}: it is more than one minor version behind; upgrade it to {ours[0]}.{ours[1]}"
    return None


class VersionCheck(grpc.ServerInterceptor):
    """The coordinator's check of every call's VERSION_METADATA: a caller of a version that cannot work with it is
    refused with FAILED_PRECONDITION before the method runs."""

    def __init__(self, version: str = __version__):
        self.version = version

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        claimed = next((value for key, value in handler_call_details.invocation_metadata or ()
                        if key == VERSION_METADATA), "")
        problem = skew_problem("the caller", claimed if isinstance(claimed, str) else "?", self.version)
        if handler is None or problem is None:
            return handler
        kind = next(k for k in ("unary_unary", "unary_stream", "stream_unary", "stream_stream") if getattr(handler, k))

        def refused(request, context):
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, problem)

        def refused_stream(request, context) -> Iterator[object]:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, problem)
            yield from ()

        return handler._replace(**{kind: refused_stream if handler.response_streaming else refused})


class _Versioned(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                 grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds VERSION_METADATA to every call of a channel."""

    def __init__(self, version: str):
        self.header = (VERSION_METADATA, version)

    def _with_version(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        return _CallDetails(details.method, details.timeout, [*(details.metadata or ()), self.header],
                            details.credentials, getattr(details, "wait_for_ready", None),
                            getattr(details, "compression", None))

    def _call(self, continuation: Callable, details: grpc.ClientCallDetails, request: object) -> object:
        return continuation(self._with_version(details), request)

    intercept_unary_unary = intercept_unary_stream = _call
    intercept_stream_unary = intercept_stream_stream = _call


class _CallDetails(grpc.ClientCallDetails):
    def __init__(self, method, timeout, metadata, credentials, wait_for_ready, compression):
        self.method, self.timeout, self.metadata = method, timeout, metadata
        self.credentials, self.wait_for_ready, self.compression = credentials, wait_for_ready, compression


def versioned(channel: grpc.Channel, version: str = __version__) -> grpc.Channel:
    """`channel`, its calls saying which peertrain version makes them."""
    return grpc.intercept_channel(channel, _Versioned(version))
