"""Identities that cannot be mixed up: the agent reads its own credentials variable (PEERTRAIN_AGENT_TLS_DIR), not
the operator CLI's (PEERTRAIN_TLS_DIR); it refuses to start with a certificate of another role, naming its holder;
and a permission refusal at registration ends the start with its reason instead of being retried for ever."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from nodeagent._proto import coordinator_pb2_grpc
from nodeagent.agent.daemon import Agent, AgentConfig, RegistrationRefused
from nodeagent.security.pki import Role
from nodeagent.security.tls import TlsDir

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]


def start_agent(tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`nodeagent serve` with `env`, toward a coordinator that is not there: it ends by itself or not at all."""
    environment = {key: value for key, value in os.environ.items()
                   if key not in {"PEERTRAIN_TLS_DIR", "PEERTRAIN_AGENT_TLS_DIR", "PEERTRAIN_JOIN_TOKEN"}}
    environment |= {"PYTHONPATH": str(ROOT)} | env
    return subprocess.run(
        [sys.executable, "-m", "nodeagent.cli", "serve", "--coordinator", "127.0.0.1:1", "--listen", "127.0.0.1:0",
         "--metrics-listen", "", "--state-dir", str(tmp_path / "agent"), "--device", "cpu", "--name", "worker-0"],
        env=environment, capture_output=True, text=True, timeout=60, check=False)


def test_an_agent_does_not_take_the_operators_certificate(tmp_path: Path,
                                                          cluster_pki: Callable[[Role, str], TlsDir]) -> None:
    """From an operator's shell (PEERTRAIN_TLS_DIR set for the CLI), the agent looks in its own directory, which is
    empty: it says so at once, rather than registering for ever with the operator's certificate."""
    operator = cluster_pki(Role.OPERATOR, "admin")
    result = start_agent(tmp_path, {"PEERTRAIN_TLS_DIR": str(operator.path)})
    assert result.returncode == 1, result.stderr
    assert f"no certificate in {tmp_path / 'agent' / 'tls'}" in result.stderr
    assert "PEERTRAIN_TLS_DIR is the operator CLI's certificate" in result.stderr


def test_an_agent_given_an_operators_certificate_exits_naming_its_holder(
        tmp_path: Path, cluster_pki: Callable[[Role, str], TlsDir]) -> None:
    operator = cluster_pki(Role.OPERATOR, "admin")
    result = start_agent(tmp_path, {"PEERTRAIN_AGENT_TLS_DIR": str(operator.path)})
    assert result.returncode == 1, result.stderr
    [line] = [line for line in result.stderr.splitlines() if line.startswith("nodeagent: ")]
    assert f"{operator.path} holds the certificate of operator admin (role operator)" in line
    assert "needs a node certificate" in line


def test_an_agent_with_its_node_certificate_starts(tmp_path: Path,
                                                   cluster_pki: Callable[[Role, str], TlsDir]) -> None:
    """The role check lets a node's own certificate through (here it then waits for the absent coordinator)."""
    node = cluster_pki(Role.NODE, "worker-0")
    agent = Agent(AgentConfig(coordinator="127.0.0.1:1", listen="127.0.0.1:0", metrics_listen=None,
                              state_dir=tmp_path / "agent", tls_dir=node.path, name="worker-0"))
    outcome: list[object] = []
    starting = threading.Thread(target=lambda: outcome.append(agent.start()), daemon=True)
    starting.start()
    try:
        starting.join(timeout=3)
        assert starting.is_alive(), f"the agent did not wait for its coordinator: {outcome}"
        assert agent.node_id == "worker-0"
    finally:
        agent.stop()
        starting.join(timeout=10)
    assert outcome == [False]


class RefusingCoordinator(coordinator_pb2_grpc.CoordinatorServicer):
    """Refuses registration as the coordinator's authorizer does a caller of the wrong role."""

    def Register(self, request, context):
        context.abort(grpc.StatusCode.PERMISSION_DENIED,
                      "Register needs a node certificate; the caller is operator admin")


@pytest.fixture
def refusing_coordinator() -> Iterator[str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    coordinator_pb2_grpc.add_CoordinatorServicer_to_server(RefusingCoordinator(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(grace=None)


def test_a_permission_refusal_at_registration_is_not_retried(refusing_coordinator: str, tmp_path: Path) -> None:
    agent = Agent(AgentConfig(coordinator=refusing_coordinator, listen="127.0.0.1:0", metrics_listen=None,
                              state_dir=tmp_path / "agent", name="worker-0"))
    outcome: list[object] = []

    def start() -> None:
        try:
            outcome.append(agent.start())
        except RegistrationRefused as refusal:
            outcome.append(refusal)

    starting = threading.Thread(target=start, daemon=True)
    starting.start()
    starting.join(timeout=15)
    agent.stop()
    starting.join(timeout=10)
    [refusal] = outcome
    assert isinstance(refusal, RegistrationRefused), f"retried as if transient: {outcome}"
    assert str(refusal) == (f"coordinator {refusing_coordinator} refused this node: Register needs a node "
                            "certificate; the caller is operator admin")
