"""Certificates of a peertrain cluster, with the `cryptography` package: the cluster CA, keys, signing requests,
issuance, and the identity a certificate carries.

An identity is a role and a name, written in the certificate as a URI subject alternative name
`spiffe://peertrain/ROLE/NAME` (the SPIFFE form, so that the role cannot be confused with a host name). Node and
coordinator certificates also carry a DNS name that TLS clients verify (gRPC's Python client checks DNS names, not
URIs): a node's its id; the coordinator's `coordinator.peertrain`, a name under the trust domain, which the CA gives
to no other role. Agents and the command line verify that name, so a server they accept as the coordinator holds a
coordinator certificate, whatever a node may be called.

Names are one form only, so that no two look alike: lower-case DNS labels of a-z 0-9 and inner hyphens, joined by
single dots, with no trailing dot (TLS name checks ignore case and a trailing dot; ASCII leaves no Unicode
look-alike). The coordinator's name and the trust domain's names are reserved. Keys are ECDSA P-256: small
certificates and cheap handshakes.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import re
from dataclasses import dataclass
from enum import StrEnum

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

TRUST_DOMAIN = "peertrain"
COORDINATOR_NAME = "coordinator"  # the name in every coordinator certificate's identity
# The DNS name agents and the command line verify: only coordinator certificates carry a name under the trust domain.
COORDINATOR_DNS_NAME = f"{COORDINATOR_NAME}.{TRUST_DOMAIN}"
_LABEL = r"[a-z0-9](?:[a-z0-9-]*[a-z0-9])?"
NAME_PATTERN = re.compile(rf"{_LABEL}(?:\.{_LABEL})*")  # verified as TLS host names: DNS labels, one form only
MAX_NAME_CHARS = 63
NODE_LIFETIME = datetime.timedelta(days=30)
OPERATOR_LIFETIME = datetime.timedelta(days=90)
CA_LIFETIME = datetime.timedelta(days=3650)
CLOCK_SKEW = datetime.timedelta(minutes=5)  # certificates start this early: clocks of a cluster differ a little
# A certificate is renewed once less than this share of its life is left (agents and the coordinator renew their
# own then), and the CA renews none earlier.
RENEWAL_SHARE = 1 / 3
MAX_PEM_BYTES = 16 << 10  # a certificate or a signing request from the network


class Role(StrEnum):
    NODE = "node"
    OPERATOR = "operator"
    COORDINATOR = "coordinator"


# Names no node or operator may take (nor any name under the trust domain); a name is also one role's only
# (coordinator.ca: a node cannot take an operator's name).
RESERVED_NAMES = frozenset({COORDINATOR_NAME, TRUST_DOMAIN})


class CertificateError(Exception):
    """A certificate or signing request that is malformed or not what peertrain issues; the message says why."""


@dataclass(frozen=True)
class Identity:
    role: Role
    name: str
    serial: str  # hex, as `coordinator cert list` shows and `cert revoke` takes
    not_before_unix: float
    not_after_unix: float
    sha256: str  # of the DER certificate, hex

    def __str__(self) -> str:
        return f"{self.role} {self.name}"


def name_problem(name: str) -> str | None:
    """What is wrong with the name of a node or operator (None: nothing)."""
    if len(name) > MAX_NAME_CHARS or not NAME_PATTERN.fullmatch(name):
        return (f"must be 1 to {MAX_NAME_CHARS} characters: labels of a-z 0-9 and inner hyphens, joined by single "
                "dots, with no dot at the end")
    if name in RESERVED_NAMES or name.endswith(f".{TRUST_DOMAIN}"):
        return f"is reserved ({COORDINATOR_NAME!r}, {TRUST_DOMAIN!r} and the names under it)"
    return None


def spiffe_uri(role: Role, name: str) -> str:
    return f"spiffe://{TRUST_DOMAIN}/{role}/{name}"


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def new_private_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def private_key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def load_private_key(pem: bytes) -> ec.EllipticCurvePrivateKey:
    key = serialization.load_pem_private_key(pem, password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise CertificateError("the key is not an ECDSA key")
    return key


def certificate_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def load_certificate(pem: bytes) -> x509.Certificate:
    if len(pem) > MAX_PEM_BYTES:
        raise CertificateError(f"a certificate is at most {MAX_PEM_BYTES} bytes")
    try:
        return x509.load_pem_x509_certificate(pem)
    except ValueError:
        raise CertificateError("not a PEM certificate") from None


def fingerprint(cert: x509.Certificate) -> str:
    """The SHA-256 of the certificate's DER form, hex: what `nodeagent serve --ca-fingerprint` pins."""
    return hashlib.sha256(cert.public_bytes(serialization.Encoding.DER)).hexdigest()


def create_ca(common_name: str = "peertrain cluster CA") -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A self-signed cluster CA. It also names the coordinator (DNS `coordinator`), because the coordinator presents
    it on the enrollment port: a new node that pinned its fingerprint can then verify that port's TLS with it."""
    key = new_private_key()
    subject = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, TRUST_DOMAIN),
                         x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = _now()
    cert = (
        x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW).not_valid_after(now + CA_LIFETIME)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(COORDINATOR_NAME)]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def signing_request(key: ec.EllipticCurvePrivateKey, role: Role, name: str) -> bytes:
    """A PEM certificate signing request for `role` `name` (the issuer decides what it grants)."""
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .add_extension(x509.SubjectAlternativeName([x509.UniformResourceIdentifier(spiffe_uri(role, name))]),
                       critical=False)
        .sign(key, hashes.SHA256())
    )
    return csr.public_bytes(serialization.Encoding.PEM)


def read_signing_request(pem: bytes) -> tuple[ec.EllipticCurvePublicKey, str]:
    """The public key and the requested name of a PEM signing request, its signature checked. Nothing else of it
    is used: the issuer writes the certificate from its own decisions."""
    if len(pem) > MAX_PEM_BYTES:
        raise CertificateError(f"a signing request is at most {MAX_PEM_BYTES} bytes")
    try:
        csr = x509.load_pem_x509_csr(pem)
    except ValueError:
        raise CertificateError("not a PEM certificate signing request") from None
    if not csr.is_signature_valid:
        raise CertificateError("the signing request's signature does not verify")
    key = csr.public_key()
    if not isinstance(key, ec.EllipticCurvePublicKey) or not isinstance(key.curve, ec.SECP256R1):
        raise CertificateError("the signing request's key must be ECDSA P-256")
    names = csr.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return key, str(names[0].value) if names else ""


def issue(ca_key: ec.EllipticCurvePrivateKey, ca_cert: x509.Certificate, public_key: ec.EllipticCurvePublicKey,
          role: Role, name: str, lifetime: datetime.timedelta | None = None) -> x509.Certificate:
    """A certificate for `role` `name`, signed by the cluster CA. Node and coordinator certificates serve and dial
    (server and client auth); operator certificates only dial."""
    if role is not Role.COORDINATOR and (problem := name_problem(name)):
        raise CertificateError(f"name {name[:80]!r}: {problem}")
    lifetime = lifetime or (OPERATOR_LIFETIME if role is Role.OPERATOR else NODE_LIFETIME)
    now = _now()
    sans: list[x509.GeneralName] = [x509.UniformResourceIdentifier(spiffe_uri(role, name))]
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH]
    if role is Role.NODE:
        sans.append(x509.DNSName(name))
    if role is Role.COORDINATOR:
        # Before issue 21 clients verified `coordinator`: kept beside the name they verify now, for those not
        # upgraded yet (no node can be called `coordinator`, nor anything a TLS check takes for it).
        sans += [x509.DNSName(COORDINATOR_DNS_NAME), x509.DNSName(COORDINATOR_NAME)]
    if role is not Role.OPERATOR:
        usages.append(ExtendedKeyUsageOID.SERVER_AUTH)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, TRUST_DOMAIN),
                                 x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, str(role)),
                                 x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject).public_key(public_key).serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW).not_valid_after(min(now + lifetime, ca_cert.not_valid_after_utc))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=False, crl_sign=False,
                                     content_commitment=False, key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return cert


def identity_of(cert: x509.Certificate) -> Identity:
    """The identity a peertrain certificate carries. Raises CertificateError for one without exactly one peertrain
    URI name (TLS has already checked that the cluster CA signed it)."""
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        raise CertificateError("the certificate names no peertrain identity") from None
    prefix = f"spiffe://{TRUST_DOMAIN}/"
    uris = [uri for uri in sans.get_values_for_type(x509.UniformResourceIdentifier) if uri.startswith(prefix)]
    if len(uris) != 1:
        raise CertificateError("the certificate must name exactly one peertrain identity")
    role_name, _, name = uris[0].removeprefix(prefix).partition("/")
    if role_name not in Role._value2member_map_ or not name:
        raise CertificateError("the certificate's peertrain identity has no known role")
    return Identity(Role(role_name), name, format(cert.serial_number, "x"), cert.not_valid_before_utc.timestamp(),
                    cert.not_valid_after_utc.timestamp(), fingerprint(cert))


def dns_names(cert: x509.Certificate) -> list[str]:
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return sans.get_values_for_type(x509.DNSName)


@functools.lru_cache(maxsize=1024)
def identity_of_pem(pem: bytes) -> Identity:
    """identity_of for a PEM certificate, cached: servers look up the caller's identity on every call."""
    return identity_of(load_certificate(pem))


def signed_by(cert: x509.Certificate, ca_cert: x509.Certificate) -> bool:
    """Whether the CA's key signed `cert` (its validity dates are the caller's to check)."""
    try:
        cert.verify_directly_issued_by(ca_cert)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def renewal_due(identity: Identity, now: float) -> bool:
    """Whether less than RENEWAL_SHARE of the certificate's life is ahead at Unix time `now`."""
    start, end = identity.not_before_unix, identity.not_after_unix
    return end <= start or (end - now) / (end - start) < RENEWAL_SHARE
