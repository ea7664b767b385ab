"""The standard gRPC health service (grpc.health.v1.Health) of a daemon, on a plaintext port of its own.

Kubernetes' native gRPC probes (and grpc_health_probe) speak plaintext only: they cannot present a client
certificate, so the mutual-TLS ports, which refuse any caller without a peertrain certificate, cannot answer them.
This port serves nothing but Health, whose answer is one word (SERVING or NOT_SERVING) and reveals nothing else.
"""

from __future__ import annotations

from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from nodeagent.rpc import bind_grpc_server

# Probes are short unary calls; a few Watch streams at most. Beyond, a call is refused rather than queued.
HEALTH_SERVER_THREADS = 2
HEALTH_MAX_CALLS = 8


class HealthServer:
    """Health on `address` (HOST:PORT; port 0 picks one): NOT_SERVING from the start until `ready()`, and again
    once `stop()` begins. The empty service name "" is the daemon as a whole, which is what a probe asks about."""

    def __init__(self, address: str):
        self._servicer = health.HealthServicer()
        self._servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=HEALTH_SERVER_THREADS,
                                                              thread_name_prefix="health"),
                                   maximum_concurrent_rpcs=HEALTH_MAX_CALLS)
        health_pb2_grpc.add_HealthServicer_to_server(self._servicer, self._server)
        self.port = bind_grpc_server(self._server, address)
        self._server.start()

    def ready(self) -> None:
        self._servicer.set("", health_pb2.HealthCheckResponse.SERVING)

    def stop(self) -> None:
        self._servicer.enter_graceful_shutdown()  # NOT_SERVING to every caller from now on
        self._server.stop(grace=0)
