"""What an attacker of the tests holds: gRPC, the generated proto modules, and a directory of credentials (ca.crt,
tls.crt, tls.key) from some CA. Nothing else of the project is imported here."""

from __future__ import annotations

import os
from pathlib import Path

import grpc


def channel_as(address: str, credentials: Path | None, server_name: str, ca: Path | None = None,
               separate: bool = False) -> grpc.Channel:
    """A TLS channel to `address` that presents the certificate in `credentials` (None: no certificate), trusts the
    ca.crt of `ca` (default: of `credentials`), and expects the server to be `server_name`; `separate`: on a
    connection of its own (gRPC shares one between alike channels otherwise)."""
    trusted = ((ca or credentials) / "ca.crt").read_bytes()
    if credentials is None:
        channel_credentials = grpc.ssl_channel_credentials(trusted)
    else:
        channel_credentials = grpc.ssl_channel_credentials(
            trusted, (credentials / "tls.key").read_bytes(), (credentials / "tls.crt").read_bytes())
    options = [("grpc.ssl_target_name_override", server_name), ("grpc.use_local_subchannel_pool", int(separate))]
    return grpc.secure_channel(address, channel_credentials, options=options)


def listening_ports(pid: int) -> set[int]:
    """The TCP ports process `pid` listens on (Linux: its sockets in /proc), as a port scan of the host would find
    them."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    ports = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports
