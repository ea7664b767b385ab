"""`coordinator backup` and `coordinator restore`: the coordinator's state directory as one archive, and back.

The archive (a gzip'd tar, written 0600: it holds the CA's private key) holds what a coordinator needs to come back
on another machine: the SQLite state, copied online with SQLite's backup API while the daemon runs (a consistent
snapshot, never a half-written page); the cluster CA (its key, certificate, issued and revoked certificates, join
tokens); the coordinator's own certificate; and, unless left out, the run directories under STATE_DIR/runs
(metrics, events, trained models, a parameter server's state). `manifest.json`, last in the archive, names every
file with its size and SHA-256; restore checks each, checks the database's integrity and that the CA's key is its
certificate's, and only then puts the files in place.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import sqlite3
import tarfile
import tempfile
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from nodeagent import __version__
from nodeagent.security.pki import CertificateError, load_certificate, load_private_key
from nodeagent.statedir import hold_state_dir

FORMAT = "peertrain-coordinator-backup"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
DATABASE = "coordinator.db"
CA_DIR = "ca"
TLS_DIR = "tls"
RUNS_DIR = "runs"
# Files of the state directory that are no state: locks (held by the running daemon), and SQLite's write-ahead
# files (the online copy of the database already holds what they hold).
SKIPPED = frozenset({"lock", ".lock", f"{DATABASE}-wal", f"{DATABASE}-shm"})
CHUNK = 1 << 20
MAX_MANIFEST_BYTES = 64 << 20


class BackupError(Exception):
    """A backup cannot be written or restored; the message says why and what to do."""


@dataclass(frozen=True)
class Manifest:
    created_unix: float
    peertrain_version: str
    state_dir: str  # where the state was (run directories' paths in the database start with its runs/)
    files: dict[str, tuple[int, str]]  # archive name -> (size, SHA-256)

    def to_json(self) -> bytes:
        return json.dumps({"format": FORMAT, "format_version": FORMAT_VERSION, "created_unix": self.created_unix,
                           "peertrain_version": self.peertrain_version, "state_dir": self.state_dir,
                           "files": {name: list(entry) for name, entry in self.files.items()}},
                          indent=1).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Manifest:
        try:
            fields = json.loads(data)
            if fields.get("format") != FORMAT:
                raise BackupError("not a peertrain coordinator backup (its manifest names another format)")
            if fields.get("format_version") != FORMAT_VERSION:
                raise BackupError(f"a backup of format version {fields.get('format_version')}; this peertrain "
                                  f"({__version__}) reads version {FORMAT_VERSION}")
            files = {str(name): (int(size), str(digest)) for name, (size, digest) in fields["files"].items()}
            return cls(float(fields["created_unix"]), str(fields["peertrain_version"]), str(fields["state_dir"]),
                       files)
        except (ValueError, TypeError, KeyError, AttributeError) as error:
            raise BackupError(f"the backup's manifest is damaged: {error}") from None


# -- backup ----------------------------------------------------------------------------------------------------


def write_backup(state_dir: Path, out: Path, force: bool = False, with_runs: bool = True) -> Manifest:
    """Archive the coordinator's state in `state_dir` to `out` (0600), online; refuses to replace `out` unless
    `force`."""
    database = state_dir / DATABASE
    if not database.is_file():
        raise BackupError(f"no coordinator state in {state_dir} (no {DATABASE}): give the coordinator's "
                          "--state-dir")
    if out.exists() and not force:
        raise BackupError(f"{out} exists: give another --out, or --force to replace it")
    if not out.parent.is_dir():
        raise BackupError(f"cannot write {out}: no directory {out.parent}")
    files: dict[str, tuple[int, str]] = {}
    fd, partial = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".partial")
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "wb") as raw, tarfile.open(fileobj=raw, mode="w:gz") as archive, \
                tempfile.TemporaryDirectory() as scratch:
            snapshot = Path(scratch) / DATABASE
            _copy_database(database, snapshot)
            _add(archive, snapshot, DATABASE, files)
            for name in (CA_DIR, TLS_DIR, *((RUNS_DIR,) if with_runs else ())):
                for path in _files_under(state_dir / name):
                    _add(archive, path, path.relative_to(state_dir).as_posix(), files)
            manifest = Manifest(time.time(), __version__, str(state_dir.resolve()), files)
            data = manifest.to_json()
            info = tarfile.TarInfo(MANIFEST)
            info.size, info.mode, info.mtime = len(data), 0o600, int(manifest.created_unix)
            archive.addfile(info, io.BytesIO(data))
            raw.flush()
            os.fsync(raw.fileno())
        os.replace(partial, out)
    except BaseException:
        Path(partial).unlink(missing_ok=True)
        raise
    return manifest


def _copy_database(database: Path, snapshot: Path) -> None:
    """An online, consistent copy of the running coordinator's database (SQLite's backup API)."""
    try:
        source = sqlite3.connect(f"file:{database}?mode=ro", uri=True, timeout=30)
        try:
            target = sqlite3.connect(snapshot)
            try:
                source.backup(target)
            finally:
                target.close()
        finally:
            source.close()
    except sqlite3.Error as error:
        raise BackupError(f"cannot copy {database}: {error}") from None


def _files_under(directory: Path) -> Iterator[Path]:
    if not directory.is_dir():
        return
    for root, dirs, names in os.walk(directory):
        dirs.sort()
        for name in sorted(names):
            path = Path(root) / name
            if name not in SKIPPED and path.is_file() and not path.is_symlink():
                yield path


def _add(archive: tarfile.TarFile, path: Path, name: str, files: dict[str, tuple[int, str]]) -> None:
    """One file, read once into a spool (a run's metrics may grow meanwhile: the size and digest describe the
    bytes archived)."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as source, tempfile.SpooledTemporaryFile(CHUNK) as spool:
        while chunk := source.read(CHUNK):
            digest.update(chunk)
            spool.write(chunk)
            size += len(chunk)
        spool.seek(0)
        info = tarfile.TarInfo(name)
        info.size, info.mode, info.mtime = size, path.stat().st_mode & 0o644, int(path.stat().st_mtime)
        archive.addfile(info, spool)
    files[name] = (size, digest.hexdigest())


