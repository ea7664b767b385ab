"""Listening sockets of the daemons (peer gRPC, coordinator gRPC, tensor lanes, /metrics): never shared with another
process, and a port that cannot be had is an error naming the address. No gRPC here: the wire package uses it."""

from __future__ import annotations

import errno
import socket


class ListenError(Exception):
    """An address this process cannot listen on; the message names it and says why."""

    def __init__(self, address: str, reason: str):
        super().__init__(f"cannot listen on {address}: {reason}")
        self.address = address

    @classmethod
    def from_os_error(cls, host: str, port: int, error: OSError) -> ListenError:
        reason = "address in use" if error.errno == errno.EADDRINUSE else (error.strerror or str(error)).lower()
        return cls(join_address(host, port), reason)


def join_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def listen_socket(host: str, port: int, backlog: int) -> socket.socket:
    """A TCP socket listening on host:port (port 0: any free one). SO_REUSEADDR only, as servers set it: a port that
    another socket listens on is refused, one left in TIME_WAIT is not."""
    try:
        return socket.create_server((host, port), family=_family(host), backlog=backlog, reuse_port=False)
    except OSError as error:
        raise ListenError.from_os_error(host, port, error) from None


def check_port_free(host: str, port: int) -> None:
    """Raise ListenError if host:port cannot be bound now, for servers (gRPC) that say only that binding failed."""
    if port == 0:
        return
    try:
        with socket.socket(_family(host), socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
    except OSError as error:
        raise ListenError.from_os_error(host, port, error) from None
