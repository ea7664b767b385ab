"""Who may call what: a server interceptor that admits a call only from a certificate of an allowed role that is
not revoked. What a call may do as that identity (a node acts only as itself, a peer only on its own edge) is the
handler's to check, with `caller`: the rule needs the request.

Both daemons use it, each with its own table of methods; a method missing from the table is refused to everyone.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import grpc

from nodeagent.security.pki import Identity, Role
from nodeagent.security.tls import caller

Rules = Mapping[str, frozenset[Role]]  # full method name ("/peertrain.v1.Peer/Exchange") -> the roles it admits


class Authorizer(grpc.ServerInterceptor):
    def __init__(self, rules: Rules, revoked: Callable[[Identity], bool]):
        self.rules = rules
        self.revoked = revoked

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

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        admit = self.admit
        kind = next(k for k in ("unary_unary", "unary_stream", "stream_unary", "stream_stream") if getattr(handler, k))
        behavior = getattr(handler, kind)

        # A streaming response is a generator: the check runs when gRPC starts it, before the first message.
        def admitted_stream(request, context):
            admit(method, context)
            yield from behavior(request, context)

        def admitted(request, context):
            admit(method, context)
            return behavior(request, context)

        return handler._replace(**{kind: admitted_stream if handler.response_streaming else admitted})


def rules_for(service: str, roles_by_method: Mapping[str, frozenset[Role]]) -> Rules:
    """The full method names of `service` ("peertrain.v1.Peer") mapped to their roles."""
    return {f"/{service}/{method}": roles for method, roles in roles_by_method.items()}