# -- restore ---------------------------------------------------------------------------------------------------


def restore_backup(archive_path: Path, state_dir: Path, force: bool = False) -> Manifest:
    """Put the backup `archive_path` in place as the state in `state_dir`, after checking every file; refuses a
    state directory that holds anything unless `force` (which replaces the state there), and one in use."""
    if not archive_path.is_file():
        raise BackupError(f"no backup {archive_path}")
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    present = [p.name for p in state_dir.iterdir() if p.name not in SKIPPED]
    if present and not force:
        raise BackupError(f"{state_dir} is not empty ({', '.join(sorted(present)[:5])}): restore into an empty "
                          "directory, or give --force to replace the state there")
    with hold_state_dir(state_dir):  # refuses while a coordinator serves from it
        staging = Path(tempfile.mkdtemp(dir=state_dir, prefix=".restore-"))
        try:
            manifest = _extract_checked(archive_path, staging)
            _check_restored(staging)
            for name in (DATABASE, f"{DATABASE}-wal", f"{DATABASE}-shm", CA_DIR, TLS_DIR, RUNS_DIR):
                _remove(state_dir / name)
            for entry in staging.iterdir():
                os.replace(entry, state_dir / entry.name)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        _move_run_dirs(state_dir / DATABASE, Path(manifest.state_dir) / RUNS_DIR, state_dir.resolve() / RUNS_DIR)
    return manifest


def _extract_checked(archive_path: Path, staging: Path) -> Manifest:
    try:
        with tarfile.open(archive_path, mode="r:gz") as archive:
            members = archive.getmembers()
            by_name = {m.name: m for m in members}
            manifest_member = by_name.get(MANIFEST)
            if manifest_member is None or not manifest_member.isfile() or manifest_member.size > MAX_MANIFEST_BYTES:
                raise BackupError(f"{archive_path} is no complete backup: it has no {MANIFEST}")
            manifest = Manifest.from_json(_read(archive, manifest_member))
            names, listed = {m.name for m in members if m.name != MANIFEST}, set(manifest.files)
            if names != listed or len(names) != len(members) - 1:
                raise BackupError(f"{archive_path} does not hold the files its manifest names (missing: "
                                  f"{sorted(listed - names)[:3]}, not listed: {sorted(names - listed)[:3]})")
            if DATABASE not in names:
                raise BackupError(f"{archive_path} holds no {DATABASE}")
            for member in members:
                if member.name == MANIFEST:
                    continue
                target = _safe_target(staging, member)
                size, digest = manifest.files[member.name]
                data = _read(archive, member)
                if len(data) != size or hashlib.sha256(data).hexdigest() != digest:
                    raise BackupError(f"{archive_path}: {member.name} is damaged (its SHA-256 is not the manifest's)")
                target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
                fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, member.mode & 0o644 or 0o600)
                with os.fdopen(fd, "wb") as out:
                    out.write(data)
            return manifest
    except (tarfile.TarError, EOFError, OSError, zlib.error) as error:
        raise BackupError(f"cannot read the backup {archive_path}: {error}") from None


def _read(archive: tarfile.TarFile, member: tarfile.TarInfo) -> bytes:
    source = archive.extractfile(member)
    if source is None:
        raise BackupError(f"{member.name} in the backup is not a file")
    return source.read()


def _safe_target(staging: Path, member: tarfile.TarInfo) -> Path:
    """Where a member goes: a plain file under one of the state's directories, never outside `staging`."""
    path = PurePosixPath(member.name)
    if (not member.isfile() or path.is_absolute() or ".." in path.parts
            or (path.parts[0] not in (CA_DIR, TLS_DIR, RUNS_DIR) and member.name != DATABASE)):
        raise BackupError(f"the backup holds {member.name!r}, which is no file of a coordinator's state")
    return staging.joinpath(*path.parts)


def _check_restored(staging: Path) -> None:
    try:
        with sqlite3.connect(staging / DATABASE) as db:
            verdict = db.execute("PRAGMA integrity_check").fetchone()[0]
            db.execute("SELECT COUNT(*) FROM jobs").fetchone()
    except sqlite3.Error as error:
        raise BackupError(f"the backup's database cannot be read: {error}") from None
    if verdict != "ok":
        raise BackupError(f"the backup's database fails SQLite's integrity check: {verdict}")
    ca = staging / CA_DIR
    if (ca / "ca.key").exists() or (ca / "ca.crt").exists():
        try:
            key = load_private_key((ca / "ca.key").read_bytes())
            cert = load_certificate((ca / "ca.crt").read_bytes())
        except (OSError, CertificateError, ValueError) as error:
            raise BackupError(f"the backup's CA cannot be loaded: {error}") from None
        if key.public_key() != cert.public_key():
            raise BackupError("the backup's CA key is not its certificate's")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def _move_run_dirs(database: Path, before: Path, after: Path) -> None:
    """Jobs' run directories under the backed-up state's runs/ are under the restored state's runs/ now."""
    if before == after:
        return
    prefix = f"{before}/"
    with sqlite3.connect(database) as db:
        db.execute("UPDATE jobs SET run_dir = ? || substr(run_dir, ?) WHERE substr(run_dir, 1, ?) = ?",
                   (f"{after}/", len(prefix) + 1, len(prefix), prefix))
    db.close()
