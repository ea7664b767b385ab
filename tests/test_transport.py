"""A process's credentials: a rotation of its files is taken up, its own renewal at once."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from nodeagent.security.pki import Role
from nodeagent.security.tls import CREDENTIALS_RECHECK_S, TlsDir, Transport

pytestmark = pytest.mark.unit


def test_files_rotated_by_another_process_are_read_within_the_recheck_interval(
        cluster_pki: Callable[[Role, str], TlsDir]) -> None:
    now = [100.0]
    directory = cluster_pki(Role.NODE, "n0")
    transport = Transport(directory, clock=lambda: now[0])
    first = transport.identity
    assert first is not None
    rotated = cluster_pki(Role.NODE, "n1").load()
    directory.save(rotated)  # as an operator's tooling would, beside the running process
    now[0] += CREDENTIALS_RECHECK_S / 2
    assert transport.credentials().identity == first  # the files are not looked at on every call
    now[0] += CREDENTIALS_RECHECK_S / 2
    assert transport.credentials().identity == rotated.identity


def test_the_process_own_renewal_is_read_at_once(cluster_pki: Callable[[Role, str], TlsDir]) -> None:
    transport = Transport(cluster_pki(Role.NODE, "n0"), clock=lambda: 100.0)  # a clock that never moves
    renewed = cluster_pki(Role.NODE, "n0").load()  # another key and serial for the same name
    assert transport.identity != renewed.identity
    transport.save(renewed)
    assert transport.credentials().identity == renewed.identity
