"""The cluster CA: its key and certificate, join tokens, issuance, renewal and revocation.

A node holds one live certificate: a new one for its name (renewal, `cert issue --node`) supersedes the others,
which are revoked as it is issued. A name is held by one role. A certificate is renewed once, in the last third of
its life (pki.RENEWAL_SHARE), and only while it is the newest of its identity: a flood of renewals issues at most
one certificate.

Everything lives in files under STATE_DIR/ca, so that the offline commands (`coordinator ca init`, `cert issue`,
`cert list`, `cert revoke`) and the running coordinator share it:
- ca.key (mode 0600) and ca.crt;
- issued.jsonl: one line per certificate issued (serial, role, name, issued and expiry times);
- revoked.jsonl: one line per revocation; the coordinator reads it again whenever it changes;
- tokens.json: join tokens by their SHA-256 (the tokens themselves are never stored), with their expiry.
"""

from __future__ import annotations

import datetime
import fcntl
import hashlib
import json
import secrets
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from nodeagent.security.pki import (
    COORDINATOR_DNS_NAME,
    COORDINATOR_NAME,
    RENEWAL_SHARE,
    CertificateError,
    Identity,
    Role,
    certificate_pem,
    create_ca,
    dns_names,
    fingerprint,
    identity_of,
    issue,
    load_certificate,
    load_private_key,
    new_private_key,
    private_key_pem,
    renewal_due,
)
from nodeagent.security.tls import Credentials, TlsDir, write_private_file

DEFAULT_TOKEN_TTL_S = 3600.0
MAX_TOKEN_TTL_S = 7 * 86400.0
MAX_LIVE_TOKENS = 1000  # a bound on tokens.json, whatever an operator asks for


class CAError(Exception):
    """The CA cannot be used or cannot do what was asked; the message says why and what to do."""


@dataclass(frozen=True)
class IssuedCertificate:
    serial: str
    role: str
    name: str
    issued_unix: float
    not_after_unix: float
    revoked_unix: float = 0.0


