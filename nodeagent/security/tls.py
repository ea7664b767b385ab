"""Mutual TLS for every gRPC link of a process: its credentials on disk, gRPC server and channel credentials, and
the identity of the caller of a gRPC call. (Tensor lanes are sealed with keys granted over these links:
nodeagent/wire/lane.py.)

A process's credentials are a directory holding `ca.crt` (the cluster CA), `tls.crt` and `tls.key` (its own
certificate and key): the layout of a Kubernetes TLS Secret, so that one mounts as it is. Servers read the
directory again when its files change, so that a rotated certificate serves new connections without a restart.
`--insecure` (Transport.insecure()) is plaintext with no identities, for local experiments only.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509

from nodeagent.rpc import bind_grpc_server
from nodeagent.security.pki import (
    COORDINATOR_DNS_NAME,
    CertificateError,
    Identity,
    identity_of,
    identity_of_pem,
    load_certificate,
    load_private_key,
    signed_by,
)

CA_FILE = "ca.crt"
CERT_FILE = "tls.crt"
KEY_FILE = "tls.key"
# A rotation of the credentials' files by another process is read within this. Every call of a neighbour asks for the
# credentials, and looking at three files cost 15 us a call (2% of an agent's samples in synchronous DSGD on logistic).
CREDENTIALS_RECHECK_S = 1.0
INSECURE_WARNING = ("INSECURE MODE: no TLS and no identities on any link; anyone who reaches a port can read and "
                    "change everything. For local experiments only.")


class TlsError(Exception):
    """Credentials that are missing or unusable; the message names the file and says what to do."""


@dataclass(frozen=True)
class Credentials:
    ca_pem: bytes
    cert_pem: bytes
    key_pem: bytes

    @property
    def certificate(self) -> x509.Certificate:
        return load_certificate(self.cert_pem)

    @property
    def identity(self) -> Identity:
        return identity_of(self.certificate)


@dataclass(frozen=True)
class TlsDir:
    """A credentials directory (ca.crt, tls.crt, tls.key)."""

    path: Path

    @property
    def ca(self) -> Path:
        return self.path / CA_FILE

    @property
    def cert(self) -> Path:
        return self.path / CERT_FILE

    @property
    def key(self) -> Path:
        return self.path / KEY_FILE

    def complete(self) -> bool:
        return all(p.is_file() for p in (self.ca, self.cert, self.key))

    def stamp(self) -> tuple[int, ...]:
        """Changes whenever a file is replaced: servers reload on it."""
        try:
            return tuple(p.stat().st_mtime_ns for p in (self.ca, self.cert, self.key))
        except OSError:
            return ()

    def load(self) -> Credentials:
        """The credentials, checked: the key matches the certificate, which carries a peertrain identity and is
        signed by the CA. Raises TlsError naming what is wrong."""
        try:
            credentials = Credentials(self.ca.read_bytes(), self.cert.read_bytes(), self.key.read_bytes())
        except OSError as error:
            raise TlsError(f"cannot read {error.filename}: {error.strerror}") from None
        try:
            cert = credentials.certificate
            ca = load_certificate(credentials.ca_pem)
            key = load_private_key(credentials.key_pem)
            identity_of(cert)
        except (CertificateError, ValueError) as error:
            raise TlsError(f"{self.path}: {error}") from None
        if key.public_key() != cert.public_key():
            previous = self.path / (KEY_FILE + ".old")
            if previous.is_file() and load_private_key(previous.read_bytes()).public_key() == cert.public_key():
                credentials = Credentials(credentials.ca_pem, credentials.cert_pem, previous.read_bytes())
            else:
                raise TlsError(f"{self.key} is not the key of {self.cert}")
        if not signed_by(cert, ca):
            raise TlsError(f"{self.cert} is not signed by the CA in {self.ca}")
        return credentials

    def save(self, credentials: Credentials) -> None:
        """Write all three files, each atomically, the key readable by its owner only. A crash between the key and
        the certificate leaves the old key in tls.key.old, which `load` then pairs with the old certificate."""
        self.path.mkdir(parents=True, exist_ok=True)
        previous = self.path / (KEY_FILE + ".old")
        if self.key.is_file():
            write_private_file(previous, self.key.read_bytes())
        write_private_file(self.ca, credentials.ca_pem, 0o644)
        write_private_file(self.key, credentials.key_pem)
        write_private_file(self.cert, credentials.cert_pem, 0o644)
        previous.unlink(missing_ok=True)


def write_private_file(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Replace `path` atomically with `data`, created with `mode` (never readable by others in between)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class Transport:
    """How one process serves and dials: mutual TLS with the credentials of a directory, or insecure."""

    def __init__(self, tls_dir: TlsDir | None, clock: Callable[[], float] = time.monotonic):
        self.tls_dir = tls_dir
        self._lock = threading.Lock()
        self._clock = clock
        self._stamp: tuple[int, ...] = ()
        self._looked_at: float | None = None  # when the files were last looked at (None: look at the next call)
        self._credentials: Credentials | None = None
        if tls_dir is not None:
            self.credentials()  # fails now, naming the file, rather than at the first handshake

    @classmethod
    def insecure(cls) -> Transport:
        return cls(None)

    @property
    def secure(self) -> bool:
        return self.tls_dir is not None

    def credentials(self) -> Credentials:
        """The current credentials, read again when the files changed (a rotation: looked for at most every
        CREDENTIALS_RECHECK_S, and at once after `save`)."""
        assert self.tls_dir is not None, "an insecure transport has no credentials"
        with self._lock:
            now = self._clock()
            if self._credentials is not None and self._looked_at is not None and \
                    now - self._looked_at < CREDENTIALS_RECHECK_S:
                return self._credentials
            self._looked_at = now
            stamp = self.tls_dir.stamp()
            if self._credentials is None or stamp != self._stamp:
                try:
                    self._credentials = self.tls_dir.load()
                except TlsError:
                    if self._credentials is None:
                        raise
                    # A rotation caught between its writes: keep the loaded pair; the next look reads again.
                    return self._credentials
                self._stamp = stamp
            return self._credentials

    def save(self, credentials: Credentials) -> None:
        """Replace the credentials' files (a renewal); the next `credentials` reads them."""
        assert self.tls_dir is not None, "an insecure transport has no credentials"
        self.tls_dir.save(credentials)
        with self._lock:
            self._looked_at = None

    @property
    def identity(self) -> Identity | None:
        return self.credentials().identity if self.secure else None

    # -- gRPC ------------------------------------------------------------------------------------------------

    def server_credentials(self) -> grpc.ServerCredentials:
        """Mutual TLS: a client without a certificate of the cluster CA fails the handshake. The credentials are
        fetched again for each new connection when their files changed."""
        served = [self.credentials()]

        def configuration(credentials: Credentials) -> grpc.ServerCertificateConfiguration:
            return grpc.ssl_server_certificate_configuration([(credentials.key_pem, credentials.cert_pem)],
                                                             root_certificates=credentials.ca_pem)

        def fetch() -> grpc.ServerCertificateConfiguration | None:  # None: no change
            current = self.credentials()
            if current is served[0]:
                return None
            served[0] = current
            return configuration(current)

        initial = configuration(served[0])
        return grpc.dynamic_ssl_server_credentials(initial, fetch, require_client_authentication=True)

    def bind(self, server: grpc.Server, address: str) -> int:
        """Add `address` (HOST:PORT) to `server`, with TLS unless insecure; returns the bound port. Raises
        ListenError naming the address when it cannot be had."""
        return bind_grpc_server(server, address, self.server_credentials() if self.secure else None)

    def channel(self, address: str, server_name: str = COORDINATOR_DNS_NAME,
                options: Sequence[tuple[str, object]] = ()) -> grpc.Channel:
        """A channel to `address` whose server must prove to be `server_name`: a node id, or by default the
        coordinator (the DNS name only coordinator certificates carry)."""
        if not self.secure:
            return grpc.insecure_channel(address, options=list(options))
        current = self.credentials()
        credentials = grpc.ssl_channel_credentials(current.ca_pem, current.key_pem, current.cert_pem)
        return grpc.secure_channel(address, credentials,
                                   options=[*options, ("grpc.ssl_target_name_override", server_name)])


def caller(context: grpc.ServicerContext) -> Identity | None:
    """The identity in the certificate the caller presented (None on an insecure server, or without one)."""
    pems = context.auth_context().get("x509_pem_cert")
    if not pems:
        return None
    try:
        return identity_of_pem(pems[0])
    except CertificateError:
        return None
