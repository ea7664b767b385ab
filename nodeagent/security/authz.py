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
        if handler.unary_unary:
            inner = handler.unary_unary

            def unary_unary(request, context):
                admit(method, context)
                return inner(request, context)

            return grpc.unary_unary_rpc_method_handler(unary_unary, handler.request_deserializer,
                                                       handler.response_serializer)
        if handler.unary_stream:
            inner = handler.unary_stream

            def unary_stream(request, context):
                admit(method, context)
                yield from inner(request, context)

            return grpc.unary_stream_rpc_method_handler(unary_stream, handler.request_deserializer,
                                                        handler.response_serializer)
        if handler.stream_unary:
            inner = handler.stream_unary

            def stream_unary(request_iterator, context):
                admit(method, context)
                return inner(request_iterator, context)

            return grpc.stream_unary_rpc_method_handler(stream_unary, handler.request_deserializer,
                                                        handler.response_serializer)
        inner = handler.stream_stream

        def stream_stream(request_iterator, context):
            admit(method, context)
            yield from inner(request_iterator, context)

        return grpc.stream_stream_rpc_method_handler(stream_stream, handler.request_deserializer,
                                                     handler.response_serializer)


def rules_for(service: str, roles_by_method: Mapping[str, frozenset[Role]]) -> Rules:
    """The full method names of `service` ("peertrain.v1.Peer") mapped to their roles."""
    return {f"/{service}/{method}": roles for method, roles in roles_by_method.items()}
