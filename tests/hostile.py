"""What an attacker of the tests holds: gRPC, the generated proto modules, and a directory of credentials (ca.crt,
tls.crt, tls.key) from some CA. Nothing else of the project is imported here."""

from __future__ import annotations

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
