"""A node's certificate: enrollment with a join token, and renewal before expiry.

Enrollment never trusts the network before it has checked the pinned fingerprint: the agent fetches the certificate
the enrollment port presents (the cluster CA's own), compares its SHA-256 with `--ca-fingerprint`, and only then
makes a TLS channel that trusts it, to send the token and its signing request. The key never leaves the node.
"""

from __future__ import annotations

import hashlib
import logging
import socket
import ssl
import time

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from nodeagent._proto import coordinator_pb2, coordinator_pb2_grpc
from nodeagent.rpc import split_address
from nodeagent.security.pki import (
    COORDINATOR_NAME,
    CertificateError,
    Role,
    certificate_pem,
    identity_of,
    load_certificate,
    new_private_key,
    private_key_pem,
    renewal_due,
    signed_by,
    signing_request,
)
from nodeagent.security.tls import Credentials, TlsDir, Transport

log = logging.getLogger("nodeagent")

ENROLL_TIMEOUT_S = 15.0


class EnrollmentError(Exception):
    """Enrollment failed in a way retrying will not change; the message says why and what to do."""


def normalize_fingerprint(text: str) -> str:
    """A SHA-256 fingerprint as 64 lowercase hex digits: accepts "sha256:", colons and upper case."""
    digits = text.strip().lower().removeprefix("sha256:").replace(":", "")
    if len(digits) != 64 or any(c not in "0123456789abcdef" for c in digits):
        raise EnrollmentError("--ca-fingerprint must be a SHA-256 (64 hex digits), as `coordinator token create` or "
                              "`coordinator ca show` print it")
    return digits


def fetch_pinned_ca(address: str, fingerprint: str, timeout: float = ENROLL_TIMEOUT_S) -> bytes:
    """The PEM CA certificate the enrollment port at `address` presents, if its SHA-256 is `fingerprint`."""
    host, port = split_address(address)
    unverified = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    unverified.check_hostname = False
    unverified.verify_mode = ssl.CERT_NONE  # verified below, against the pinned fingerprint
    with socket.create_connection((host, port), timeout=timeout) as raw, \
            unverified.wrap_socket(raw, server_hostname=COORDINATOR_NAME) as tls:
        der = tls.getpeercert(binary_form=True)
    if der is None or hashlib.sha256(der).hexdigest() != fingerprint:
        raise EnrollmentError(
            f"the certificate at {address} does not have the CA fingerprint given: a wrong --ca-fingerprint or "
            "--enroll-address, or someone between this node and the coordinator"
        )
    return x509.load_der_x509_certificate(der).public_bytes(serialization.Encoding.PEM)


def enroll(address: str, token: str, fingerprint: str, name: str, tls_dir: TlsDir) -> str:
    """Enroll this node as `name` and write its credentials into `tls_dir`; returns its node id. Raises
    EnrollmentError for a refusal, OSError or grpc.RpcError when the coordinator cannot be reached."""
    ca_pem = fetch_pinned_ca(address, normalize_fingerprint(fingerprint))
    key = new_private_key()
    channel = grpc.secure_channel(address, grpc.ssl_channel_credentials(ca_pem),
                                  options=[("grpc.ssl_target_name_override", COORDINATOR_NAME)])
    with channel:
        try:
            reply = coordinator_pb2_grpc.EnrollmentStub(channel).Enroll(
                coordinator_pb2.EnrollRequest(token=token, csr_pem=signing_request(key, Role.NODE, name)),
                timeout=ENROLL_TIMEOUT_S,
            )
        except grpc.RpcError as error:
            if error.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.INVALID_ARGUMENT,
                                grpc.StatusCode.ALREADY_EXISTS):
                raise EnrollmentError(f"the coordinator refused the enrollment: {error.details()}") from None
            raise
    cert = _checked(reply.certificate_pem, ca_pem, key)
    tls_dir.save(Credentials(ca_pem, certificate_pem(cert), private_key_pem(key)))
    log.info("enrolled as node %s; credentials in %s", reply.name, tls_dir.path)
    return identity_of(cert).name


def _checked(cert_pem: bytes, ca_pem: bytes, key) -> x509.Certificate:
    try:
        cert = load_certificate(cert_pem)
        identity = identity_of(cert)
    except CertificateError as error:
        raise EnrollmentError(f"the coordinator sent an unusable certificate: {error}") from None
    if not signed_by(cert, load_certificate(ca_pem)) or cert.public_key() != key.public_key():
        raise EnrollmentError("the coordinator sent a certificate that is not for this node's key or not from its CA")
    if identity.role is not Role.NODE:
        raise EnrollmentError(f"the coordinator sent a {identity.role} certificate, not a node certificate")
    return cert


def needs_renewal(transport: Transport) -> bool:
    return renewal_due(transport.credentials().identity, time.time())


def renew(transport: Transport, stub: coordinator_pb2_grpc.CoordinatorStub) -> str:
    """A new key and certificate for this node's identity, written over the old ones; returns the new serial. The
    new certificate supersedes the old one, which the coordinator revokes: the caller makes its links again (new
    connections present the new certificate)."""
    assert transport.tls_dir is not None
    current = transport.credentials()
    key = new_private_key()
    reply = stub.RenewCertificate(
        coordinator_pb2.RenewCertificateRequest(csr_pem=signing_request(key, Role.NODE, current.identity.name)),
        timeout=ENROLL_TIMEOUT_S,
    )
    cert = _checked(reply.certificate_pem, current.ca_pem, key)
    transport.save(Credentials(current.ca_pem, certificate_pem(cert), private_key_pem(key)))
    return identity_of(cert).serial