class ClusterCA:
    def __init__(self, directory: Path, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate):
        self.directory = directory
        self.key = key
        self.cert = cert
        self.cert_pem = certificate_pem(cert)
        self.fingerprint = fingerprint(cert)
        self._lock = threading.Lock()
        self._revoked_stamp: int | None = None
        self._revoked: dict[str, float] = {}
        self._live_stamp: tuple[int, int, int] | None = None
        self._live: list[str] = []

    # -- files -----------------------------------------------------------------------------------------------

    @staticmethod
    def directory_of(state_dir: Path) -> Path:
        return state_dir / "ca"

    @classmethod
    def init(cls, state_dir: Path) -> ClusterCA:
        """Create the cluster CA; refuses to replace one (every certificate of the cluster hangs on it)."""
        directory = cls.directory_of(state_dir)
        if (directory / "ca.key").exists():
            raise CAError(f"{directory} already holds a CA; its certificates would all be lost with it")
        directory.mkdir(parents=True, exist_ok=True)
        directory.chmod(0o700)
        key, cert = create_ca()
        write_private_file(directory / "ca.key", private_key_pem(key))
        write_private_file(directory / "ca.crt", certificate_pem(cert), 0o644)
        return cls(directory, key, cert)

    @classmethod
    def load(cls, state_dir: Path) -> ClusterCA:
        directory = cls.directory_of(state_dir)
        try:
            key = load_private_key((directory / "ca.key").read_bytes())
            cert = load_certificate((directory / "ca.crt").read_bytes())
        except FileNotFoundError:
            raise CAError(f"no cluster CA in {directory}: create it with `coordinator ca init --state-dir "
                          f"{state_dir}` (or serve with --insecure, for local experiments only)") from None
        except (OSError, CertificateError, ValueError) as error:
            raise CAError(f"cannot load the cluster CA from {directory}: {error}") from None
        return cls(directory, key, cert)

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """One writer at a time, across the daemon's threads and the offline commands."""
        with self._lock, open(self.directory / ".lock", "a") as lock_file:
            fcntl.flock(lock_file, fcntl.LOCK_EX)
            yield

    def _append(self, name: str, record: dict) -> None:
        with open(self.directory / name, "a") as out:
            out.write(json.dumps(record) + "\n")

    def _records(self, name: str) -> list[dict]:
        try:
            lines = (self.directory / name).read_text().splitlines()
        except FileNotFoundError:
            return []
        return [json.loads(line) for line in lines if line.strip()]

    # -- issuance --------------------------------------------------------------------------------------------

    def issue(self, public_key: ec.EllipticCurvePublicKey, role: Role, name: str,
              lifetime: datetime.timedelta | None = None) -> x509.Certificate:
        """A certificate for `role` `name`. Raises CertificateError for a name that is not allowed or that a live
        certificate of another role holds."""
        with self._locked():
            return self._issue(public_key, role, name, lifetime)

    def renew(self, current: Identity, public_key: ec.EllipticCurvePublicKey) -> x509.Certificate:
        """A new certificate for the identity of the certificate `current`, which must be in the last third of its
        life and the newest of its identity (renewed once). Raises CAError saying when it can be renewed."""
        if not renewal_due(current, time.time()):
            due = current.not_after_unix - RENEWAL_SHARE * (current.not_after_unix - current.not_before_unix)
            raise CAError(f"certificate {current.serial} is renewed from {_day(due)} on, in the last third of its "
                          "life")
        with self._locked():
            mine = [c for c in self.certificates() if (c.role, c.name) == (current.role, current.name)]
            newest = max(mine, key=lambda c: c.issued_unix, default=None)
            if newest is None or newest.serial != current.serial:
                raise CAError(f"certificate {current.serial} was renewed already"
                              f"{f' (by {newest.serial})' if newest else ''}: a certificate is renewed once")
            return self._issue(public_key, current.role, current.name, None)

    def _issue(self, public_key: ec.EllipticCurvePublicKey, role: Role, name: str,
               lifetime: datetime.timedelta | None) -> x509.Certificate:
        """Under the lock: issue, record, and for a node revoke the certificates it supersedes."""
        held = [c for c in self.certificates() if c.name == name and _live(c)]
        if any(c.role != role for c in held):
            raise CertificateError(f"name {name!r} is held by a {held[0].role} certificate")
        cert = issue(self.key, self.cert, public_key, role, name, lifetime)
        identity = identity_of(cert)
        self._append("issued.jsonl", asdict(IssuedCertificate(
            identity.serial, str(role), name, time.time(), identity.not_after_unix)))
        if role is Role.NODE:  # one live certificate per node: the new one supersedes the others
            now = time.time()
            for superseded in held:
                self._append("revoked.jsonl", {"serial": superseded.serial, "revoked_unix": now})
        return cert

    def issue_files(self, tls_dir: TlsDir, role: Role, name: str,
                    lifetime: datetime.timedelta | None = None) -> Identity:
        """A new key and certificate for `role` `name`, written with the CA certificate into `tls_dir`."""
        key = new_private_key()
        cert = self.issue(key.public_key(), role, name, lifetime)
        tls_dir.save(Credentials(self.cert_pem, certificate_pem(cert), private_key_pem(key)))
        return identity_of(cert)

    def coordinator_credentials(self, tls_dir: TlsDir) -> Identity:
        """The coordinator's own certificate in `tls_dir`: issued when missing, from another CA, without the DNS
        name clients verify now (one issued before that name), or in the last third of its life (checked at start
        and every few minutes while serving)."""
        if tls_dir.complete():
            try:
                current = tls_dir.load()
                if current.ca_pem == self.cert_pem and COORDINATOR_DNS_NAME in dns_names(current.certificate) and \
                        not renewal_due(current.identity, time.time()):
                    return current.identity
            except Exception:  # unreadable or mismatched: replaced below
                pass
        return self.issue_files(tls_dir, Role.COORDINATOR, COORDINATOR_NAME)

    def certificates(self) -> list[IssuedCertificate]:
        revoked = self.revoked()
        return [IssuedCertificate(**{**record, "revoked_unix": revoked.get(record["serial"], 0.0)})
                for record in self._records("issued.jsonl")]

    # -- revocation ------------------------------------------------------------------------------------------

    def revoked(self) -> dict[str, float]:
        """Serial -> when it was revoked; read again when the file changed (another process may revoke)."""
        stamp = self._stamp("revoked.jsonl")
        if stamp != self._revoked_stamp:
            self._revoked = {r["serial"]: r["revoked_unix"] for r in self._records("revoked.jsonl")}
            self._revoked_stamp = stamp
        return self._revoked

    def is_revoked(self, identity: Identity) -> bool:
        return identity.serial in self.revoked()

    def revoke(self, serial: str = "", name: str = "") -> list[str]:
        """Revoke one certificate by serial, or every one issued to `name`; returns the serials revoked now.
        Raises CAError when nothing matches."""
        serial = serial.lower().removeprefix("0x")
        issued = self.certificates()
        if serial:
            matches = [c for c in issued if c.serial == serial]
        else:
            matches = [c for c in issued if c.name == name and c.role != Role.COORDINATOR]
        if not matches:
            raise CAError(f"no certificate {'with serial ' + serial[:40] if serial else 'of ' + repr(name[:64])} "
                          "was issued by this CA (see `coordinator cert list`)")
        now = time.time()
        fresh = [c.serial for c in matches if not c.revoked_unix]
        with self._locked():
            for serial_hex in fresh:
                self._append("revoked.jsonl", {"serial": serial_hex, "revoked_unix": now})
        return fresh

    def live_revocations(self) -> list[str]:
        """Revoked serials of certificates that have not expired: what agents must refuse. Every assignment carries
        them, so the answer is kept until a file changes or a minute passes (expiry drops serials from it)."""
        stamp = (self._stamp("issued.jsonl"), self._stamp("revoked.jsonl"), int(time.time() // 60))
        if stamp != self._live_stamp:
            now = time.time()
            self._live = sorted(c.serial for c in self.certificates() if c.revoked_unix and c.not_after_unix > now)
            self._live_stamp = stamp
        return self._live

    def _stamp(self, name: str) -> int:
        try:
            return (self.directory / name).stat().st_mtime_ns
        except FileNotFoundError:
            return 0

    # -- join tokens -----------------------------------------------------------------------------------------

    def create_token(self, ttl_s: float = DEFAULT_TOKEN_TTL_S) -> tuple[str, float]:
        """A one-time join token and its expiry time."""
        if not 0 < ttl_s <= MAX_TOKEN_TTL_S:
            raise CAError(f"a token's time to live must be in (0, {MAX_TOKEN_TTL_S:g}] seconds")
        token = secrets.token_urlsafe(32)
        expires = time.time() + ttl_s
        with self._locked():
            tokens = self._live_tokens()
            if len(tokens) >= MAX_LIVE_TOKENS:
                raise CAError(f"{MAX_LIVE_TOKENS} join tokens are live already; use them or let them expire")
            tokens[_token_hash(token)] = expires
            write_private_file(self.directory / "tokens.json", json.dumps(tokens).encode())
        return token, expires

    def token_live(self, token: str) -> bool:
        """Whether a join token may still be spent (known, unused, not expired); spends nothing."""
        with self._locked():
            return _token_hash(token) in self._live_tokens()

    def use_token(self, token: str) -> bool:
        """Spend a join token: True once for a live one, False for an unknown, used or expired one."""
        with self._locked():
            tokens = self._live_tokens()
            expires = tokens.pop(_token_hash(token), None)
            if expires is not None:  # a wrong guess writes nothing
                write_private_file(self.directory / "tokens.json", json.dumps(tokens).encode())
        return expires is not None

    def _live_tokens(self) -> dict[str, float]:
        try:
            tokens = json.loads((self.directory / "tokens.json").read_text())
        except FileNotFoundError:
            return {}
        now = time.time()
        return {digest: expires for digest, expires in tokens.items() if expires > now}

    def names_in_use(self) -> set[str]:
        """Names that hold a valid certificate (issued, not revoked, not expired)."""
        return {c.name for c in self.certificates() if _live(c)}


def _live(cert: IssuedCertificate) -> bool:
    return not cert.revoked_unix and cert.not_after_unix > time.time()


def _day(unix: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(unix))


def _token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()
