"""A daemon's directories: its state directory, held by one process at a time, and directories it must write in."""

from __future__ import annotations

import fcntl
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class StateDirError(Exception):
    """A directory the daemon cannot use; the message names it and says why."""


def writable_directory(path: Path, what: str) -> None:
    """Create `path` if need be and check that this process can write in it; `what` names it in the error."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise StateDirError(f"cannot create {what} {path}: {error.strerror}") from None
    try:
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as error:
        raise StateDirError(f"cannot write in {what} {path}: {error.strerror}") from None


@contextmanager
def hold_state_dir(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on the state directory `path` (created if need be) for the with-block: a second daemon
    given the same directory refuses to start rather than share its node id or its database. The lock is the
    kernel's (flock on `path/lock`), so it ends with the process however that ends; the file names the holder's pid.
    """
    writable_directory(path, "state directory")
    lock_path = path / "lock"
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as error:
        raise StateDirError(f"cannot write in state directory {path}: {error.strerror}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
            by = f" (pid {holder})" if holder.isdigit() else ""
            raise StateDirError(f"state directory {path} is in use by another process{by}") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock
