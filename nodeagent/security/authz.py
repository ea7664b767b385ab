"""Who may call what: a server interceptor that admits a call only from a certificate of an allowed role that is
not revoked, and, when given a limit, only while that identity has fewer calls outstanding. What a call may do as
that identity (a node acts only as itself, a peer only on its own edge) is the handler's to check, with `caller`:
the rule needs the request.

Both daemons use it, each with its own table of methods; a method missing from the table is refused to everyone.
The coordinator limits the calls each identity holds at once, of every kind together (server threads are shared by
all): one node's flood of calls that wait (a Register whose address is probed, long polls) is refused beyond the
limit with RESOURCE_EXHAUSTED, at once, and the other nodes' calls find threads.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

import grpc

from nodeagent.security.pki import Identity, Role
from nodeagent.security.tls import caller

Rules = Mapping[str, frozenset[Role]]  # full method name ("/peertrain.v1.Peer/Exchange") -> the roles it admits


class Authorizer(grpc.ServerInterceptor):
    def __init__(self, rules: Rules, revoked: Callable[[Identity], bool], max_calls_per_identity: int | None = None):
        self.rules = rules
        self.revoked = revoked
        self.max_calls_per_identity = max_calls_per_identity
        self._outstanding: dict[tuple[Role, str], int] = {}  # calls running now, by identity
        self._outstanding_lock = threading.Lock()

    def admit(self, method: str, context: grpc.ServicerContext) -> Identity:
        """The caller, or the call is aborted: UNAUTHENTICATED without a usable or with a revoked certificate,
        PERMISSION_DENIED for a role the method does not admit."""
        identity = caller(context)
        if identity is None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "no peertrain certificate")
        if self.revoked(identity):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, f"certificate {identity.serial} is revoked")
        roles = self.rules.get(method, frozenset())
        if identity.role not in roles:
            needed = " or ".join(sorted(roles)) or "no"
            article = "an" if needed[0] in "aeiou" else "a"
            context.abort(grpc.StatusCode.PERMISSION_DENIED, f"{method.rsplit('/', 1)[-1]} needs {article} {needed} "
                          f"certificate; the caller is {identity}")
        return identity

    @contextmanager
    def _outstanding_call(self, identity: Identity, context: grpc.ServicerContext) -> Iterator[None]:
        """The call counted against its identity's limit while it runs; RESOURCE_EXHAUSTED beyond the limit."""
        if self.max_calls_per_identity is None:
            yield
            return
        key = (identity.role, identity.name)
        with self._outstanding_lock:
            held = self._outstanding.get(key, 0)
            if held < self.max_calls_per_identity:
                self._outstanding[key] = held + 1
        if held >= self.max_calls_per_identity:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{identity} has {held} calls outstanding, the most "
                          "one identity may hold at once")
        try:
            yield
        finally:
            with self._outstanding_lock:
                self._outstanding[key] -= 1
                if not self._outstanding[key]:
                    del self._outstanding[key]

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        admit, outstanding = self.admit, self._outstanding_call
        kind = next(k for k in ("unary_unary", "unary_stream", "stream_unary", "stream_stream") if getattr(handler, k))
        behavior = getattr(handler, kind)

        # A streaming response is a generator: the check runs when gRPC starts it, before the first message, and
        # the call counts until the stream ends.
        def admitted_stream(request, context):
            with outstanding(admit(method, context), context):
                yield from behavior(request, context)

        def admitted(request, context):
            with outstanding(admit(method, context), context):
                return behavior(request, context)

        return handler._replace(**{kind: admitted_stream if handler.response_streaming else admitted})


def rules_for(service: str, roles_by_method: Mapping[str, frozenset[Role]]) -> Rules:
    """The full method names of `service` ("peertrain.v1.Peer") mapped to their roles."""
    return {f"/{service}/{method}": roles for method, roles in roles_by_method.items()}
