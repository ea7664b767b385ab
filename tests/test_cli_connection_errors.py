"""A command that cannot reach the coordinator as it expects says so in one line naming the address and the likely
cause, not in gRPC's words (`UNAVAILABLE: failed to connect to all addresses; ...`, `CERTIFICATE_VERIFY_FAILED ...
: OK`, `Method not found!`); an address without a port means the coordinator's default port, not gRPC's 443."""

from __future__ import annotations

import argparse
import socket
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from coordinator.ca import ClusterCA
from coordinator.cli import _client_settings
from coordinator.cli import main as coordinator_main
from nodeagent.defaults import COORDINATOR_PORT, ENROLL_PORT
from nodeagent.rpc import with_default_port
from nodeagent.security.pki import Role, private_key_pem
from nodeagent.security.tls import TlsDir, Transport

pytestmark = pytest.mark.integration

GRPC_WORDS = ("UNAVAILABLE", "UNKNOWN", "failed to connect", "CERTIFICATE_VERIFY_FAILED", "Method not found",
              "Socket closed", "handshake", ": OK")


def nowhere() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{probe.getsockname()[1]}"


@pytest.fixture
def pki(tmp_path: Path) -> tuple[ClusterCA, TlsDir, TlsDir]:
    """The cluster CA, an operator's credentials from it, and an operator's credentials from another cluster's CA."""
    ca = ClusterCA.init(tmp_path / "state")
    operator, stranger = TlsDir(tmp_path / "operator"), TlsDir(tmp_path / "stranger")
    ca.issue_files(operator, Role.OPERATOR, "alice")
    ClusterCA.init(tmp_path / "other-state").issue_files(stranger, Role.OPERATOR, "mallory")
    return ca, operator, stranger


@pytest.fixture
def servers() -> Iterator[list[grpc.Server]]:
    started: list[grpc.Server] = []
    yield started
    for server in started:
        server.stop(grace=None)


def serve(servers: list[grpc.Server], credentials: grpc.ServerCredentials | None) -> str:
    """A gRPC server on loopback that serves no call at all (as any port that is not the coordinator's)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    port = server.add_secure_port("127.0.0.1:0", credentials) if credentials else \
        server.add_insecure_port("127.0.0.1:0")
    server.start()
    servers.append(server)
    return f"127.0.0.1:{port}"


def error_line(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert coordinator_main(["jobs", *argv]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    [line] = captured.err.splitlines()
    assert not any(words in line for words in GRPC_WORDS), line
    return line


def test_nothing_listening_is_said_so_naming_the_address(capsys):
    address = nowhere()
    line = error_line(capsys, "--coordinator", address, "--insecure")
    assert line == f"coordinator: {address}: nothing listens there (connection refused): is it running, and is that " \
        "its port?"


def test_a_server_of_another_cluster_is_told_apart_from_one_that_is_not_there(capsys, pki, servers, tmp_path):
    ca, operator, stranger = pki
    coordinator_tls = TlsDir(tmp_path / "coordinator")
    ca.coordinator_credentials(coordinator_tls)
    address = serve(servers, Transport(coordinator_tls).server_credentials())
    line = error_line(capsys, "--coordinator", address, "--tls-dir", str(stranger.path))
    assert line.startswith(f"coordinator: {address}: its certificate is not signed by the CA in this side's ca.crt")
    # Plaintext against TLS: the --insecure of a command whose coordinator serves TLS.
    line = error_line(capsys, "--coordinator", address, "--insecure")
    assert line.startswith(f"coordinator: {address}: it closed the connection: a TLS server reached in plaintext")
    # The operator's own credentials get through the handshake: the server then does not serve the call.
    line = error_line(capsys, "--coordinator", address, "--tls-dir", str(operator.path))
    assert line.startswith(f"coordinator: {address}: it does not serve this call: not the coordinator's port")


def test_tls_against_a_plaintext_server_and_the_enrollment_port_are_named(capsys, pki, servers):
    ca, operator, _ = pki
    plaintext = serve(servers, None)
    line = error_line(capsys, "--coordinator", plaintext, "--tls-dir", str(operator.path))
    assert line.startswith(f"coordinator: {plaintext}: it answers in plaintext, not TLS: a coordinator serving with "
                           "--insecure")
    # The enrollment port serves under the CA's own certificate, which is not the coordinator's.
    enrollment = serve(servers, grpc.ssl_server_credentials([(private_key_pem(ca.key), ca.cert_pem)]))
    line = error_line(capsys, "--coordinator", enrollment, "--tls-dir", str(operator.path))
    assert line == f"coordinator: {enrollment}: its certificate is not the coordinator's: the enrollment port " \
        f"(default {ENROLL_PORT}) rather than the coordinator's (default {COORDINATOR_PORT}), or not the coordinator " \
        "at all"
    # And plaintext to a port that serves no such call.
    line = error_line(capsys, "--coordinator", plaintext, "--insecure")
    assert line.startswith(f"coordinator: {plaintext}: it does not serve this call")


@pytest.mark.parametrize(("given", "dialled"), [
    ("coordinator.example", f"coordinator.example:{COORDINATOR_PORT}"),
    ("10.0.0.5", f"10.0.0.5:{COORDINATOR_PORT}"),
    ("[::1]", f"[::1]:{COORDINATOR_PORT}"),
    ("fd00::5", f"[fd00::5]:{COORDINATOR_PORT}"),
    ("10.0.0.5:7000", "10.0.0.5:7000"),
    ("[::1]:7000", "[::1]:7000"),
    ("dns:///coordinator.example:7000", "dns:///coordinator.example:7000"),
])
def test_an_address_without_a_port_dials_the_coordinators_default_port(given, dialled):
    assert with_default_port(given, COORDINATOR_PORT) == dialled
    args = argparse.Namespace(coordinator=given, insecure=True, tls_dir=None)
    assert _client_settings(args) == (dialled, None)
